"""Paged allocator, KV allocator, host pool and device buffers (CPU)."""

import pytest
import torch

from hisparse_sglang.errors import HiSparseMemoryError, PoolExhaustedError
from hisparse_sglang.memory import (
    BF16_MLA_ITEM_BYTES,
    FP8_DSA_ITEM_BYTES,
    DeviceBufferPool,
    HostKVPool,
    KVAllocator,
    PagedAllocator,
    paged,
)
from hisparse_sglang.memory.paged import DeviceCount


def naive_extend(prefix, seq, last_loc, pages, page_size):
    """Location of every extended token, one request at a time."""
    out, next_page = [], 0
    for b in range(len(prefix)):
        loc = last_loc[b]
        for position in range(prefix[b], seq[b]):
            if position % page_size == 0:
                loc = pages[next_page] * page_size
                next_page += 1
            else:
                loc = loc + 1
            out.append(loc)
    return out


@pytest.mark.parametrize("path", ["small extend", "tensor layout"])
@pytest.mark.parametrize("seed", range(20))
def test_alloc_extend_matches_naive_layout(seed, path, monkeypatch):
    """Both layouts (Python integers up to SMALL_EXTEND_TOKENS, extend_layout's tensors above) place every
    token where the naive one-request-at-a-time layout does."""
    monkeypatch.setattr(paged, "SMALL_EXTEND_TOKENS", 10**9 if path == "small extend" else -1)
    generator = torch.Generator().manual_seed(seed)
    page_size = [1, 4, 16, 64][seed % 4]
    allocator = PagedAllocator("host", 400, page_size, checked=True)
    batch = int(torch.randint(1, 6, (1,), generator=generator))
    prefix, seq, last_loc = [], [], []
    for _ in range(batch):
        p = int(torch.randint(0, 3 * page_size + 2, (1,), generator=generator))
        n = int(torch.randint(0, 4 * page_size + 3, (1,), generator=generator))
        prefix.append(p)
        seq.append(p + n)
        # a prefix ends somewhere inside a page this request owns
        last_loc.append(-1 if p == 0 else 500 * page_size + (p - 1) % page_size)
    free_before = allocator._free[: allocator.free_pages].flip(0).tolist()
    locs = allocator.alloc_extend(torch.tensor(prefix), torch.tensor(seq), torch.tensor(last_loc))
    assert locs.tolist() == naive_extend(prefix, seq, last_loc, free_before, page_size)


@pytest.mark.parametrize("seed", range(12))
def test_alloc_extend_inside_the_last_pages(seed):
    """A speculative step's reserve: every request extends inside its last page (equal or different counts,
    some by none, int32 or int64 last locations); each continues after its last location and no page is taken."""
    generator = torch.Generator().manual_seed(seed)
    page_size = [4, 16, 64][seed % 3]
    allocator = PagedAllocator("host", 400, page_size, checked=True)
    batch = int(torch.randint(1, 7, (1,), generator=generator))
    prefix = [int(torch.randint(1, 20 * page_size, (1,), generator=generator)) for _ in range(batch)]
    room = [-(-p // page_size) * page_size - p for p in prefix]
    if seed % 2:  # the same count for every request
        count = min(room)
        seq = [p + count for p in prefix]
    else:
        seq = [p + int(torch.randint(0, r + 1, (1,), generator=generator)) for p, r in zip(prefix, room)]
    last_loc = [300 * page_size + b * page_size + (p - 1) % page_size for b, p in enumerate(prefix)]
    dtype = torch.int32 if seed % 4 < 2 else torch.int64
    free_before = allocator.free_pages
    locs = allocator.alloc_extend(torch.tensor(prefix), torch.tensor(seq), torch.tensor(last_loc, dtype=dtype))
    assert locs.dtype == torch.int64
    assert locs.tolist() == naive_extend(prefix, seq, last_loc, [], page_size)
    assert allocator.free_pages == free_before


@pytest.mark.parametrize("seed", range(12))
def test_alloc_extend_of_whole_pages_uploads_nothing(seed, monkeypatch):
    """SGLang's speculative reserve with page-rounded lengths: every extending request starts a page at its
    prefix and takes the same count (some take none); the rows are its new pages', in request order, and
    nothing is uploaded."""
    def no_upload(*args, **kwargs):
        raise AssertionError("uploaded a layout")

    monkeypatch.setattr(paged, "upload_ints", no_upload)
    monkeypatch.setattr(paged, "upload", no_upload)
    generator = torch.Generator().manual_seed(seed)
    page_size = [1, 4, 16, 64][seed % 4]
    allocator = PagedAllocator("host", 400, page_size, checked=True)
    allocator.alloc_pages(int(torch.randint(0, 30, (1,), generator=generator)))  # not the lowest pages first
    batch = int(torch.randint(1, 7, (1,), generator=generator))
    count = int(torch.randint(1, 2 * page_size + 1, (1,), generator=generator))
    prefix = [int(torch.randint(1, 20, (1,), generator=generator)) * page_size for _ in range(batch)]
    extends = [b % 3 != 1 or batch == 1 for b in range(batch)]
    seq = [p + count * e for p, e in zip(prefix, extends)]
    last_loc = [300 * page_size + b * page_size + page_size - 1 for b in range(batch)]
    free_before = allocator._free[: allocator.free_pages].flip(0).tolist()
    locs = allocator.alloc_extend(torch.tensor(prefix), torch.tensor(seq), torch.tensor(last_loc))
    assert locs.tolist() == naive_extend(prefix, seq, last_loc, free_before, page_size)
    assert allocator.free_pages == len(free_before) - sum(extends) * -(-count // page_size)


def test_alloc_decode_new_page_only_at_page_start():
    allocator = PagedAllocator("host", 10, 4, checked=True)
    locs = allocator.alloc_decode(torch.tensor([5, 6, 9]), torch.tensor([7, 13, 30]))
    # positions 4 (page start), 5, 8 (page start)
    assert locs.tolist() == [4, 14, 8]
    assert allocator.used_pages == 2


@pytest.mark.parametrize("small", [True, False])
def test_exhaustion_takes_nothing(small, monkeypatch):
    monkeypatch.setattr(paged, "SMALL_EXTEND_TOKENS", 10**9 if small else -1)
    allocator = PagedAllocator("device", 4, 8, checked=True)
    assert allocator.alloc_extend(torch.tensor([0]), torch.tensor([30]), torch.tensor([-1])) is None
    with pytest.raises(HiSparseMemoryError, match="every seq_len must be >= its prefix_len"):
        allocator.alloc_extend(torch.tensor([5]), torch.tensor([3]), torch.tensor([4]))
    assert allocator.free_pages == 3
    assert allocator.alloc_pages(0).numel() == 0 and allocator.free_pages == 3
    with pytest.raises(PoolExhaustedError, match="device pool exhausted: 4 page"):
        allocator.alloc_pages(4)


def test_double_free_and_foreign_pages_are_errors():
    allocator = PagedAllocator("device", 8, 4, checked=True)
    pages = allocator.alloc_pages(2)
    allocator.free_pages_(pages[:1])
    with pytest.raises(HiSparseMemoryError, match="double free of page"):
        allocator.free_pages_(pages[:1])
    with pytest.raises(HiSparseMemoryError, match="outside"):
        allocator.free_pages_(torch.tensor([0]))
    with pytest.raises(HiSparseMemoryError, match="twice in one call"):
        allocator.free_pages_(torch.cat([pages[1:], pages[1:]]))


def test_sorted_frees_keep_allocations_contiguous():
    allocator = PagedAllocator("host", 9, 2, sort_frees=True)
    pages = allocator.alloc_pages(8)
    allocator.free_pages_(pages[torch.tensor([6, 1, 4])])
    assert allocator.alloc_pages(3).tolist() == sorted(pages[torch.tensor([6, 1, 4])].tolist())


def test_page_zero_is_never_handed_out():
    allocator = PagedAllocator("host", 5, 4)
    assert 0 not in allocator.alloc_pages(4).tolist()


def test_kv_allocator_maps_resident_tokens_page_aligned():
    allocator = KVAllocator(host_pages=20, device_pages=6, page_size=4, checked=True)
    locs = allocator.alloc_extend(torch.tensor([0, 0]), torch.tensor([6, 3]), torch.tensor([-1, -1]))
    rows = allocator.translate(locs)
    assert bool((rows > 0).all())
    assert torch.equal(rows % 4, locs % 4)
    assert torch.unique(rows).numel() == rows.numel()
    # continuing the first request's partial page continues its device page too
    more = allocator.alloc_extend(torch.tensor([6]), torch.tensor([9]), locs[5:6])
    assert allocator.translate(more)[:2].tolist() == [int(rows[5]) + 1, int(rows[5]) + 2]
    assert allocator.translate(torch.tensor([-1])).tolist() == [-1]
    allocator.free(torch.cat([locs[:6], more]))
    allocator.free(locs[6:])
    assert allocator.logical.free_pages == allocator.logical.capacity_pages
    assert allocator.device_rows.free_pages == allocator.device_rows.capacity_pages
    assert int((allocator.device_row_of_loc[:-1] != 0).sum()) == 0


def test_kv_allocator_refuses_when_device_is_short():
    allocator = KVAllocator(host_pages=20, device_pages=3, page_size=4, checked=True)
    assert allocator.alloc_extend(torch.tensor([0]), torch.tensor([12]), torch.tensor([-1])) is None
    assert allocator.logical.free_pages == 19 and allocator.device_rows.free_pages == 2
    locs = allocator.alloc_extend(torch.tensor([0]), torch.tensor([12]), torch.tensor([-1]), with_device_rows=False)
    assert bool((allocator.translate(locs) == 0).all())


def test_host_pool_layout_and_item_sizes():
    assert BF16_MLA_ITEM_BYTES == 1152 and FP8_DSA_ITEM_BYTES == 656
    pool = HostKVPool(layer_num=3, num_rows=10, item_bytes=FP8_DSA_ITEM_BYTES, pin=False)
    pointers, lengths = pool.region_infos()
    assert lengths == [10 * 656] * 3 and len(set(pointers)) == 3
    data = torch.arange(2 * 656, dtype=torch.int64).remainder(251).to(torch.uint8).reshape(2, 656)
    pool.write_rows(1, torch.tensor([7, 2]), data)
    assert torch.equal(pool.read_rows(1, torch.tensor([2, 7])), data.flip(0))
    with pytest.raises(HiSparseMemoryError, match="multiple of 16"):
        HostKVPool(1, 4, 100, pin=False)


def test_device_buffers_acquire_release():
    pool = DeviceBufferPool(layer_num=2, num_req_slots=4, num_buffers=2, buffer_size=8, page_size=4, context_len=40)
    rows = torch.arange(100, 112)
    buffer_id = pool.acquire(3, rows, first_token=20)
    assert pool.buffer_of(3) == buffer_id and int(pool.buffer_of_req[3]) == buffer_id
    assert pool.slot_tokens[1, buffer_id].tolist() == list(range(20, 28))
    assert pool.slot_stamps[0, buffer_id].tolist() == [0] * 8
    expected_map = [-1] * 20 + list(range(8)) + [-1] * 13
    assert pool.token_slot[0, buffer_id].tolist() == expected_map
    assert pool.token_slot[1, buffer_id].tolist() == expected_map
    assert int(pool.newest_row(3)) == 108
    with pytest.raises(HiSparseMemoryError, match="context capacity 40"):
        pool.acquire(2, rows, first_token=33)
    with pytest.raises(HiSparseMemoryError, match="already owns"):
        pool.acquire(3, rows, None)
    with pytest.raises(HiSparseMemoryError, match="needs 12 rows"):
        pool.acquire(2, rows[:5], None)
    # a swap-in moved token 20 out and 5 in (slot 0) on layer 1; release clears whatever is mapped
    pool.slot_tokens[1, buffer_id, 0] = 5
    pool.token_slot[1, buffer_id, 20] = -1
    pool.token_slot[1, buffer_id, 5] = 0
    pool.slot_tokens[0, buffer_id, 3] = -1
    pool.token_slot[0, buffer_id, 23] = -1
    assert torch.equal(pool.release(3), rows)
    assert pool.buffer_of(3) == -1 and pool.free_buffers == 2
    assert bool((pool.token_slot == -1).all()) and bool((pool.slot_tokens == -1).all())
    with pytest.raises(HiSparseMemoryError, match="owns no buffer"):
        pool.release(3)
    pool.acquire(0, rows, None)
    pool.acquire(1, rows, None)
    with pytest.raises(PoolExhaustedError):
        pool.acquire(2, rows, None)


def test_device_count_writes_its_tensor_only_when_the_count_changes(monkeypatch):
    """SGLang sets ``coordinator.num_real_reqs`` with ``fill_(n)`` before every forward, the verify step its batch
    size before each launch; kernels read the tensor. It must hold the last count given, and a repeated count
    costs no launch."""

    class RecordingTensor:
        is_cuda = False

        def __init__(self):
            self.fills = []

        def fill_(self, value):
            self.fills.append(value)
            return self

    recording = RecordingTensor()
    count = DeviceCount(recording)
    for n in (2, 2, 5, 5, 5, 0, 2, 2):
        assert count.fill_(n) is recording
    assert recording.fills == [2, 5, 0, 2]

    tensor = torch.full((1,), 7, dtype=torch.int32)
    count = DeviceCount(tensor)
    for n in (7, 3, 3, 1):  # the first fill writes even when the tensor happens to hold the value
        count.fill_(n)
        assert int(tensor.item()) == n

    # A fill made while a CUDA graph is captured is recorded, not run: the next fill of the same count writes.
    recording = RecordingTensor()
    recording.is_cuda = True
    count = DeviceCount(recording)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    count.fill_(4)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    count.fill_(4)
    count.fill_(4)
    assert recording.fills == [4, 4]
