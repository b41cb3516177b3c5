"""The CUDA decode-step kernels (backup_newest, bind_rows) against their reference twins, bit for bit (GPU only)."""

import pytest
import torch

from hisparse_sglang.ops import reference

pytestmark = pytest.mark.gpu

PAGE = 64
BUFFER = 256
POISON = 0xA5


def tables(seed: int, slots: int = 40, context: int = 2048, buffers: int = 24):
    """Unique logical locations per (slot, position), device rows for all, buffers for some slots."""
    g = torch.Generator().manual_seed(seed)
    num_locs = slots * context + 1
    req_to_token = (torch.randperm(num_locs - 1, generator=g)[: slots * context] + 1).to(torch.int32).reshape(slots, context)
    device_row_of_loc = torch.randint(1, 1 << 30, (num_locs + 1,), generator=g, dtype=torch.int32)
    device_row_of_loc[-1] = -1
    buffer_of_req = torch.full((slots,), -1, dtype=torch.int32)
    offloaded = torch.randperm(slots, generator=g)[:buffers]
    buffer_of_req[offloaded] = torch.randperm(buffers, generator=g).to(torch.int32)
    slot_rows = torch.randint(1, 1 << 30, (buffers, BUFFER + PAGE), generator=g, dtype=torch.int32)
    return req_to_token, device_row_of_loc, buffer_of_req, slot_rows


def to_cuda(*tensors):
    return [t.cuda() for t in tensors]


def newest_case(batch: int, seed: int, row_bytes: int, index_dtype: torch.dtype):
    """A batch of distinct request slots, each with a newest token; unique bytes per device row."""
    g = torch.Generator().manual_seed(seed)
    slots, context, device_rows = batch + 3, 300, 4 * batch + 64
    num_locs = slots * context + 1
    req_to_token = (torch.randperm(num_locs - 1, generator=g)[: slots * context] + 1).to(torch.int32).reshape(slots, context)
    device_row_of_loc = torch.zeros(num_locs + 1, dtype=torch.int32)
    device_row_of_loc[-1] = -1
    req_pool_indices = torch.randperm(slots, generator=g)[:batch].to(index_dtype)
    seq_lens = torch.randint(1, context + 1, (batch,), generator=g).to(index_dtype)
    newest = req_to_token[req_pool_indices.long(), seq_lens.long() - 1].long()
    rows = torch.randperm(device_rows - 1, generator=g)[:batch].to(torch.int32) + 1
    device_row_of_loc[newest] = rows
    device_row_of_loc[newest[1::5]] = 0  # some newest tokens have no device row: skipped
    device_kv = torch.arange(device_rows * row_bytes, dtype=torch.int64).remainder(251).to(torch.uint8)
    device_kv = device_kv.reshape(device_rows, row_bytes)
    return req_pool_indices, seq_lens, req_to_token, device_row_of_loc, device_kv, num_locs


@pytest.mark.parametrize("batch", [1, 5, 64, 300])
@pytest.mark.parametrize("row_bytes", [1152, 656])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("fence_system", [False, True], ids=["private", "shared-writer"])
def test_backup_newest_matches_reference(batch, row_bytes, index_dtype, fence_system):
    """fence_system (the writer of a shared host pool) adds a fence, never a different row."""
    from hisparse_sglang.ops.swap_in import CudaOps

    ops = CudaOps()

    req_pool_indices, seq_lens, req_to_token, device_row_of_loc, device_kv, num_locs = newest_case(
        batch, 31 + batch, row_bytes, index_dtype
    )
    real = max(1, batch - 2)  # the last rows are CUDA-graph padding
    num_real = torch.tensor([real], dtype=torch.int32)
    expected = torch.full((num_locs, row_bytes), POISON, dtype=torch.uint8)
    reference.backup_newest(req_pool_indices, seq_lens, num_real, req_to_token, device_row_of_loc, device_kv, expected)
    actual = torch.full((num_locs, row_bytes), POISON, dtype=torch.uint8).pin_memory()
    ops.backup_newest(*to_cuda(req_pool_indices, seq_lens, num_real, req_to_token, device_row_of_loc, device_kv), actual,
                      fence_system=fence_system)
    torch.cuda.synchronize()
    differ = (actual != expected).any(dim=1).nonzero().flatten()
    assert differ.numel() == 0, f"host rows differ from the reference, first at row {differ[:1].tolist()}"
    assert int((expected != POISON).any(dim=1).sum()) > 0


def test_backup_newest_replays_in_a_cuda_graph():
    from hisparse_sglang.ops.swap_in import CudaOps

    ops = CudaOps()

    req_pool_indices, seq_lens, req_to_token, device_row_of_loc, device_kv, num_locs = newest_case(8, 5, 1152, torch.int64)
    inputs = to_cuda(req_pool_indices, seq_lens, torch.tensor([8], dtype=torch.int32), req_to_token, device_row_of_loc,
                     device_kv)
    host = torch.full((num_locs, 1152), POISON, dtype=torch.uint8).pin_memory()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        ops.backup_newest(*inputs, host)  # warm-up outside capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            ops.backup_newest(*inputs, host)
    torch.cuda.synchronize()
    host.fill_(POISON)
    inputs[1].sub_(1)  # the next replay backs up the tokens one position earlier
    inputs[4][req_to_token[req_pool_indices, seq_lens - 2].long().cuda()] = 7
    graph.replay()
    torch.cuda.synchronize()
    expected = torch.full_like(host, POISON)
    reference.backup_newest(*[t.cpu() for t in inputs], expected)
    assert torch.equal(host, expected)


@pytest.mark.parametrize("count", [1, 7, 129, 1000])
def test_bind_rows_matches_reference(count):
    from hisparse_sglang.ops.swap_in import CudaOps

    ops = CudaOps()

    _, device_row_of_loc, buffer_of_req, slot_rows = tables(count)
    g = torch.Generator().manual_seed(200 + count)
    slots = torch.randint(0, buffer_of_req.numel(), (count,), generator=g)
    # distinct new page starts beyond every mapped location, on a zeroed tail of the table
    num_locs = device_row_of_loc.numel() - 1
    first_free_page = -(-num_locs // PAGE)
    new_locs = (first_free_page + torch.randperm(count * 4, generator=g)[:count]) * PAGE
    device_row_of_loc = torch.cat(
        [device_row_of_loc[:-1], torch.zeros((first_free_page + count * 4) * PAGE - num_locs, dtype=torch.int32),
         torch.tensor([-1], dtype=torch.int32)]
    )
    num_pages = max(1, count // 3)
    new_pages = torch.randperm(1 << 20, generator=g)[:num_pages].to(torch.int64)
    buffer_rows = buffer_of_req[slots] >= 0
    kinds = torch.full((count,), reference.BIND_BUFFER_SLOT, dtype=torch.int64)
    kinds[~buffer_rows] = torch.randint(0, num_pages, (int((~buffer_rows).sum()),), generator=g)
    batch_rows = torch.randperm(count, generator=g)
    plan = torch.stack([batch_rows, slots, kinds])
    new_locs_by_row = torch.empty(count, dtype=torch.int64)
    new_locs_by_row[batch_rows] = new_locs.to(torch.int64)
    expected = device_row_of_loc.clone()
    reference.bind_rows(plan, new_locs_by_row, new_pages, expected, buffer_of_req, slot_rows, BUFFER, PAGE)
    actual = device_row_of_loc.cuda()
    ops.bind_rows(plan.cuda(), new_locs_by_row.cuda(), new_pages.cuda(), actual, *to_cuda(buffer_of_req, slot_rows),
                  BUFFER, PAGE)
    assert torch.equal(actual.cpu(), expected)
    assert int((expected != device_row_of_loc).sum()) > 0


def test_bind_rows_empty_plan_and_bad_arguments():
    from hisparse_sglang.ops.swap_in import CudaOps

    ops = CudaOps()

    _, device_row_of_loc, buffer_of_req, slot_rows = [t.cuda() for t in tables(3)]
    before = device_row_of_loc.clone()
    empty = torch.zeros((3, 0), dtype=torch.int64, device="cuda")
    no_pages = torch.zeros(0, dtype=torch.int64, device="cuda")
    ops.bind_rows(empty, no_pages, no_pages, device_row_of_loc, buffer_of_req, slot_rows, BUFFER, PAGE)
    torch.cuda.synchronize()
    assert torch.equal(device_row_of_loc, before)
    with pytest.raises(Exception, match="plan must be a contiguous int64"):
        ops.bind_rows(empty.to(torch.int32), no_pages, no_pages, device_row_of_loc, buffer_of_req, slot_rows, BUFFER,
                      PAGE)
    with pytest.raises(Exception, match="backup_newest: device_kv must be a KV tensor on CUDA"):
        kv = torch.zeros((4, 1152), dtype=torch.uint8)
        ops.backup_newest(no_pages, no_pages, torch.zeros(1, dtype=torch.int32, device="cuda"),
                          torch.zeros((1, 4), dtype=torch.int32, device="cuda"), device_row_of_loc, kv, kv)
