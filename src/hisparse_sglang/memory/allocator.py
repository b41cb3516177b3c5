"""SGLang's logical token locations, mapped to host rows and, while resident, device rows.

* Logical location ``loc`` IS host row ``loc``: the logical allocator is the host-row allocator.
* ``device_row_of_loc[loc]`` is the device KV row holding the token, or 0 when the token is not on
  the GPU (row 0 sits in the reserved padding page and is never handed out). The table has one
  extra trailing entry equal to -1, so translating location -1 (a padded top-k entry) gives -1.

Device rows are paged like logical locations: while a request is resident, each of its logical
pages maps onto one device page with the same in-page offsets, and the whole page is mapped at
once when it is allocated (also its locations the request has not reached yet), so a decode token
that continues a page needs no binding. Pages are freed whole: freeing a location frees its
logical page, unmaps every location of it, and frees the device page it maps to.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hisparse_sglang.errors import HiSparseMemoryError
from hisparse_sglang.memory.paged import PagedAllocator, extend_layout, upload

__all__ = ["KVAllocator", "PoolStats"]


@dataclass(frozen=True)
class PoolStats:
    """Row and request-buffer accounting, for logs, metrics and admission."""

    host_rows_total: int
    host_rows_used: int
    device_rows_total: int
    device_rows_used: int
    buffers_total: int
    buffers_used: int

    @property
    def host_rows_free(self) -> int:
        return self.host_rows_total - self.host_rows_used

    @property
    def device_rows_free(self) -> int:
        return self.device_rows_total - self.device_rows_used

    @property
    def buffers_free(self) -> int:
        return self.buffers_total - self.buffers_used


class KVAllocator:
    """Logical (= host) rows and device rows, allocated in lockstep for resident tokens.

    Args:
        host_pages: pages of the logical/host space (page 0 reserved).
        device_pages: pages of the device KV pool (page 0 reserved).
        page_size: rows per page in both spaces.
        device: where tables and free lists live.
        sort_frees: keep logical free pages sorted (PD disaggregation transfers page runs).
        checked: on a GPU, check every free at once (a host sync; tests, debugging); see PagedAllocator.
    """

    def __init__(
        self,
        host_pages: int,
        device_pages: int,
        page_size: int,
        device: torch.device | str = "cpu",
        sort_frees: bool = False,
        checked: bool = False,
    ) -> None:
        self.page_size = page_size
        self.device = torch.device(device)
        self.logical = PagedAllocator("host", host_pages, page_size, self.device, sort_frees=sort_frees, checked=checked)
        self.device_rows = PagedAllocator("device", device_pages, page_size, self.device, checked=checked)
        num_locs = host_pages * page_size
        self.device_row_of_loc = torch.zeros(num_locs + 1, dtype=torch.int32, device=self.device)
        self.device_row_of_loc[-1:].fill_(-1)

    @property
    def num_locs(self) -> int:
        return self.logical.num_pages * self.page_size

    # ------------------------------------------------------------------ translation
    def translate(self, locs: torch.Tensor) -> torch.Tensor:
        """Device rows of logical locations (same shape; -1 stays -1; 0 = not on the GPU)."""
        return self.device_row_of_loc[locs.to(torch.int64)]

    def map_(self, locs: torch.Tensor, rows: torch.Tensor) -> None:
        self.device_row_of_loc[locs.to(torch.int64)] = rows.to(torch.int32)

    def map_pages_(self, first_locs: torch.Tensor, first_rows: torch.Tensor) -> None:
        """Map whole pages: ``first_locs[i] + j`` to ``first_rows[i] + j`` for ``j < page_size``
        (both page starts, on ``device``)."""
        offsets = self.device_rows.page_offsets()  # int64: the sums are int64 whatever the inputs' type
        self.map_((first_locs.reshape(-1, 1) + offsets).reshape(-1), (first_rows.reshape(-1, 1) + offsets).reshape(-1))

    def map_request_pages_(self, locs: torch.Tensor, pages: torch.Tensor) -> None:
        """Map a request's logical pages onto device ``pages`` whole.

        Args:
            locs: its locations in position order from position 0 (``req_to_token`` row), so that
                every ``page_size``-th one is the start of its next logical page.
            pages: device page ids, one per logical page, in order.
        """
        self.map_pages_(locs[:: self.page_size], pages.to(torch.int64) * self.page_size)

    def unmap_(self, locs: torch.Tensor) -> None:
        # `t[idx] = 0` made demotions wait 16-22 ms behind a running prefill on an H100 (the scalar
        # travels to the GPU as a CPU tensor); index_fill_ passes it as a kernel argument.
        self.device_row_of_loc.index_fill_(0, locs.reshape(-1).to(torch.int64), 0)

    # ------------------------------------------------------------------ allocation
    def alloc_extend(
        self,
        prefix_lens_cpu: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        last_loc: torch.Tensor,
        with_device_rows: bool = True,
    ) -> torch.Tensor | None:
        """Logical locations (and, if ``with_device_rows``, mapped device rows) for an extend.

        Returns int64 locations on ``device`` in request order, or None if either space lacks
        pages (then nothing is taken).
        """
        if with_device_rows:
            _, _, _, needed = _count_extend_pages(prefix_lens_cpu, seq_lens_cpu, self.page_size)
            if needed > self.device_rows.free_pages or needed > self.logical.free_pages:
                return None
        locs = self.logical.alloc_extend(prefix_lens_cpu, seq_lens_cpu, last_loc)
        if locs is None or not with_device_rows:
            return locs
        last_rows = self.translate(last_loc.to(torch.int64))
        rows = self.device_rows.alloc_extend(prefix_lens_cpu, seq_lens_cpu, last_rows)
        if rows is None:  # cannot happen after the check above; keep both spaces consistent anyway
            self.logical.free_locs(locs)
            return None
        # Tokens that continue a page were mapped with it; every new page is mapped whole.
        _, _, new_page_slot, _ = extend_layout(prefix_lens_cpu, seq_lens_cpu, self.page_size)
        starts = torch.nonzero((new_page_slot >= 0) & (new_page_slot % self.page_size == 0)).reshape(-1)
        if starts.numel():
            starts = upload(starts, self.device)
            self.map_pages_(locs[starts], rows[starts])
        return locs

    def alloc_decode(self, seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor) -> torch.Tensor | None:
        """Logical locations only (device rows are decided per request by the coordinator)."""
        return self.logical.alloc_decode(seq_lens_cpu, last_loc)

    def free(self, locs: torch.Tensor) -> None:
        """Free the logical pages of ``locs`` whole: unmap all their locations and free the device
        pages they map to (a resident request's page start maps to its device page's start)."""
        locs = locs.reshape(-1).to(torch.int64)
        if locs.numel() == 0:
            return
        pages = torch.unique(locs // self.page_size)
        # The logical pages first: a double free of these locations raises before anything changes
        # (at once where frees are checked eagerly).
        self.logical.free_pages_(pages)
        starts = pages * self.page_size
        rows = self.translate(starts)
        mapped = rows[rows > 0].to(torch.int64)
        if mapped.numel():
            self.device_rows.free_pages_(mapped // self.page_size)
        self.unmap_(self.logical.page_rows(pages))

    def free_device_pages(self, pages: torch.Tensor) -> None:
        """Free distinct device pages (ids, not rows) without waiting for the GPU: the count is
        known without looking at the values."""
        self.device_rows.free_pages_(pages.reshape(-1).to(torch.int64))

    def stats(self, buffers_total: int = 0, buffers_used: int = 0) -> PoolStats:
        return PoolStats(
            host_rows_total=self.logical.capacity_rows,
            host_rows_used=self.logical.used_pages * self.page_size,
            device_rows_total=self.device_rows.capacity_rows,
            device_rows_used=self.device_rows.used_pages * self.page_size,
            buffers_total=buffers_total,
            buffers_used=buffers_used,
        )

    def clear(self) -> None:
        self.logical.clear()
        self.device_rows.clear()
        self.device_row_of_loc.zero_()
        self.device_row_of_loc[-1:].fill_(-1)


def _count_extend_pages(prefix_lens_cpu: torch.Tensor, seq_lens_cpu: torch.Tensor, page_size: int):
    prefix = prefix_lens_cpu.to(device="cpu", dtype=torch.int64).reshape(-1)
    seq = seq_lens_cpu.to(device="cpu", dtype=torch.int64).reshape(-1)
    if prefix.numel() != seq.numel():
        raise HiSparseMemoryError(f"prefix_lens ({prefix.numel()}) and seq_lens ({seq.numel()}) differ in length.")
    first_page_end = (prefix + page_size - 1) // page_size * page_size
    new_tokens = seq - torch.minimum(seq, first_page_end)
    new_pages = (new_tokens + page_size - 1) // page_size
    return prefix, seq, new_pages, int(new_pages.sum())
