"""The CUDA backup-row and bind-row kernels against their reference twins, bit for bit (GPU only)."""

import pytest
import torch

from hisparse_sglang.ops import reference

pytestmark = pytest.mark.gpu

PAGE = 64
BUFFER = 256


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


def entries(count: int, seed: int, shape: tuple[int, int], first_position: int):
    """Random (slot, position) pairs and the generator that drew them."""
    g = torch.Generator().manual_seed(seed)
    slots = torch.randint(0, shape[0], (count,), generator=g)
    return slots, torch.randint(first_position, shape[1], (count,), generator=g), g


@pytest.mark.parametrize("count", [1, 7, 129, 1000])
def test_backup_rows_matches_reference(count):
    from hisparse_sglang.ops import swap_in as ops

    req_to_token, device_row_of_loc, buffer_of_req, slot_rows = tables(count)
    slots, positions, _ = entries(count, 100 + count, req_to_token.shape, first_position=0)
    offloaded = (buffer_of_req[slots] >= 0).to(torch.int64)
    plan = torch.stack([slots, positions, offloaded])
    expected = reference.backup_rows(plan, req_to_token, device_row_of_loc, buffer_of_req, slot_rows, BUFFER)
    actual = ops.backup_rows(plan.cuda(), *to_cuda(req_to_token, device_row_of_loc, buffer_of_req, slot_rows), BUFFER)
    assert actual.dtype == torch.int64 and torch.equal(actual.cpu(), expected)


@pytest.mark.parametrize("count", [1, 7, 129, 1000])
def test_bind_rows_matches_reference(count):
    from hisparse_sglang.ops import swap_in as ops

    req_to_token, device_row_of_loc, buffer_of_req, slot_rows = tables(count)
    slots, positions, g = entries(count, 200 + count, req_to_token.shape, first_position=1)
    # distinct new locations that are nobody's previous location: beyond req_to_token's values
    num_locs = device_row_of_loc.numel() - 1
    extra = torch.randperm(count * 4, generator=g)[:count] + num_locs
    device_row_of_loc = torch.cat(
        [device_row_of_loc[:-1], torch.zeros(count * 4, dtype=torch.int32), torch.tensor([-1], dtype=torch.int32)]
    )
    new_locs = extra.to(torch.int64)
    num_pages = max(1, count // 3)
    new_pages = torch.randperm(1 << 20, generator=g)[:num_pages].to(torch.int64)
    choice = torch.randint(0, 3, (count,), generator=g)
    kinds = torch.where(buffer_of_req[slots] >= 0, reference.BIND_BUFFER_SLOT, reference.BIND_CONTINUE).to(torch.int64)
    starts = (choice == 0) & (buffer_of_req[slots] < 0)
    kinds[starts] = torch.randint(0, num_pages, (int(starts.sum()),), generator=g)
    plan = torch.stack([slots, positions, kinds])
    expected = device_row_of_loc.clone()
    reference.bind_rows(plan, new_locs, new_pages, req_to_token, expected, buffer_of_req, slot_rows, BUFFER, PAGE)
    actual = device_row_of_loc.cuda()
    ops.bind_rows(plan.cuda(), new_locs.cuda(), new_pages.cuda(), *to_cuda(req_to_token), actual,
                  *to_cuda(buffer_of_req, slot_rows), BUFFER, PAGE)
    assert torch.equal(actual.cpu(), expected)
    assert int((expected != device_row_of_loc).sum()) > 0


def test_bind_rows_without_new_pages_and_empty_plans():
    from hisparse_sglang.ops import swap_in as ops

    req_to_token, device_row_of_loc, buffer_of_req, slot_rows = [t.cuda() for t in tables(3)]
    before = device_row_of_loc.clone()
    empty = torch.zeros((3, 0), dtype=torch.int64, device="cuda")
    no_pages = torch.zeros(0, dtype=torch.int64, device="cuda")
    ops.bind_rows(empty, no_pages, no_pages, req_to_token, device_row_of_loc, buffer_of_req, slot_rows, BUFFER, PAGE)
    rows = ops.backup_rows(empty, req_to_token, device_row_of_loc, buffer_of_req, slot_rows, BUFFER)
    torch.cuda.synchronize()
    assert rows.shape == (2, 0) and torch.equal(device_row_of_loc, before)
    with pytest.raises(Exception, match="plan must be a contiguous int64"):
        ops.bind_rows(empty.to(torch.int32), no_pages, no_pages, req_to_token, device_row_of_loc, buffer_of_req,
                      slot_rows, BUFFER, PAGE)
