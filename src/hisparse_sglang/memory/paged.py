"""A paged row allocator whose free list lives on the compute device.

Allocation results are device tensors and every count is known on the CPU, so allocating and
freeing never wait for the GPU (except :meth:`PagedAllocator.free_locs`, which must deduplicate
pages of arbitrary token locations, like SGLang's own paged allocator).

The API follows SGLang's paged-allocator semantics so that the SGLang adapter can delegate to it:
``alloc_extend`` continues each request's last partial page and then takes whole pages;
``alloc_decode`` hands one row per request, a new page only when the new token starts one.
"""

from __future__ import annotations

import torch

from hisparse_sglang.errors import HiSparseMemoryError, PoolExhaustedError
from hisparse_sglang.memory.ownership import PageOwnership

__all__ = ["DeviceCount", "PagedAllocator", "SMALL_EXTEND_TOKENS", "extend_layout", "upload", "upload_ints"]

# An extend of at most this many tokens is laid out in Python integers (PagedAllocator._alloc_small_extend):
# cheaper on the host than extend_layout's ~20 CPU tensor operations and ~10 device launches, which pay off
# only for long extends (a prefill chunk).
SMALL_EXTEND_TOKENS = 256


def upload(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a small CPU tensor to ``device`` without stalling the host.

    A copy from pageable memory makes CUDA synchronize the stream first, which would make the
    scheduler wait for the forward pass in flight; staging through pinned memory keeps it async.
    """
    if device.type != "cuda":
        return values.to(device)
    return values.pin_memory().to(device, non_blocking=True)


def upload_ints(rows: list[list[int]], device: torch.device) -> torch.Tensor:
    """Python integer lists (equal lengths) as an int64 ``[len(rows), n]`` tensor on ``device``,
    built in pinned memory and copied without stalling the host (two dispatches)."""
    if device.type != "cuda":
        return torch.tensor(rows, dtype=torch.int64, device=device)
    return torch.tensor(rows, dtype=torch.int64, pin_memory=True).to(device, non_blocking=True)


class DeviceCount:
    """A one-element device tensor that kernels read and the host sets with ``fill_(n)``, written only when
    ``n`` changes: a fill is a launch (about as long on the host as a small kernel's), and the owners set
    their counts every scheduler step. The object must be the tensor's only writer. A fill recorded into a
    CUDA graph under capture has not run, so the value is unknown after it and the next fill writes.

    Attributes:
        tensor: the tensor (what the kernels are passed).
    """

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self._value: int | None = None

    def fill_(self, value: int) -> torch.Tensor:
        value = int(value)
        if value != self._value:
            self.tensor.fill_(value)
            capturing = self.tensor.is_cuda and torch.cuda.is_current_stream_capturing()
            self._value = None if capturing else value
        return self.tensor


def extend_layout(
    prefix_lens: torch.Tensor, seq_lens: torch.Tensor, page_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Where each token of a batched extend lands, computed on the CPU.

    For request ``b`` the tokens at positions ``[prefix_lens[b], seq_lens[b])`` are laid out in
    request order. Tokens that fill the request's last partial page continue after its last
    location; the rest take new pages in order.

    Returns:
        request: int64 ``[T]``, the batch index of each token.
        continue_offset: int64 ``[T]``, ``j + 1`` for the ``j``-th token continuing the last page
            (its location is ``last_loc[b] + j + 1``), 0 for tokens on new pages.
        new_page_slot: int64 ``[T]``, ``ordinal * page_size + offset`` for tokens on new pages (the
            ordinal counts new pages across the batch), -1 for continuing tokens.
        num_new_pages: total new pages.
    """
    prefix_lens = prefix_lens.to(device="cpu", dtype=torch.int64).reshape(-1)
    seq_lens = seq_lens.to(device="cpu", dtype=torch.int64).reshape(-1)
    if prefix_lens.numel() != seq_lens.numel():
        raise HiSparseMemoryError(
            f"prefix_lens has {prefix_lens.numel()} entries but seq_lens has {seq_lens.numel()}."
        )
    if bool((seq_lens < prefix_lens).any()):
        raise HiSparseMemoryError("every seq_len must be >= its prefix_len.")
    first_page_end = (prefix_lens + page_size - 1) // page_size * page_size
    num_continue = torch.minimum(seq_lens, first_page_end) - prefix_lens
    num_new = seq_lens - prefix_lens - num_continue
    new_pages = (num_new + page_size - 1) // page_size
    new_page_base = torch.cumsum(new_pages, 0) - new_pages
    counts = seq_lens - prefix_lens
    total = int(counts.sum())
    batch = torch.arange(prefix_lens.numel(), dtype=torch.int64)
    request = torch.repeat_interleave(batch, counts)
    token_start = torch.cumsum(counts, 0) - counts
    index_in_request = torch.arange(total, dtype=torch.int64) - token_start[request]
    is_continue = index_in_request < num_continue[request]
    continue_offset = torch.where(is_continue, index_in_request + 1, torch.zeros_like(index_in_request))
    new_index = index_in_request - num_continue[request]
    new_page_slot = torch.where(
        is_continue,
        torch.full_like(index_in_request, -1),
        new_page_base[request] * page_size + new_index,
    )
    return request, continue_offset, new_page_slot, int(new_pages.sum())


class PagedAllocator:
    """Pages of ``page_size`` rows over rows ``[0, num_pages * page_size)``.

    Page 0 is never handed out: SGLang writes the KV of padded tokens to location 0.

    Args:
        name: shown in error messages ("host", "device").
        num_pages: total pages, the reserved page 0 included.
        page_size: rows per page.
        device: where the free list and the returned tensors live.
        sort_frees: keep the free list sorted so that allocations stay contiguous (SGLang's
            ``need_sort``, used by PD disaggregation to merge transfers into page runs).
        checked: on a GPU, check every free before it changes anything (a host sync per call; for
            tests and debugging). Otherwise a GPU checks frees on the device and reports a bad one at
            the next allocation or free, without waiting (memory/ownership.py); the CPU always
            checks at once.
    """

    def __init__(
        self,
        name: str,
        num_pages: int,
        page_size: int,
        device: torch.device | str = "cpu",
        sort_frees: bool = False,
        checked: bool = False,
    ) -> None:
        if num_pages < 2:
            raise HiSparseMemoryError(
                f"{name} pool needs at least 2 pages of {page_size} rows (page 0 is reserved), got {num_pages}; "
                f"give it more memory."
            )
        self.name = name
        self.num_pages = num_pages
        self.page_size = page_size
        self.device = torch.device(device)
        self.sort_frees = sort_frees
        self.checked = checked
        # A stack: the next page handed out is the last free entry.
        self._free = torch.empty(num_pages, dtype=torch.int64, device=self.device)
        self.ownership = PageOwnership(name, num_pages, self.device, deferred=self.device.type == "cuda" and not checked)
        self._num_free = 0
        self._steps_cache: dict[int, torch.Tensor] = {}
        self._offsets: torch.Tensor | None = None
        self.clear()

    # ------------------------------------------------------------------ capacity
    @property
    def capacity_pages(self) -> int:
        return self.num_pages - 1

    @property
    def capacity_rows(self) -> int:
        return self.capacity_pages * self.page_size

    @property
    def free_pages(self) -> int:
        return self._num_free

    @property
    def free_rows(self) -> int:
        return self._num_free * self.page_size

    @property
    def used_pages(self) -> int:
        return self.capacity_pages - self._num_free

    def clear(self) -> None:
        """Free every page; the lowest page ids are handed out first."""
        self.ownership.clear()
        self._num_free = self.num_pages - 1
        self._free[: self._num_free] = torch.arange(
            self.num_pages - 1, 0, -1, dtype=torch.int64, device=self.device
        )

    # ------------------------------------------------------------------ pages
    def alloc_pages(self, count: int) -> torch.Tensor:
        """Take ``count`` pages; returns their ids (int64 on ``device``).

        Raises:
            PoolExhaustedError: fewer than ``count`` pages are free; nothing is taken.
        """
        if count < 0:
            raise HiSparseMemoryError(f"{self.name} pool: cannot allocate {count} pages.")
        if count > self._num_free:
            raise PoolExhaustedError(
                f"{self.name} pool exhausted: {count} page(s) of {self.page_size} rows requested, "
                f"{self._num_free} free of {self.capacity_pages}."
            )
        if count == 0:
            return self._free[:0]
        start = self._num_free - count
        pages = self._free[start : self._num_free].flip(0)
        self.ownership.claim(pages)
        self._num_free = start
        return pages

    def free_pages_(self, pages: torch.Tensor) -> None:
        """Return pages (distinct ids) to the free list.

        Raises:
            HiSparseMemoryError: a page is reserved, out of range, repeated or free (double free):
                at once on the CPU or with ``checked``, else at the next call on a GPU.
        """
        pages = pages.reshape(-1).to(device=self.device, dtype=torch.int64)
        count = pages.numel()
        if count == 0:
            return
        self.ownership.release(pages)
        if count > self.num_pages - 1 - self._num_free:
            raise HiSparseMemoryError(
                f"{self.name} pool: freeing {count} pages but only {self.used_pages} are allocated (double free)."
            )
        self._free[self._num_free : self._num_free + count] = pages.flip(0)
        self._num_free += count
        if self.sort_frees:
            self._free[: self._num_free] = torch.sort(self._free[: self._num_free], descending=True).values

    def free_list(self) -> torch.Tensor:
        """The free page ids in stack order, the next one handed out last (a view; do not modify)."""
        return self._free[: self._num_free]

    def page_rows(self, pages: torch.Tensor) -> torch.Tensor:
        """Rows of the given pages (on this allocator's device), page after page (int64): one broadcast add."""
        return torch.add(self.page_offsets(), pages.reshape(-1, 1), alpha=self.page_size).reshape(-1)

    def free_locs(self, locs: torch.Tensor) -> None:
        """Free every page that contains one of ``locs`` (SGLang's ``free`` semantics)."""
        locs = locs.reshape(-1)
        if locs.numel() == 0:
            return
        self.free_pages_(torch.unique(locs.to(torch.int64) // self.page_size))

    # ------------------------------------------------------------------ SGLang-style batched allocation
    def alloc_extend(
        self,
        prefix_lens_cpu: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        last_loc: torch.Tensor,
    ) -> torch.Tensor | None:
        """Rows for positions ``[prefix_lens[b], seq_lens[b])`` of every request ``b``.

        Args:
            prefix_lens_cpu: int64 ``[B]`` on the CPU.
            seq_lens_cpu: int64 ``[B]`` on the CPU.
            last_loc: int64 ``[B]`` on ``device``: the row of position ``prefix_lens[b] - 1``,
                or -1 when the prefix is empty (then the request starts on a new page).

        Returns:
            int64 ``[sum(seq_lens - prefix_lens)]`` rows on ``device`` in request order, or None
            if there are not enough free pages (nothing is taken).
        """
        prefix_lens, seq_lens = prefix_lens_cpu.reshape(-1).tolist(), seq_lens_cpu.reshape(-1).tolist()
        if prefix_lens and sum(seq_lens) - sum(prefix_lens) <= SMALL_EXTEND_TOKENS:
            return self._alloc_small_extend(prefix_lens, seq_lens, last_loc)
        request, continue_offset, new_page_slot, num_new_pages = extend_layout(
            prefix_lens_cpu, seq_lens_cpu, self.page_size
        )
        if num_new_pages > self._num_free:
            return None
        pages = self.alloc_pages(num_new_pages)
        if request.numel() == 0:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        plan = upload(torch.stack([request, continue_offset, new_page_slot]), self.device)
        request_d, continue_d, slot_d = plan[0], plan[1], plan[2]
        continued = last_loc.to(torch.int64)[request_d] + continue_d
        if num_new_pages == 0:
            return continued
        page_ordinal = torch.clamp(slot_d, min=0) // self.page_size
        on_new_page = pages[page_ordinal] * self.page_size + torch.clamp(slot_d, min=0) % self.page_size
        return torch.where(continue_d > 0, continued, on_new_page)

    def _alloc_small_extend(self, prefix_lens: list[int], seq_lens: list[int], last_loc: torch.Tensor):
        """:meth:`alloc_extend` of a few tokens (a speculative step's reserve, a short prompt), laid out in
        Python integers; the same rows as :func:`extend_layout`'s tensor path (tests/test_memory.py compares
        both with a naive layout). Two shapes upload nothing: no request starts a page (the rows are
        ``last_loc + 1 ..`` per request: one broadcast add, and one concatenation when the requests extend
        by different counts), and every extending request starts a page at its prefix with the same count
        (SGLang's speculative reserve, whose lengths are rounded up to whole pages: the rows of its new
        pages, one broadcast add)."""
        page = self.page_size
        if len(prefix_lens) != len(seq_lens):
            raise HiSparseMemoryError(
                f"prefix_lens has {len(prefix_lens)} entries but seq_lens has {len(seq_lens)}."
            )
        counts, new_counts, new_pages = [], [], []
        for prefix, seq in zip(prefix_lens, seq_lens):
            if seq < prefix:
                raise HiSparseMemoryError("every seq_len must be >= its prefix_len.")
            counts.append(seq - prefix)
            new_counts.append(seq - min(seq, -(-prefix // page) * page))
            new_pages.append(-(-new_counts[-1] // page))
        num_new_pages = sum(new_pages)
        if num_new_pages > self._num_free:
            return None
        width = max(counts)
        if width == 0:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        if num_new_pages == 0:
            grid = last_loc.reshape(-1, 1).to(torch.int64) + self._steps(width)
            if min(counts) == width:
                return grid.reshape(-1)
            return torch.cat([grid[b, :count] for b, count in enumerate(counts) if count])
        pages = self.alloc_pages(num_new_pages)
        extending = [count for count in counts if count]
        if new_counts == counts and min(extending) == width:
            # Every extending request starts a page at its prefix and takes the same count (SGLang's
            # speculative reserve: its lengths are rounded up to whole pages), so its rows are the leading
            # rows of its own new pages, taken in request order: nothing uploaded.
            return self.page_rows(pages).view(len(extending), -1)[:, :width].reshape(-1)
        request: list[int] = []
        # > 0: continues the request's last page at last_loc + offset; < 0: new-page slot -offset - 1.
        offset: list[int] = []
        base = 0
        for b, (count, num_new, pages_taken) in enumerate(zip(counts, new_counts, new_pages)):
            request += [b] * count
            offset += range(1, count - num_new + 1)
            offset += range(-base - 1, -base - num_new - 1, -1)
            base += pages_taken * page
        plan = upload_ints([request, offset], self.device)
        continued = last_loc.to(torch.int64)[plan[0]] + plan[1]
        slot = torch.clamp(-plan[1] - 1, min=0)
        return torch.where(plan[1] > 0, continued, pages[slot // page] * page + slot % page)

    def page_offsets(self) -> torch.Tensor:
        """``[0, 1, .., page_size - 1]`` (int64 on the device), made once."""
        if self._offsets is None:
            self._offsets = torch.arange(self.page_size, dtype=torch.int64, device=self.device)
        return self._offsets

    def _steps(self, width: int) -> torch.Tensor:
        """``[1, 2, .., width]`` (int64 on the device), cached per width."""
        steps = self._steps_cache.get(width)
        if steps is None:
            steps = self._steps_cache[width] = torch.arange(1, width + 1, dtype=torch.int64, device=self.device)
        return steps

    def alloc_decode(self, seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor) -> torch.Tensor | None:
        """One row per request for the token at position ``seq_lens[b] - 1``.

        Runs on every decode step before the step is launched: with no new page (the common case)
        it is one launch; the page decisions are made on the CPU.

        Args:
            seq_lens_cpu: int ``[B]`` on the CPU, lengths including the new token.
            last_loc: int32/int64 ``[B]`` on ``device``, the row of position ``seq_lens[b] - 2``.

        Returns:
            int64 ``[B]`` rows on ``device``, or None if there are not enough free pages.
        """
        lens = seq_lens_cpu.reshape(-1).tolist() if isinstance(seq_lens_cpu, torch.Tensor) else list(seq_lens_cpu)
        page = self.page_size
        starts = [row for row, length in enumerate(lens) if (length - 1) % page == 0]
        if len(starts) > self._num_free:
            return None
        rows = torch.add(last_loc.reshape(-1), 1, out=torch.empty(len(lens), dtype=torch.int64, device=self.device))
        if starts:
            pages = self.alloc_pages(len(starts))
            rows.index_copy_(0, upload(torch.tensor(starts, dtype=torch.int64), self.device), pages * page)
        return rows
