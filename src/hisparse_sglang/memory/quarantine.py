"""Pages held back from reuse for a while after their request ended.

In PD disaggregation the prefill instance writes a request's KV into the decode instance's host
rows. When the transfer does not complete (it failed, timed out, or the request was aborted while
it ran) the decode side releases the request, but writes of the prefill instance may still be in
flight (RDMA writes queued before a timeout, a stalled sender that resumes). Rows handed to another
request at once could receive those stale bytes. The quarantine keeps such rows allocated for a
grace period, then frees them.

Usage: :meth:`RowQuarantine.expect` names the locations of a request that is about to be released;
the allocator passes every ``free`` through :meth:`RowQuarantine.intercept`, which keeps back the
pages of those locations, and frees what :meth:`RowQuarantine.expired` returns.

The allocator frees whole pages (freeing any location of a page frees the page), so the quarantine
holds whole pages too: a page holding any expected location is held as a whole, whatever else of it
the same or a later ``free`` names, and it is returned exactly once, when its last hold has expired.
An expectation belongs to one request and ends as soon as every one of its locations was freed,
whether in one ``free`` or in several.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable, Hashable

import torch

from hisparse_sglang.errors import HiSparseMemoryError

__all__ = ["RowQuarantine"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class _HeldPage:
    deadline: float
    offsets: set[int]  # in-page offsets of the freed locations that are held


class RowQuarantine:
    """A grace period for the pages of requests whose KV writes may still land.

    Args:
        seconds: how long a page is held after its last location was freed (0 disables the
            quarantine: nothing is expected, nothing held).
        page_size: rows per page of the allocator whose frees pass through :meth:`intercept`.
        clock: monotonic time source (tests pass a fake one).
    """

    def __init__(self, seconds: float, page_size: int, clock: Callable[[], float] = time.monotonic) -> None:
        if page_size < 1:
            raise HiSparseMemoryError(f"quarantine page_size ({page_size}) must be >= 1: pass the allocator's page size.")
        self.seconds = seconds
        self.page_size = page_size
        self.clock = clock
        # request key -> its expected locations not freed yet (CPU int64, sorted, distinct)
        self._expected: dict[Hashable, torch.Tensor] = {}
        self._held: dict[int, _HeldPage] = {}
        self._rows_held = 0

    # ------------------------------------------------------------------ accounting
    @property
    def rows_held(self) -> int:
        """Distinct freed locations whose pages are held."""
        return self._rows_held

    @property
    def pages_held(self) -> int:
        """Pages kept allocated by the quarantine (each is returned once by :meth:`expired`)."""
        return len(self._held)

    def held_pages(self) -> torch.Tensor:
        """Ids of the held pages (CPU int64, ascending)."""
        return torch.tensor(sorted(self._held), dtype=torch.int64)

    @property
    def requests_expected(self) -> int:
        """Requests with expected locations that were not all freed yet."""
        return len(self._expected)

    # ------------------------------------------------------------------ the three calls
    def expect(self, request: Hashable, locs: torch.Tensor) -> None:
        """Hold the pages of these locations of ``request`` when they are freed.

        A later call for the same ``request`` replaces this one (a request slot reused).
        """
        self._expected.pop(request, None)
        if self.seconds <= 0:
            return
        locs = torch.unique(locs.reshape(-1).to(device="cpu", dtype=torch.int64))
        if locs.numel():
            self._expected[request] = locs

    def intercept(self, free_index: torch.Tensor) -> torch.Tensor:
        """The part of ``free_index`` to free now (same device); the rest is held.

        Held: every location on a page that holds an expected location, and every location on a
        page already held (a request freed in several parts, or a page whose tail was freed later).
        """
        if not self._expected and not self._held:
            return free_index
        locs = free_index.reshape(-1).to(device="cpu", dtype=torch.int64)
        if locs.numel() == 0:
            return free_index
        pages = locs // self.page_size
        expected_hit = torch.zeros_like(locs, dtype=torch.bool)
        for request, expected in list(self._expected.items()):
            hit = torch.isin(locs, expected)
            if not bool(hit.any()):
                continue
            expected_hit |= hit
            remaining = expected[~torch.isin(expected, locs)]
            if remaining.numel():
                self._expected[request] = remaining
            else:
                del self._expected[request]
        hold_pages = pages[expected_hit]
        if self._held:
            hold_pages = torch.cat([hold_pages, torch.tensor(list(self._held), dtype=torch.int64)])
        hold = torch.isin(pages, hold_pages)
        if not bool(hold.any()):
            return free_index
        self._hold(pages[hold], locs[hold] % self.page_size)
        keep = ~hold
        return free_index.reshape(-1)[keep.to(free_index.device)]

    def expired(self) -> torch.Tensor:
        """Every row of the pages whose hold is over (CPU int64), each page returned once."""
        if not self._held:
            return torch.empty(0, dtype=torch.int64)
        now = self.clock()
        released = [page for page, held in self._held.items() if held.deadline <= now]
        if not released:
            return torch.empty(0, dtype=torch.int64)
        for page in released:
            self._rows_held -= len(self._held.pop(page).offsets)
        pages = torch.tensor(sorted(released), dtype=torch.int64)
        rows = (pages[:, None] * self.page_size + torch.arange(self.page_size)).reshape(-1)
        # A location of a released page can no longer be freed by the request it was expected
        # from (the page left that request); do not let it catch the page's next owner.
        for request, expected in list(self._expected.items()):
            remaining = expected[~torch.isin(expected // self.page_size, pages)]
            if remaining.numel():
                self._expected[request] = remaining
            else:
                del self._expected[request]
        logger.debug("HiSparse quarantine: %d pages released, %d still held", len(released), len(self._held))
        return rows

    def clear(self) -> None:
        self._expected.clear()
        self._held.clear()
        self._rows_held = 0

    # ------------------------------------------------------------------ helpers
    def _hold(self, pages: torch.Tensor, offsets: torch.Tensor) -> None:
        deadline = self.clock() + self.seconds
        for page, offset in zip(pages.tolist(), offsets.tolist()):
            held = self._held.get(page)
            if held is None:
                held = self._held[page] = _HeldPage(deadline, set())
            else:
                held.deadline = max(held.deadline, deadline)
            if offset not in held.offsets:
                held.offsets.add(offset)
                self._rows_held += 1
