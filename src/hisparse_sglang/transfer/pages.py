"""Where the decode receiver gets host pages from: a small interface and two adapters.

A page is ``page_size`` consecutive rows of the host KV pool; page ``p`` holds rows
``[p * page_size, (p + 1) * page_size)`` of every layer. Page 0 is never handed out (SGLang writes
the KV of padded tokens to location 0).

* :class:`OwnPages` gives the receiver a private :class:`~hisparse_sglang.memory.PagedAllocator`
  over the whole pool (tests, benchmarks, standalone transfers).
* :class:`LogicalPages` takes pages from a :class:`~hisparse_sglang.memory.KVAllocator`'s logical
  (= host) space without device rows (``alloc_extend(..., with_device_rows=False)``), so a
  completed transfer can be admitted into decoding by the framework-free
  :class:`~hisparse_sglang.coordinator.Coordinator` (``admit_direct``) and freed through the same
  allocator when the request ends (``KVAllocator.free`` also frees device pages it mapped).
"""

from __future__ import annotations

from typing import Protocol, Sequence

import torch

from hisparse_sglang.memory.allocator import KVAllocator
from hisparse_sglang.memory.paged import PagedAllocator

__all__ = ["PageAllocator", "OwnPages", "LogicalPages"]


class PageAllocator(Protocol):
    """What the receiver needs from an allocator of host pages.

    Attributes:
        page_size: rows per page.
        num_pages: page ids lie in ``[1, num_pages)``; page 0 is reserved.
    """

    page_size: int
    num_pages: int

    @property
    def free_page_count(self) -> int:
        """Pages :meth:`alloc_pages` can hand out now."""

    def alloc_pages(self, count: int) -> list[int] | None:
        """``count`` distinct page ids (none taken and None returned if fewer are free)."""

    def free_pages(self, pages: Sequence[int]) -> None:
        """Return pages taken by :meth:`alloc_pages` (each once)."""


class OwnPages:
    """A private paged allocator over ``num_pages`` pages (frees kept sorted: grants stay in runs).

    Args:
        num_pages: pages of the pool, page 0 included.
        page_size: rows per page.
        checked: verify every free against an ownership table (a double free raises).
    """

    def __init__(self, num_pages: int, page_size: int, checked: bool = True) -> None:
        self.paged = PagedAllocator("decode host", num_pages, page_size, sort_frees=True, checked=checked)
        self.page_size = page_size
        self.num_pages = num_pages

    @property
    def free_page_count(self) -> int:
        return self.paged.free_pages

    def alloc_pages(self, count: int) -> list[int] | None:
        if count > self.paged.free_pages:
            return None
        return self.paged.alloc_pages(count).tolist()

    def free_pages(self, pages: Sequence[int]) -> None:
        self.paged.free_pages_(torch.tensor(list(pages), dtype=torch.int64))


class LogicalPages:
    """Logical (= host) pages of a :class:`KVAllocator`, allocated without device rows.

    The allocator may be shared with the decode scheduler: it sees these pages as used, and a
    request's pages belong to the scheduler once the receiver hands the request over.
    """

    def __init__(self, allocator: KVAllocator) -> None:
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.num_pages = allocator.logical.num_pages

    @property
    def free_page_count(self) -> int:
        return self.allocator.logical.free_pages

    def alloc_pages(self, count: int) -> list[int] | None:
        if count == 0:
            return []
        locs = self.allocator.alloc_extend(
            torch.zeros(1, dtype=torch.int64),
            torch.tensor([count * self.page_size], dtype=torch.int64),
            torch.full((1,), -1, dtype=torch.int64, device=self.allocator.device),
            with_device_rows=False,
        )
        if locs is None:
            return None
        return (locs[:: self.page_size] // self.page_size).tolist()

    def free_pages(self, pages: Sequence[int]) -> None:
        if pages:
            page_ids = torch.tensor(list(pages), dtype=torch.int64, device=self.allocator.device)
            self.allocator.free(self.allocator.logical.page_rows(page_ids))
