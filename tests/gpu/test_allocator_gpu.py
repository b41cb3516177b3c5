"""The paged allocator on a GPU: double frees are caught on the device without a host sync (GPU only)."""

import pytest
import torch

from hisparse_sglang.errors import HiSparseMemoryError
from hisparse_sglang.memory import PagedAllocator

pytestmark = pytest.mark.gpu


def no_sync():
    """Raise on any synchronizing CUDA call inside the block (torch's sync debug mode)."""

    class Guard:
        def __enter__(self):
            torch.cuda.set_sync_debug_mode("error")

        def __exit__(self, *exc):
            torch.cuda.set_sync_debug_mode("default")

    return Guard()


def test_correct_allocations_and_frees_never_sync_and_never_raise():
    allocator = PagedAllocator("device", 4096, 64, device="cuda")
    generator = torch.Generator().manual_seed(1)
    held = []
    with no_sync():
        for _ in range(300):
            if held and torch.rand((), generator=generator) < 0.5:
                allocator.free_pages_(held.pop(int(torch.randint(len(held), (), generator=generator))))
            else:
                held.append(allocator.alloc_pages(int(torch.randint(1, 9, (), generator=generator))))
    allocator.ownership.verify()
    everything = torch.cat(held).cpu()
    assert torch.unique(everything).numel() == everything.numel()


def test_a_double_free_is_reported_at_the_next_call_once_the_gpu_got_there():
    allocator = PagedAllocator("device", 256, 64, device="cuda")
    pages = allocator.alloc_pages(4)
    with no_sync():
        allocator.free_pages_(pages[1:3])
        allocator.free_pages_(pages[2:3])  # page pages[2] a second time
    torch.cuda.synchronize()
    bad = int(pages[2])
    with pytest.raises(HiSparseMemoryError, match=rf"device pool: double free of page {bad} \(it is not allocated\)"):
        allocator.alloc_pages(1)
    with pytest.raises(HiSparseMemoryError, match=rf"double free of page {bad}"):
        allocator.ownership.verify()


def test_checked_mode_raises_at_once_with_the_allocator_untouched():
    allocator = PagedAllocator("host", 256, 64, device="cuda", checked=True)
    pages = allocator.alloc_pages(4)
    allocator.free_pages_(pages)
    free_before = allocator.free_pages
    with pytest.raises(HiSparseMemoryError, match="double free of page"):
        allocator.free_pages_(pages[:1])
    assert allocator.free_pages == free_before


@pytest.mark.parametrize("case", ["inside the last pages", "whole pages", "any extend"])
def test_both_extend_layouts_give_the_same_rows_on_the_gpu_without_a_sync(case, monkeypatch):
    """``alloc_extend`` laid out in Python integers (up to SMALL_EXTEND_TOKENS, uploading nothing when no request
    starts a page or all start whole pages alike) and by extend_layout's tensors: the same rows and free pages on CUDA, and neither syncs."""
    from hisparse_sglang.memory import paged

    generator = torch.Generator().manual_seed(7)
    for trial in range(400):
        page = [1, 4, 64][trial % 3]
        batch = int(torch.randint(1, 7, (), generator=generator))
        prefix = [int(torch.randint(0, 300, (), generator=generator)) * (trial % 5 != 0) for _ in range(batch)]
        if case == "inside the last pages":
            prefix = [p + 1 for p in prefix]
            seq = [p + int(torch.randint(0, -(-p // page) * page - p + 1, (), generator=generator)) for p in prefix]
        elif case == "whole pages":  # SGLang's page-rounded speculative reserve: the same count, from page starts
            prefix = [-(-p // page) * page for p in prefix]
            count = int(torch.randint(1, 2 * page + 1, (), generator=generator))
            seq = [p + count * (b % 3 != 1) for b, p in enumerate(prefix)]
        else:
            seq = [p + int(torch.randint(0, 41, (), generator=generator)) for p in prefix]
        last = [-1 if p == 0 else int(torch.randint(1, 50, (), generator=generator)) * page + (p - 1) % page
                for p in prefix]
        dtype = torch.int32 if trial % 2 else torch.int64
        results = []
        for limit in (10**9, -1):
            monkeypatch.setattr(paged, "SMALL_EXTEND_TOKENS", limit)
            allocator = PagedAllocator("logical", 200, page, device="cuda")
            prefix_t, seq_t = torch.tensor(prefix), torch.tensor(seq)
            last_t = torch.tensor(last, dtype=dtype, device="cuda")
            with no_sync():
                rows = allocator.alloc_extend(prefix_t, seq_t, last_t)
            results.append((None if rows is None else rows.tolist(), allocator.free_pages))
        assert results[0] == results[1], (case, trial, prefix, seq, last, page)
