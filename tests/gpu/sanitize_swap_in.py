"""One representative swap-in, copy and decode-row bookkeeping, and one speculative verify step
(swap_in_positions, bind_verify_slots, commit_accepted), for compute-sanitizer (memcheck, racecheck);
exits 1 on a mismatch.

    compute-sanitizer --tool memcheck python tests/gpu/sanitize_swap_in.py

Besides the production build it runs three test variants of the kernel (jit.load_module(defines=...)):
copiers that claim their chunk and look up late (the planner waits for them), copiers that claim late,
after the planner closed the claims (the planner copies their chunks itself), and a planner that
announces itself late (its copiers give their chunks back; it copies every miss). Build them before running
this under the sanitizer (benchmarks/gpu_progress_check.sh does): compiling inside it is slow.
"""

import sys

import torch

from hisparse_sglang.ops import reference
from hisparse_sglang.ops.jit import load_module
from hisparse_sglang.ops.swap_in import CudaOps
from hisparse_sglang.testing.cases import make_case, make_positions_case

VARIANTS = {
    "production": (),
    "late copiers": ("HISPARSE_TEST_LATE_COPIERS_NS=30000",),
    "late arrivals": ("HISPARSE_TEST_LATE_ARRIVALS_NS=30000",),
    "late planner": ("HISPARSE_TEST_LATE_PLANNER_NS=30000",),
}
RUNS = (("production", 1), ("production", 4), ("production", 17), ("late copiers", 4), ("late arrivals", 5),
        ("late arrivals", 17), ("late planner", 5))
# swap_in_positions: T = 2 verify positions of top_k 2048 (4096 entries per request in one launch, the largest
# plan), T = 4 with device_buffer_size 8192 (one launch per position, each finding the previous one's rows), and
# T = 4 with 4096 (two launches of two positions; with these misses the second leaves positions out).
POSITION_RUNS = (("production", 1), ("production", 5), ("late copiers", 4), ("late arrivals", 5),
                 ("late planner", 5))
POSITION_SHAPES = ((2, 4096, 0.3, 0.7), (4, 8192, 0.3, 0.7), (4, 4096, 0.6, 0.3))  # (T, D, miss rate, overlap)


def main() -> int:
    ops = {name: CudaOps(module=load_module(defines) if defines else None) for name, defines in VARIANTS.items()}
    case = make_case(
        3, 2048, 4096, 1152, miss_rate=0.3, duplicate_fraction=0.02, padding_fraction=0.01,
        out_of_range_fraction=0.01, resident_fraction=0.34, num_real=3, seed=42,
    )
    expected = case.clone()
    expected_counters = torch.zeros(2, dtype=torch.int64)
    expected_out = reference.swap_in(*expected.args(), counters=expected_counters)
    for name, splits in RUNS:
        actual = case.clone(device="cuda", pin_host=True)
        counters = torch.zeros(2, dtype=torch.int64, device="cuda")
        out = ops[name].swap_in(*actual.args(), counters=counters, splits=splits)
        host = [actual.host_kv]
        device = [actual.device_kv]
        rows = torch.arange(64, 96, device="cuda")
        ops[name].copy_rows(device, host, rows, rows + 1000)
        torch.cuda.synchronize()
        for what, want, got in (
            ("out", expected_out, out),
            ("slot_tokens", expected.slot_tokens, actual.slot_tokens),
            ("slot_stamps", expected.slot_stamps, actual.slot_stamps),
            ("token_slot", expected.token_slot, actual.token_slot),
            ("device_kv", expected.device_kv, actual.device_kv),
            ("counters", expected_counters, counters),
            ("launch workspace", torch.zeros_like(ops[name]._sync.cpu()), ops[name]._sync),
        ):
            if not torch.equal(want, got.cpu()):
                print(f"MISMATCH {name} build, splits={splits}: {what}")
                return 1
    if not decode_rows_match(case, ops["production"]):
        return 1
    if not positions_match(ops):
        return 1
    if not verify_rows_match(case, ops["production"]):
        return 1
    print("sanitize case: outputs match the reference")
    return 0


def decode_rows_match(case, ops: CudaOps) -> bool:
    """backup_newest and bind_rows on the case's tables: every request, both kinds of binding."""
    slots = case.req_pool_indices.to(torch.int64)
    num_real = torch.tensor([slots.numel()], dtype=torch.int32)
    want_host = case.host_kv.clone()
    reference.backup_newest(slots, case.seq_lens, num_real, case.req_to_token, case.device_row_of_loc, case.device_kv,
                            want_host)
    got_host = case.host_kv.clone().pin_memory()
    ops.backup_newest(slots.cuda(), case.seq_lens.cuda(), num_real.cuda(), case.req_to_token.cuda(),
                      case.device_row_of_loc.cuda(), case.device_kv.cuda(), got_host)
    offloaded = case.buffer_of_req[slots] >= 0
    kinds = torch.where(offloaded, reference.BIND_BUFFER_SLOT, 0).to(torch.int64)
    bind_plan = torch.stack([torch.arange(slots.numel()), slots, kinds])
    # new page starts past every token's location (the kernel may not read what another thread writes)
    num_locs = case.device_row_of_loc.numel() - 1
    first = -(-num_locs // 64) * 64
    new_locs = first + 64 * torch.arange(slots.numel(), dtype=torch.int64)
    row_of_loc = torch.cat([case.device_row_of_loc[:-1], torch.zeros(first - num_locs + 64 * slots.numel() + 1,
                                                                     dtype=torch.int32)])
    row_of_loc[-1] = -1
    pages = torch.tensor([7], dtype=torch.int64)
    want_map = row_of_loc.clone()
    reference.bind_rows(bind_plan, new_locs, pages, want_map, case.buffer_of_req, case.slot_rows,
                        case.slot_tokens.shape[1], 64)
    got_map = row_of_loc.cuda()
    ops.bind_rows(bind_plan.cuda(), new_locs.cuda(), pages.cuda(), got_map, case.buffer_of_req.cuda(),
                  case.slot_rows.cuda(), case.slot_tokens.shape[1], 64)
    torch.cuda.synchronize()
    if not torch.equal(want_host, got_host) or not torch.equal(want_map, got_map.cpu()):
        print("MISMATCH decode rows")
        return False
    return True


def positions_match(ops: dict) -> bool:
    """swap_in_positions (each of POSITION_SHAPES) on 3 requests, one resident, one padded row: every build of
    RUNS' kinds."""
    return all(positions_shape_match(ops, *shape) for shape in POSITION_SHAPES)


def positions_shape_match(ops: dict, positions: int, buffer_size: int, miss_rate: float, overlap: float) -> bool:
    case = make_positions_case(
        4, positions, 2048, buffer_size, 1152, miss_rate=miss_rate, overlap=overlap, duplicate_fraction=0.02,
        padding_fraction=0.01, out_of_range_fraction=0.01, resident_fraction=0.34, num_real=3, seed=43,
    )
    expected = case.clone()
    expected_counters = torch.zeros(2, dtype=torch.int64)
    expected_limit = torch.full((4,), reference.NO_VERIFY_LIMIT, dtype=torch.int32)
    expected_out = reference.swap_in_positions(*expected.args(), counters=expected_counters,
                                               verify_limit=expected_limit)
    for name, splits in POSITION_RUNS:
        actual = case.clone(device="cuda", pin_host=True)
        counters = torch.zeros(2, dtype=torch.int64, device="cuda")
        limit = torch.full((4,), reference.NO_VERIFY_LIMIT, dtype=torch.int32, device="cuda")
        out = ops[name].swap_in_positions(*actual.args(), counters=counters, verify_limit=limit, splits=splits)
        torch.cuda.synchronize()
        for what, want, got in (
            ("verify_limit", expected_limit, limit),
            ("out", expected_out, out),
            ("slot_tokens", expected.slot_tokens, actual.slot_tokens),
            ("slot_stamps", expected.slot_stamps, actual.slot_stamps),
            ("token_slot", expected.token_slot, actual.token_slot),
            ("device_kv", expected.device_kv, actual.device_kv),
            ("counters", expected_counters, counters),
            ("launch workspace", torch.zeros_like(ops[name]._sync.cpu()), ops[name]._sync),
        ):
            if not torch.equal(want, got.cpu()):
                print(f"MISMATCH swap_in_positions T={positions} {name} build, splits={splits}: {what}")
                return False
    return True


def verify_rows_match(case, ops: CudaOps) -> bool:
    """bind_verify_slots then commit_accepted (T = 2, two layers) on the case's tables: every request,
    accept lengths 0, 1 and 2."""
    slots = case.req_pool_indices.to(torch.int64)
    num_real = torch.tensor([slots.numel()], dtype=torch.int32)
    buffer_size = case.slot_tokens.shape[1]
    accept_lens = torch.arange(slots.numel(), dtype=torch.int64) % 3
    # The resident requests' verify positions s, s + 1 get device rows of their own: rows 1, 2, ... of the
    # first page, which the case leaves unused.
    row_of_loc = case.device_row_of_loc.clone()
    resident = case.buffer_of_req[slots] < 0
    positions = case.seq_lens[resident].reshape(-1, 1) + torch.arange(2)
    verify_locs = case.req_to_token[slots[resident].reshape(-1, 1), positions]
    row_of_loc[verify_locs.reshape(-1).to(torch.int64)] = 1 + torch.arange(verify_locs.numel(), dtype=torch.int32)
    device = [case.device_kv.clone() for _ in range(2)]
    host = [case.host_kv.clone() for _ in range(2)]

    want_map = row_of_loc.clone()
    want_device = [layer.clone() for layer in device]
    want_host = [layer.clone() for layer in host]
    reference.bind_verify_slots(slots, case.seq_lens, num_real, 2, case.req_to_token, want_map, case.buffer_of_req,
                                case.slot_rows, buffer_size)
    reference.commit_accepted(slots, case.seq_lens, accept_lens, num_real, 2, case.req_to_token, want_map,
                              case.buffer_of_req, case.slot_rows, buffer_size, want_device, want_host)

    got_map = row_of_loc.cuda()
    got_device = [layer.cuda() for layer in device]
    got_host = [layer.pin_memory() for layer in host]
    batch = (slots.cuda(), case.seq_lens.cuda())
    tables = (case.req_to_token.cuda(), got_map, case.buffer_of_req.cuda(), case.slot_rows.cuda(), buffer_size)
    ops.bind_verify_slots(*batch, num_real.cuda(), 2, *tables)
    ops.commit_accepted(*batch, accept_lens.cuda(), num_real.cuda(), 2, *tables, got_device, got_host)
    torch.cuda.synchronize()
    same = torch.equal(want_map, got_map.cpu()) and all(
        torch.equal(want, got.cpu()) for want, got in zip(want_device + want_host, got_device + got_host))
    if not same:
        print("MISMATCH verify rows (bind_verify_slots, commit_accepted)")
    return same

if __name__ == "__main__":
    sys.exit(main())
