"""Who owns each page of a paged allocator: catches a page freed twice (or never allocated).

A second free of the same page puts it on the free list twice: two requests are then handed the
same page and overwrite each other's KV. The allocator's free list lives on the GPU and the pages a
caller frees are GPU tensors (rows looked up on the device), so their ids are not known on the CPU;
reading them back would make every free wait for the GPU, behind the forward pass in flight.

Two modes:

* **eager** (the CPU, and ``checked=True`` on a GPU): every free is checked before anything changes,
  and a bad free raises at once with the allocator untouched. On a GPU this reads the ids back (a
  host sync per free; for tests and debugging).
* **deferred** (production on a GPU): the check runs on the device, in the stream order of the free,
  with no host wait: ``owner[page]`` counts allocations minus frees (1 allocated, 0 free), a free
  subtracts one from each of its pages, and any page that ends below zero (freed twice, twice in one
  call, never allocated, page 0 or out of range) is recorded in a device-side minimum and count. The
  record is copied to pinned host memory after each free and read when that copy has landed (an event
  query, no wait), at the start of the next allocation or free; :meth:`PageOwnership.verify` reads it
  at once. The error then names the lowest offending page and how many were freed wrongly. Cost per
  free: eight small kernels (clamp, index_add, gather, compare, select, min, minimum, sum) plus the
  index_fill, the copy and an event record, each a launch of a few microseconds of host time and no
  wait; per allocation one index_fill. Frees happen when requests end, are demoted or promoted, not
  per token (not measured on a GPU yet: tests/gpu/test_allocator_gpu.py checks that no call syncs).
"""

from __future__ import annotations

import torch

from hisparse_sglang.errors import HiSparseMemoryError

__all__ = ["PageOwnership"]

_NONE = 2**62  # "no offending page yet" in the running minimum


class PageOwnership:
    """Allocation state of ``num_pages`` pages (page 0 reserved) of the pool called ``name``.

    Args:
        deferred: check frees on the device and report at the next call (see the module docstring);
            False checks every free at once.
    """

    def __init__(self, name: str, num_pages: int, device: torch.device, deferred: bool) -> None:
        self.name = name
        self.num_pages = num_pages
        self.device = device
        self.deferred = deferred
        # One extra entry past the last page absorbs frees of out-of-range ids (never allocated).
        self._owner = torch.zeros(num_pages + 1, dtype=torch.int32, device=device)
        self._event = None
        if deferred:
            self._minus_one = torch.full((num_pages,), -1, dtype=torch.int32, device=device)
            # [lowest offending page, offending frees]
            self._record = torch.tensor([_NONE, 0], dtype=torch.int64, device=device)
            pinned = device.type == "cuda"
            self._record_host = torch.tensor([_NONE, 0], dtype=torch.int64).pin_memory() if pinned else None
            self._event = torch.cuda.Event() if pinned else None
            self._copied = False

    def clear(self) -> None:
        """Every page free (the allocator's clear); reports a pending bad free first."""
        self.verify()
        self._owner.zero_()

    def claim(self, pages: torch.Tensor) -> None:
        """``pages`` (distinct, from the free list) are allocated now."""
        self.raise_if_broken()
        self._owner.index_fill_(0, pages, 1)

    def release(self, pages: torch.Tensor) -> None:
        """``pages`` are freed now (int64 on the device). Eager mode raises before changing anything."""
        self.raise_if_broken()
        if not self.deferred:
            self._check_now(pages)
            self._owner.index_fill_(0, pages, 0)
            return
        safe = pages.clamp(0, self.num_pages)  # page 0 and the extra entry are never owned
        self._owner.index_add_(0, safe, self._minus_one[: pages.numel()])
        bad = self._owner[safe] < 0
        offending = torch.where(bad, pages, torch.full_like(pages, _NONE))
        torch.minimum(self._record[:1], offending.min().reshape(1), out=self._record[:1])
        self._record[1:] += bad.sum()
        self._owner.index_fill_(0, safe, 0)
        if self._record_host is not None:
            self._record_host.copy_(self._record, non_blocking=True)
            self._event.record()
            self._copied = True

    def raise_if_broken(self) -> None:
        """Raise if a deferred check found a bad free (without waiting for the GPU)."""
        if not self.deferred:
            return
        if self._record_host is None:
            self._raise_for(self._record.tolist())
        elif self._copied and self._event.query():
            self._raise_for(self._record_host.tolist())

    def verify(self) -> None:
        """Raise now if any free so far was bad (waits for the GPU in deferred mode)."""
        if self.deferred:
            self._raise_for(self._record.tolist())

    def _raise_for(self, record: list[int]) -> None:
        lowest, count = record
        if count:
            raise HiSparseMemoryError(self._message(lowest, count))

    def _message(self, page: int, count: int) -> str:
        if 1 <= page < self.num_pages:
            what = f"double free of page {page} (it is not allocated)"
        else:
            what = f"page {page} is outside [1, {self.num_pages}) (freed but never allocatable)"
        others = f" ({count} bad page frees in all; the lowest page is named)" if count > 1 else ""
        return (
            f"{self.name} pool: {what}{others}. Two requests could now be handed the same page: this is a bug in "
            f"the caller of free; restart the server and report this message."
        )

    def _check_now(self, pages: torch.Tensor) -> None:
        low, high = int(pages.min()), int(pages.max())
        if low < 1 or high >= self.num_pages:
            raise HiSparseMemoryError(self._message(low if low < 1 else high, 1))
        unique = torch.unique(pages)
        if unique.numel() != pages.numel():
            counts = torch.bincount(pages - low)
            repeated = int(torch.nonzero(counts > 1)[0]) + low
            raise HiSparseMemoryError(
                f"{self.name} pool: double free: page {repeated} is freed twice in one call; the caller must free "
                f"distinct pages."
            )
        free = pages[self._owner[pages] == 0]
        if free.numel():
            raise HiSparseMemoryError(self._message(int(free.min()), free.numel()))
