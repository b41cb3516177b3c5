"""Double frees are caught in production: eagerly on the CPU, deferred (device-side) on a GPU.

The deferred check is the GPU's production path; it runs here on CPU tensors with the same ops.
"""

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hisparse_sglang.errors import HiSparseMemoryError
from hisparse_sglang.memory import KVAllocator, PagedAllocator
from hisparse_sglang.memory.ownership import PageOwnership


def test_production_allocator_refuses_a_second_free_and_stays_intact():
    allocator = PagedAllocator("host", 16, 4)  # checked=False: the production setting
    pages = allocator.alloc_pages(3)
    allocator.free_pages_(pages)
    free_list = allocator._free[: allocator.free_pages].clone()
    with pytest.raises(HiSparseMemoryError, match=rf"host pool: double free of page {int(pages.min())} "):
        allocator.free_pages_(pages)
    assert torch.equal(allocator._free[: allocator.free_pages], free_list), "a refused free changed the free list"
    again = allocator.alloc_pages(15)
    assert torch.unique(again).numel() == 15, "a page was handed out twice"


def test_kv_allocator_double_free_of_locations_names_the_host_page():
    allocator = KVAllocator(host_pages=20, device_pages=10, page_size=4)
    locs = allocator.alloc_extend(torch.tensor([0]), torch.tensor([10]), torch.tensor([-1]))
    allocator.free(locs)
    with pytest.raises(HiSparseMemoryError, match=r"host pool: double free of page \d+"):
        allocator.free(locs)
    assert allocator.logical.free_pages == allocator.logical.capacity_pages
    assert allocator.device_rows.free_pages == allocator.device_rows.capacity_pages


@pytest.mark.parametrize("bad,fragment", [
    ([5, 5], "double free of page 5"),           # freed twice in one call (5 was allocated once)
    ([3], "double free of page 3"),              # never allocated
    ([0], "page 0 is outside [1, 16)"),
    ([16], "page 16 is outside [1, 16)"),
    ([-7], "page -7 is outside [1, 16)"),
])
def test_deferred_check_reports_at_the_next_call(bad, fragment):
    ownership = PageOwnership("device", 16, torch.device("cpu"), deferred=True)
    ownership.claim(torch.tensor([5, 6, 7]))
    ownership.release(torch.tensor(bad))  # no error yet: the check ran "on the device"
    with pytest.raises(HiSparseMemoryError) as info:
        ownership.claim(torch.tensor([8]))
    assert fragment in str(info.value) and str(info.value).startswith("device pool: ")
    with pytest.raises(HiSparseMemoryError):
        ownership.verify()  # the allocator stays failed


def test_deferred_check_counts_every_bad_free_and_names_the_lowest():
    ownership = PageOwnership("host", 64, torch.device("cpu"), deferred=True)
    ownership.claim(torch.arange(1, 11))
    ownership.release(torch.arange(1, 11))
    ownership.release(torch.tensor([9, 4, 7]))
    with pytest.raises(HiSparseMemoryError, match=r"double free of page 4 \(it is not allocated\) \(3 bad page frees"):
        ownership.verify()


operations = st.lists(st.tuples(st.sampled_from(["alloc", "free", "double"]), st.integers(0, 6)), max_size=40)


@settings(max_examples=int(os.environ.get("HISPARSE_PROPERTY_EXAMPLES", "10000")) // 20 or 1, deadline=None)
@given(operations=operations, deferred=st.booleans())
def test_random_allocations_catch_exactly_the_bad_frees(operations, deferred):
    """Random allocations and frees, some of them frees of pages already free: a correct sequence
    never raises; the first bad free raises (at once eagerly, at the next call when deferred)."""
    allocator = PagedAllocator("host", 12, 2)
    allocator.ownership = PageOwnership("host", 12, torch.device("cpu"), deferred=deferred)
    held: list[int] = []
    freed: list[int] = []
    bad_done = False
    for kind, amount in operations:
        try:
            if kind == "alloc" and amount <= allocator.free_pages:
                pages = allocator.alloc_pages(amount).tolist()
                assert not set(pages) & set(held), "a held page was handed out again"
                held += pages
                freed = [p for p in freed if p not in pages]
            elif kind == "free" and held:
                count = min(amount, len(held)) or 1
                allocator.free_pages_(torch.tensor(held[:count]))
                freed += held[:count]
                held = held[count:]
            elif kind == "double" and freed:
                bad_done = True
                allocator.free_pages_(torch.tensor(freed[-1:]))
                assert deferred, "an eager check let a double free through"
        except HiSparseMemoryError:
            assert bad_done, "a correct sequence raised"
            return
    if bad_done:
        with pytest.raises(HiSparseMemoryError):
            allocator.ownership.verify()
    else:
        allocator.ownership.verify()
