"""Locations held back from reuse for a while after their request ended.

In PD disaggregation the prefill instance writes a request's KV into the decode instance's host
rows. When the transfer does not complete (it failed, timed out, or the request was aborted while
it ran) the decode side releases the request, but writes of the prefill instance may still be in
flight (RDMA writes queued before a timeout, a stalled sender that resumes). Rows handed to another
request at once could receive those stale bytes. The quarantine keeps such rows allocated for a
grace period, then frees them.

Usage: :meth:`RowQuarantine.expect` marks the locations of a request that is about to be released;
the allocator passes every ``free`` through :meth:`RowQuarantine.intercept`, which keeps the
marked locations, and frees what :meth:`RowQuarantine.expired` returns.
"""

from __future__ import annotations

import collections
import time
from typing import Callable

import torch

__all__ = ["RowQuarantine"]


class RowQuarantine:
    """A grace period for the locations of requests whose KV writes may still land.

    Args:
        seconds: how long intercepted locations are held (0 disables the quarantine).
        clock: monotonic time source (tests pass a fake one).
    """

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.seconds = seconds
        self.clock = clock
        self._expected: list[torch.Tensor] = []
        self._held: collections.deque[tuple[float, torch.Tensor]] = collections.deque()
        self.rows_held = 0

    def expect(self, locs: torch.Tensor) -> None:
        """Hold these locations when they are next freed."""
        if self.seconds > 0 and locs.numel():
            self._expected.append(locs.reshape(-1).to(torch.int64))

    def intercept(self, free_index: torch.Tensor) -> torch.Tensor:
        """The part of ``free_index`` to free now; expected locations are held instead."""
        if not self._expected:
            return free_index
        free_index = free_index.reshape(-1)
        expected = torch.cat([locs.to(free_index.device) for locs in self._expected])
        held_mask = torch.isin(free_index, expected)
        held = free_index[held_mask]
        if held.numel():
            self._held.append((self.clock() + self.seconds, held))
            self.rows_held += held.numel()
            # An expectation ends once all its locations were freed.
            self._expected = [locs for locs in self._expected if not bool(torch.isin(locs.to(held.device), held).all())]
        return free_index[~held_mask]

    def expired(self) -> list[torch.Tensor]:
        """Locations whose grace period is over (each returned once)."""
        now = self.clock()
        released = []
        while self._held and self._held[0][0] <= now:
            _, locs = self._held.popleft()
            self.rows_held -= locs.numel()
            released.append(locs)
        return released

    def clear(self) -> None:
        self._expected.clear()
        self._held.clear()
        self.rows_held = 0
