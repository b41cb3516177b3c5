"""The CUDA twins of a verify step's ops (swap_in_positions, bind_verify_slots, commit_accepted) against
their reference twins in ops/reference.py, bit for bit (GPU only).

swap_in_positions: outputs, slot tokens, stamps, the token -> slot map, the whole device KV tensor and the
counters and the verify limits, on bf16 (1152-B) and fp8 (656-B) rows, T = 1 .. 4 at top_k 2048 (T = 3, 4
with the default device_buffer_size 4096: two launches of two positions whose misses may not fit, so later
positions are left out and the limit lowered; with T x 2048: one launch per position, the reference twin with
the same group) and at top_k 1024 (one launch, or explicit groups of 1 .. 3), resident and offloaded requests in
one batch, padded rows, tokens shared by several positions, limits set by an earlier layer, every split and the
test-hook builds, CUDA-graph replay with drifting top-k and lengths growing by 1..T per replay; and the shapes
it refuses before any launch (only where not even one position fits a launch). bind_verify_slots,
commit_accepted and cap_accepted: the location -> row table, every host and device layer, padded rows, accept
lengths 0..T, the capped accept lengths and indices, graph replay.
"""

import pytest
import torch

from hisparse_sglang.ops import reference
from hisparse_sglang.testing.cases import POISON, make_positions_case

pytestmark = pytest.mark.gpu

# Test hooks of variant builds (jit.load_module(defines=...); the production build has none), as in
# tests/gpu/test_swap_in.py and test_swap_in_progress.py: they apply to swap_in_positions' kernel too.
LATE_COPIERS = ("HISPARSE_TEST_LATE_COPIERS_NS=30000",)
LATE_ARRIVALS = ("HISPARSE_TEST_LATE_ARRIVALS_NS=30000",)
LATE_PLANNER = ("HISPARSE_TEST_LATE_PLANNER_NS=30000",)


def cuda_ops(module=None):
    from hisparse_sglang.ops.swap_in import CudaOps

    return CudaOps(module=module)


def variant(defines):
    from hisparse_sglang.ops.jit import load_module

    return load_module(defines)


def assert_same(name, expected, actual):
    expected = expected.cpu()
    actual = actual.cpu()
    if expected.shape != actual.shape:
        raise AssertionError(f"{name}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}")
    if not torch.equal(expected, actual):
        diff = torch.nonzero(expected != actual)
        first = tuple(diff[0].tolist())
        raise AssertionError(
            f"{name}: {diff.shape[0]} elements differ; first at {first}: expected {expected[first].item()}, "
            f"got {actual[first].item()}"
        )


def assert_workspace_clear(ops):
    """The swap-in launch workspace is back to 0 after a launch (what lets graph replays run without host work)."""
    from hisparse_sglang.ops.swap_in_plan import SYNC_COUNTERS_PER_ROW

    workspace = ops._sync.cpu()
    if bool(workspace.any()):
        rows = workspace.numel() // SYNC_COUNTERS_PER_ROW
        raise AssertionError(f"launch workspace not reset: {workspace.reshape(SYNC_COUNTERS_PER_ROW, rows).tolist()}")


# ------------------------------------------------------------------------------------ swap_in_positions
def default_group(case):
    """The group both twins choose when given none (swap_in_plan.positions_per_group, sm_90's limit)."""
    from hisparse_sglang.ops.swap_in_plan import positions_per_group

    _, positions, top_k = case.top_k.shape
    return positions_per_group(positions, top_k, case.slot_tokens.shape[1])


def run_both(case, splits=None, threads=None, module=None, group=None, limit=None, resident_rows=False):
    """The reference on CPU copies, the kernel (of ``module``, default the production build) on GPU
    copies with a sentinel-filled output, both with ``group`` (None: each twin's default, which must be the
    same) and verify limits ``limit`` (None: none set yet); both states and limits, the workspace checked
    clear."""
    if limit is None:
        limit = torch.full((case.top_k.shape[0],), reference.NO_VERIFY_LIMIT, dtype=torch.int32)
    expected = case.clone()
    expected_counters = torch.zeros(2, dtype=torch.int64)
    expected_limit = limit.clone()
    expected_out = reference.swap_in_positions(*expected.args(), counters=expected_counters,
                                               verify_limit=expected_limit, group=group, resident_rows=resident_rows)
    actual_limit = limit.clone().cuda()

    actual = case.clone(device="cuda", pin_host=True)
    counters = torch.zeros(2, dtype=torch.int64, device="cuda")
    out = torch.full(tuple(case.top_k.shape), 777, dtype=torch.int32, device="cuda")
    ops = cuda_ops(module)
    _, positions, top_k = case.top_k.shape
    assert ops.positions_group(positions, top_k, case.slot_tokens.shape[1]) == default_group(case), (
        "this GPU's shared memory per block gives another default group than the reference's (sm_90's)"
    )
    result = ops.swap_in_positions(*actual.args(), out=out, counters=counters, verify_limit=actual_limit,
                                   splits=splits, threads=threads, group=group, resident_rows=resident_rows)
    assert result is out
    torch.cuda.synchronize()
    assert_workspace_clear(ops)
    return (expected, expected_out, expected_counters, expected_limit), (actual, out.cpu(), counters.cpu(),
                                                                         actual_limit.cpu())


def check(case, **kwargs):
    """Both twins bit for bit (outputs, tables, KV, counters, limits); returns (outputs, limits)."""
    (exp, exp_out, exp_counters, exp_limit), (act, out, counters, limit) = run_both(case, **kwargs)
    assert_same("verify_limit", exp_limit, limit)
    assert_same("out", exp_out, out)
    assert_same("slot_tokens", exp.slot_tokens, act.slot_tokens)
    assert_same("slot_stamps", exp.slot_stamps, act.slot_stamps)
    assert_same("token_slot", exp.token_slot, act.token_slot)
    assert_same("device_kv", exp.device_kv, act.device_kv)
    assert_same("counters", exp_counters, counters)
    assert torch.equal(act.host_kv, case.host_kv), "the kernel wrote host memory"
    group = kwargs.get("group") or default_group(case)
    if bool((limit < case.top_k.shape[1]).any()):
        pass  # positions left out: fewer copies than the union's misses
    elif group >= case.top_k.shape[1]:
        assert int(exp_counters[1]) == case.expected_misses  # one group: the union's misses, each once
    else:
        # Groups: every union miss is copied (once per group that misses it; a later group may miss a token an
        # earlier group's misses evicted), and every returned row still holds its token after the last group.
        assert int(exp_counters[1]) >= case.expected_misses
    assert_history_rows_hold_their_kv(case, act, out, limit)
    return exp_out, limit


def assert_history_rows_hold_their_kv(case, state, out, limit=None):
    """After the call (after its last group): every served history entry's row, whichever group returned it,
    holds its token's host row, every served verify entry maps to its verify slot, and every entry of a
    position at or past the row's limit is -1."""
    positions = case.top_k.shape[1]
    buffer_size = case.slot_tokens.shape[1]
    device_kv = state.device_kv.cpu()
    for b in range(min(int(case.num_real_reqs[0]), case.top_k.shape[0])):
        req, committed = int(case.req_pool_indices[b]), int(case.seq_lens[b])
        buf = int(case.buffer_of_req[req])
        if buf < 0:
            continue
        served = positions if limit is None else max(0, min(positions, int(limit[b])))
        assert bool((out[b][served:] == -1).all()), f"batch row {b}: a position past its limit was served"
        tokens = case.top_k[b].to(torch.int64)
        valid = (tokens >= 0) & (tokens <= committed + torch.arange(positions).reshape(-1, 1))
        valid[served:] = False
        history = valid & (tokens < committed - 1)
        rows = out[b][history].to(torch.int64)
        want = case.host_kv[case.req_to_token[req, tokens[history]].to(torch.int64)]
        if not torch.equal(device_kv[rows], want):
            raise AssertionError(f"batch row {b}: a returned history row does not hold its token's KV")
        verify = valid & (tokens >= committed)
        assert torch.equal(out[b][verify], case.slot_rows[buf, buffer_size + 1 + (tokens[verify] - committed)])


CORRECTNESS = [
    # (batch, T, top_k, buffer_size, row_bytes, miss_rate)
    (1, 2, 2048, 4096, 1152, 0.2),
    (8, 2, 2048, 4096, 656, 0.2),
    (33, 2, 2048, 4096, 1152, 0.05),
    (2, 2, 2048, 5760, 1152, 1.0),  # the largest buffer the plan of 4096 entries takes on sm_90
    (4, 1, 2048, 4096, 656, 0.5),
    (5, 3, 1024, 4096, 656, 0.3),
    (3, 4, 1024, 4096, 1152, 1.0),
    (6, 4, 1024, 4096, 656, 0.0),
    (7, 4, 512, 2048, 64, 0.4),
    # T = 3, 4 at top_k 2048 (--speculative-num-steps 2, 3) with D = T x K: one launch per position.
    (3, 3, 2048, 6144, 1152, 0.2),
    (4, 3, 2048, 6144, 656, 0.5),
    (2, 4, 2048, 8192, 1152, 0.3),
    (5, 4, 2048, 8192, 656, 0.2),
    (2, 4, 2048, 8192, 656, 1.0),
    (3, 4, 2048, 8192, 1152, 0.0),
    # T = 2 with a buffer beyond the 2-position plan (refused before groups): one position per launch.
    (3, 2, 2048, 8192, 1152, 0.3),
    # T = 3, 4 at top_k 2048 with the default buffer of 4096: two positions per launch; where the later group's
    # misses do not fit, its later positions are left out (test_positions_left_out_... asserts some are).
    (3, 3, 2048, 4096, 1152, 0.2),
    (4, 4, 2048, 4096, 656, 0.3),
    (2, 4, 2048, 4096, 1152, 1.0),
    (6, 4, 2048, 4096, 1152, 0.05),
    (5, 4, 1024, 2048, 656, 0.5),
]


@pytest.mark.parametrize("batch,positions,top_k,buffer_size,row_bytes,miss_rate", CORRECTNESS)
def test_matches_reference(batch, positions, top_k, buffer_size, row_bytes, miss_rate):
    case = make_positions_case(
        batch, positions, top_k, buffer_size, row_bytes, miss_rate=miss_rate, overlap=0.7, duplicate_fraction=0.03,
        padding_fraction=0.02, out_of_range_fraction=0.01, resident_fraction=0.25, empty_slot_fraction=0.1,
        seed=batch * 31 + positions * 7 + top_k,
    )
    check(case)


@pytest.mark.parametrize("splits", [None, 1, 2, 7, 65])
def test_resident_rows_translated_by_every_cta(splits):
    """Resident rows only (the verify of a batch that fits the GPU): every CTA of a row translates its share
    of the group's entries, each entry up to its position's causal limit, in every split."""
    case = make_positions_case(3, 4, 2048, 4096, 1152, miss_rate=0.3, resident_fraction=1.0,
                               out_of_range_fraction=0.02, seed=70 + (splits or 0))
    assert bool((case.buffer_of_req[case.req_pool_indices.long()] < 0).all())
    check(case, splits=splits)


@pytest.mark.parametrize("splits", [None, 1, 3, 65])
@pytest.mark.parametrize("batch,positions,resident_fraction", [(1, 4, 1.0), (6, 4, 0.5), (5, 2, 0.4)])
def test_resident_rows_given_are_passed_through(splits, batch, positions, resident_fraction):
    """With resident_rows (the fused top-k through verify_page_table) a resident request's entries are its device
    rows already and come out as they are, -1 included; offloaded requests are served from positions as before."""
    case = make_positions_case(batch, positions, 2048, 4096, 1152, miss_rate=0.3, resident_fraction=resident_fraction,
                               padding_fraction=0.02, seed=400 + batch + (splits or 0))
    resident = case.buffer_of_req[case.req_pool_indices.long()] < 0
    assert bool(resident.any())
    rows = reference.swap_in_positions(*case.clone().args())  # what the fused top-k gives a resident request
    case.top_k[resident] = rows[resident]
    out, _ = check(case, splits=splits, resident_rows=True)
    real = torch.arange(batch) < int(case.num_real_reqs[0])
    assert torch.equal(out[resident & real], rows[resident & real])


def test_positions_left_out_where_their_misses_do_not_fit():
    """T = 4 at top_k 2048 with 4096 slots and many misses: some rows' later positions are left out (limit
    below 4, every one of their entries -1), never position 0 or 1 (the first group always fits), in every
    split; a limit an earlier layer set is honoured (no position at or past it served, nothing lowered above)."""
    left_out = 0
    for splits in (None, 1, 3, 17):
        case = make_positions_case(6, 4, 2048, 4096, 1152, miss_rate=0.6, overlap=0.3, resident_fraction=0.17,
                                   seed=200 + (splits or 0))
        _, limit = check(case, splits=splits)
        assert bool((limit >= 2).all())
        left_out += int((limit < 4).sum())
    assert left_out > 0, "no position was left out: the case does not exercise the overflow path"
    case = make_positions_case(5, 4, 2048, 4096, 656, miss_rate=0.3, resident_fraction=0.2, seed=210)
    preset = torch.tensor([2, 3, reference.NO_VERIFY_LIMIT, 1, 4], dtype=torch.int32)
    for splits in (None, 1, 5):
        _, limit = check(case, splits=splits, limit=preset)
        assert bool((limit <= preset).all())


@pytest.mark.parametrize("threads", [256, 512, 1024])
@pytest.mark.parametrize("row_bytes", [1152, 656])
@pytest.mark.parametrize("positions,buffer_size", [(2, 4096), (4, 8192), (4, 4096)])
def test_every_block_size_and_row_size(threads, row_bytes, positions, buffer_size):
    case = make_positions_case(4, positions, 2048, buffer_size, row_bytes, miss_rate=0.3, resident_fraction=0.25,
                               duplicate_fraction=0.02, seed=threads + row_bytes + positions)
    check(case, threads=threads)


@pytest.mark.parametrize("positions,top_k,buffer_size,group", [
    (4, 1024, 4096, 1), (4, 1024, 4096, 2), (4, 1024, 4096, 3), (3, 1024, 4096, 2), (3, 2048, 6144, 1),
    (4, 2048, 8192, 1), (2, 2048, 4096, 1),
])
@pytest.mark.parametrize("splits", [None, 1, 5])
def test_explicit_groups_match_the_reference_with_the_same_group(positions, top_k, buffer_size, group, splits):
    """Both twins in groups of ``group`` positions (the last group shorter where it does not divide T)."""
    case = make_positions_case(3, positions, top_k, buffer_size, 656, miss_rate=0.4, overlap=0.6,
                               resident_fraction=0.34, duplicate_fraction=0.02, padding_fraction=0.02,
                               seed=positions * 10 + group + top_k)
    check(case, group=group, splits=splits)


@pytest.mark.parametrize("splits", [1, 2, 3, 5, 17, 65])
def test_every_split_matches_reference(splits):
    case = make_positions_case(3, 2, 2048, 4096, 1152, miss_rate=0.4, duplicate_fraction=0.02, seed=splits)
    check(case, splits=splits)


@pytest.mark.parametrize("defines,splits", [
    (LATE_COPIERS, 2), (LATE_COPIERS, 17), (LATE_COPIERS, 65), (LATE_ARRIVALS, 3), (LATE_ARRIVALS, 17),
    (LATE_PLANNER, 5),
])
@pytest.mark.parametrize("positions,buffer_size", [(2, 4096), (4, 8192), (4, 4096)])
def test_late_copiers_arrivals_and_planner(defines, splits, positions, buffer_size):
    """The planner/copier handshake over a launch's G x K entries: copiers that look up late (the planner
    waits), claim late (the planner copies their chunks), or a planner that announces itself late; with T = 4
    in every one of the four launches, each reusing the workspace the previous one reset."""
    case = make_positions_case(3, positions, 2048, buffer_size, 656, miss_rate=0.3, resident_fraction=0.34,
                               seed=80 + splits + positions)
    check(case, splits=splits, module=variant(defines))


def test_tokens_shared_by_positions_are_looked_up_and_copied_once():
    """Every position names the same entries (overlap 1): each missed token is copied once, and every
    position reads the same row for it; the lookups count every position's history entries."""
    case = make_positions_case(2, 2, 2048, 4096, 1152, miss_rate=0.5, overlap=1.0, verify_entries=False, seed=90)
    out, _ = check(case)
    assert torch.equal(out[:, 0], out[:, 1])
    # Position 1 names position 0's misses again: a miss only position 1 named is also copied once.
    case = make_positions_case(2, 2, 1024, 4096, 656, miss_rate=1.0, overlap=0.5, seed=91)
    check(case)


def test_one_position_equals_swap_in():
    """T = 1 with entries below s is swap_in with seq_len s, bit for bit (both CUDA twins)."""
    from hisparse_sglang.testing.cases import make_case

    case = make_case(5, 2048, 4096, 1152, miss_rate=0.3, resident_fraction=0.2, duplicate_fraction=0.02,
                     out_of_range_fraction=0.02, seed=92)
    case.top_k[case.top_k >= case.seq_lens.reshape(-1, 1).to(torch.int32)] = -1
    single = case.clone(device="cuda", pin_host=True)
    multi = case.clone(device="cuda", pin_host=True)
    multi.top_k = multi.top_k.reshape(5, 1, 2048).contiguous()
    ops = cuda_ops()
    counters = [torch.zeros(2, dtype=torch.int64, device="cuda") for _ in range(2)]
    out_single = ops.swap_in(*single.args(), counters=counters[0], splits=3)
    out_multi = ops.swap_in_positions(*multi.args(), counters=counters[1], splits=3)
    torch.cuda.synchronize()
    assert_same("out", out_single, out_multi.reshape(5, 2048))
    for name in ("slot_tokens", "slot_stamps", "token_slot", "device_kv"):
        assert_same(name, getattr(single, name), getattr(multi, name))
    assert_same("counters", counters[0], counters[1])


def test_padded_rows_output_minus_one_and_touch_nothing():
    case = make_positions_case(8, 2, 1024, 2048, 1152, miss_rate=0.5, resident_fraction=0.25, num_real=3, seed=93)
    out, _ = check(case)
    assert bool((out[3:] == -1).all())
    for positions, row_bytes in ((3, 656), (4, 1152)):  # every launch of a group writes its padded rows' -1
        case = make_positions_case(6, positions, 2048, positions * 2048, row_bytes, miss_rate=0.4,
                                   resident_fraction=0.25, num_real=3, seed=93 + positions)
        out, limit = check(case)
        assert bool((out[3:] == -1).all()) and bool((limit[3:] == reference.NO_VERIFY_LIMIT).all())
    empty = make_positions_case(4, 2, 512, 1024, 64, miss_rate=0.5, num_real=0, seed=94)
    assert bool((check(empty)[0] == -1).all())


def test_seq_len_around_buffer_size_and_short_requests():
    for seq_len in (1023, 1024, 1025, 3, 2):
        check(make_positions_case(4, 2, 512, 1024, 656, miss_rate=0.3, seq_len=seq_len, seed=95 + seq_len))


def drift(top_k, committed, generator, keep=0.8):
    """The next verify's top-k: most entries kept where still causal, the rest drawn from [0, s + j] of
    each position j (history, the newest token, verify tokens), a few padding."""
    batch, positions, count = top_k.shape
    limit = committed.reshape(-1, 1, 1) + torch.arange(positions).reshape(1, -1, 1)
    fresh = (torch.rand((batch, positions, count), generator=generator) * (limit + 1).to(torch.float32)).to(torch.int64)
    kept = torch.rand((batch, positions, count), generator=generator) < keep
    out = torch.where(kept & (top_k >= 0), top_k.to(torch.int64), fresh)
    out[torch.rand((batch, positions, count), generator=generator) < 0.01] = -1
    return out.to(torch.int32)


@pytest.mark.parametrize("positions,top_k,buffer_size,row_bytes", [(2, 1024, 2048, 656), (2, 2048, 4096, 1152),
                                                                   (4, 512, 2048, 1152), (3, 2048, 6144, 1152),
                                                                   (4, 2048, 8192, 656), (4, 2048, 4096, 1152)])
def test_graph_replays_with_drifting_top_k_and_growing_lengths(positions, top_k, buffer_size, row_bytes):
    """Capture once, replay 12 verifies: each request's s grows by its accept length 1..T, the top-k drifts
    (20 % fresh entries within each position's causal range), and the number of real rows changes; every
    replay bit for bit against the reference, the workspace clear. T = 3, 4 at top_k 2048 capture one launch
    per position."""
    batch = 4
    base = make_positions_case(batch, positions, top_k, buffer_size, row_bytes, miss_rate=0.3, resident_fraction=0.25,
                               seq_len=buffer_size + 40, context_slack=128, seed=96)
    ref = base.clone()
    gpu = base.clone(device="cuda", pin_host=True)
    out = torch.full(tuple(base.top_k.shape), 777, dtype=torch.int32, device="cuda")
    counters = torch.zeros(2, dtype=torch.int64, device="cuda")
    ref_counters = torch.zeros(2, dtype=torch.int64)
    limit = torch.full((batch,), reference.NO_VERIFY_LIMIT, dtype=torch.int32, device="cuda")
    ref_limit = limit.cpu()
    ops = cuda_ops()
    ops.reserve(batch, top_k, buffer_size, num_positions=positions)
    warm = gpu.clone(device="cuda", pin_host=True)
    ops.swap_in_positions(*warm.args(), out=out.clone(), splits=3)  # loads the module, sets the smem limit
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.swap_in_positions(*gpu.args(), out=out, counters=counters, verify_limit=limit, splits=3)
    generator = torch.Generator().manual_seed(97)
    committed = base.seq_lens.clone()
    top = base.top_k.clone()
    for step in range(12):
        committed += torch.randint(1, positions + 1, (batch,), generator=generator)
        top = drift(top, committed, generator)
        real = batch if step % 3 else batch - 1
        for state in (ref, gpu):
            state.top_k.copy_(top)
            state.seq_lens.copy_(committed)
            state.num_real_reqs.fill_(real)
        limit.fill_(reference.NO_VERIFY_LIMIT)  # what cap_accepted does after each step's acceptance
        ref_limit.fill_(reference.NO_VERIFY_LIMIT)
        expected = reference.swap_in_positions(*ref.args(), counters=ref_counters, verify_limit=ref_limit)
        graph.replay()
        torch.cuda.synchronize()
        assert_same(f"verify_limit step {step}", ref_limit, limit)
        assert_same(f"out step {step}", expected, out)
        for name in ("slot_tokens", "slot_stamps", "token_slot", "device_kv"):
            assert_same(f"{name} step {step}", getattr(ref, name), getattr(gpu, name))
        assert_same(f"counters step {step}", ref_counters, counters)
        assert_history_rows_hold_their_kv(ref, gpu, out.cpu(), ref_limit)
        assert_workspace_clear(ops)
    assert int(ref_counters[1]) > 0, "the replays never missed"


def test_shapes_the_kernel_cannot_plan_are_refused_before_any_launch():
    from hisparse_sglang.errors import HiSparseConfigError

    ops = cuda_ops()
    # T = 3, 4 with top_k 2048 are served with the default buffer and with one position per launch: reserve
    # checks them without raising.
    ops.reserve(4, 2048, 4096, num_positions=4)
    ops.reserve(4, 2048, 6144, num_positions=3)
    ops.reserve(4, 2048, 8192, num_positions=4)
    # A buffer of 14336 slots is too large for even one position's launch with top_k 2048.
    case = make_positions_case(1, 7, 2048, 14336, 64, miss_rate=0.5, seed=98)
    gpu = case.clone(device="cuda", pin_host=True)
    out = torch.full(tuple(case.top_k.shape), 777, dtype=torch.int32, device="cuda")
    with pytest.raises(HiSparseConfigError) as info:
        ops.swap_in_positions(*gpu.args(), out=out)
    for fragment in ("device_buffer_size (14336) is too large", "device_buffer_size <= 14272", "232,448 B"):
        assert fragment in str(info.value), str(info.value)
    with pytest.raises(HiSparseConfigError):
        ops.reserve(4, 2048, 14336, num_positions=7)
    # An explicit group too large for a launch (2 x 2048 entries with 8192 slots).
    case4 = make_positions_case(1, 4, 2048, 8192, 64, miss_rate=0.5, seed=98)
    gpu4 = case4.clone(device="cuda", pin_host=True)
    out4 = torch.full(tuple(case4.top_k.shape), 777, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="groups of 2 verify positions do not fit.*the largest group that fits is 1"):
        ops.swap_in_positions(*gpu4.args(), out=out4, group=2)
    torch.cuda.synchronize()
    assert bool((out == 777).all()) and bool((out4 == 777).all()), "a refused call launched"
    assert torch.equal(gpu.slot_tokens.cpu(), case.slot_tokens)
    assert torch.equal(gpu4.slot_tokens.cpu(), case4.slot_tokens)
    # top_k above device_buffer_size, and a buffer too large for even one position's plan.
    for buffer_size, fragment in ((1984, "device_buffer_size (1984) must be at least top_k (2048)"),
                                  (16384, "device_buffer_size <= 14272")):
        case = make_positions_case(1, 2, 2048, buffer_size, 64, miss_rate=0.5, seed=99)
        with pytest.raises(HiSparseConfigError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
            ops.swap_in_positions(*case.clone(device="cuda", pin_host=True).args())
    # More positions than a buffer's reserved page holds: the reference twin's ValueError, by both twins.
    case = make_positions_case(1, 4, 64, 256, 64, page_size=4, miss_rate=0.5, seed=100)
    with pytest.raises(ValueError, match="4 verify positions per request, but a buffer's reserved page holds 3"):
        reference.swap_in_positions(*case.clone().args())
    with pytest.raises(ValueError, match="4 verify positions per request, but a buffer's reserved page holds 3"):
        ops.swap_in_positions(*case.clone(device="cuda", pin_host=True).args())


def test_binding_refuses_rows_that_are_not_contiguous():
    case = make_positions_case(2, 2, 256, 1024, 64, miss_rate=0.5, seed=101).clone(device="cuda", pin_host=True)
    case.top_k = torch.cat([case.top_k, case.top_k], dim=2)[:, :, :256]  # rows of 512 entries: positions apart
    with pytest.raises(ValueError, match=r"swap_in_positions: top_k must be int32 \[batch, T, K\] on CUDA, each row's"):
        cuda_ops().swap_in_positions(*case.args())
    case.top_k = case.top_k.contiguous()
    with pytest.raises(ValueError, match=r"swap_in_positions: top_k must be int32 \[B, T, K\]"):
        cuda_ops().swap_in_positions(case.top_k[:, 0], *case.args()[1:])


# ------------------------------------------------------------------------------ bind / commit tables
BUFFER = 64
PAGE = 16


def verify_tables(seed: int, batch: int, positions: int, row_bytes: int, layers: int, index_dtype=torch.int64):
    """A verify step's tables: ``batch`` distinct request slots (a third resident), each with committed
    length s and locations up to s + T; buffers of D + P distinct device rows for the offloaded ones,
    distinct device rows for every resident position; device KV of unique bytes per row and layer,
    host KV poisoned. The offloaded requests' verify positions are bound as bind_verify_slots binds them."""
    g = torch.Generator().manual_seed(seed)
    slots, context = batch + 3, 400
    num_locs = slots * context + 1
    req_to_token = (torch.randperm(num_locs - 1, generator=g)[: slots * context] + 1).to(torch.int32)
    req_to_token = req_to_token.reshape(slots, context)
    req_pool_indices = torch.randperm(slots, generator=g)[:batch]
    offloaded = torch.rand(batch, generator=g) >= 1 / 3
    num_buffers = int(offloaded.sum())
    seq_lens = torch.randint(1, context - positions, (batch,), generator=g)
    resident_rows = int(seq_lens[~offloaded].sum()) + positions * batch
    num_rows = PAGE + num_buffers * (BUFFER + PAGE) + resident_rows
    rows = torch.randperm(num_rows - PAGE, generator=g).to(torch.int32) + PAGE
    buffer_of_req = torch.full((slots,), -1, dtype=torch.int32)
    slot_rows = rows[: num_buffers * (BUFFER + PAGE)].reshape(num_buffers, BUFFER + PAGE).clone()
    cursor = num_buffers * (BUFFER + PAGE)
    device_row_of_loc = torch.zeros(num_locs + 1, dtype=torch.int32)
    device_row_of_loc[-1] = -1
    buffer = 0
    for b in range(batch):
        slot, s = int(req_pool_indices[b]), int(seq_lens[b])
        if offloaded[b]:
            buffer_of_req[slot] = buffer
            buffer += 1
        else:
            count = s + positions
            device_row_of_loc[req_to_token[slot, :count].to(torch.int64)] = rows[cursor : cursor + count]
            cursor += count
    device_layers = [
        torch.arange(num_rows * row_bytes, dtype=torch.int64).add(layer * 131).remainder(251).to(torch.uint8)
        .reshape(num_rows, row_bytes) for layer in range(layers)
    ]
    host_layers = [torch.full((num_locs, row_bytes), POISON, dtype=torch.uint8) for _ in range(layers)]
    return dict(
        req_pool_indices=req_pool_indices.to(index_dtype), seq_lens=seq_lens.to(index_dtype),
        req_to_token=req_to_token, device_row_of_loc=device_row_of_loc, buffer_of_req=buffer_of_req,
        slot_rows=slot_rows, device_layers=device_layers, host_layers=host_layers,
    )


def bind_args(t, num_real, positions):
    return (t["req_pool_indices"], t["seq_lens"], num_real, positions, t["req_to_token"], t["device_row_of_loc"],
            t["buffer_of_req"], t["slot_rows"], BUFFER)


@pytest.mark.parametrize("batch", [1, 7, 130])
@pytest.mark.parametrize("positions", [1, 2, 4, 15])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_bind_verify_slots_matches_reference(batch, positions, index_dtype):
    t = verify_tables(batch * 13 + positions, batch, positions, 16, 1, index_dtype)
    real = max(1, batch - 2)  # the last rows are padding: left alone
    num_real = torch.tensor([real], dtype=torch.int32)
    before = t["device_row_of_loc"].clone()
    reference.bind_verify_slots(*bind_args(t, num_real, positions))
    expected = t["device_row_of_loc"]
    actual = before.cuda()
    gpu = {key: value.cuda() for key, value in t.items() if isinstance(value, torch.Tensor)}
    gpu["device_row_of_loc"] = actual
    cuda_ops().bind_verify_slots(*bind_args(gpu, num_real.cuda(), positions))
    torch.cuda.synchronize()
    assert_same("device_row_of_loc", expected, actual)
    if bool((t["buffer_of_req"][t["req_pool_indices"][:real].to(torch.int64)] >= 0).any()):
        assert not torch.equal(expected, before), "nothing was bound"


def verify_page_table_case(seed: int, batch: int, positions: int, width: int, index_dtype=torch.int64):
    """A verify's logical page table (one row per query; some ids outside the pool), its request slots (about half
    resident), and a location -> row table mapping every logical page start to a device page start."""
    g = torch.Generator().manual_seed(seed)
    num_pages, slots = 300, batch + 5
    page_table = torch.randint(-2, num_pages + 3, (batch * positions, width), generator=g, dtype=torch.int32)
    req_pool_indices = torch.randperm(slots, generator=g)[:batch].to(index_dtype)
    buffer_of_req = torch.where(torch.rand(slots, generator=g) < 0.5, -1, torch.arange(slots)).to(torch.int32)
    device_row_of_loc = torch.zeros(num_pages * PAGE + 1, dtype=torch.int32)
    device_row_of_loc[::PAGE][:num_pages] = torch.randint(0, 5000, (num_pages,), generator=g, dtype=torch.int32) * PAGE
    device_row_of_loc[-1] = -1
    return page_table, req_pool_indices, buffer_of_req, device_row_of_loc


@pytest.mark.parametrize("batch,positions,width", [(1, 4, 1), (3, 4, 257), (64, 2, 40), (7, 1, 1024)])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_verify_page_table_matches_reference(batch, positions, width, index_dtype):
    t = verify_page_table_case(batch * 7 + width, batch, positions, width, index_dtype)
    expected = reference.verify_page_table(t[0], t[1], positions, t[2], t[3], PAGE)
    actual = cuda_ops().verify_page_table(*(x.cuda() for x in t[:2]), positions, *(x.cuda() for x in t[2:]), PAGE)
    torch.cuda.synchronize()
    assert_same("verify_page_table", expected, actual)
    resident = (t[2][t[1].long()] < 0).repeat_interleave(positions)
    assert torch.equal(expected[~resident], torch.arange(width, dtype=torch.int32).expand(int((~resident).sum()), -1))
    if bool(resident.any()):
        assert not torch.equal(expected[resident], torch.arange(width, dtype=torch.int32).expand(int(resident.sum()), -1))


def test_verify_page_table_replays_in_a_cuda_graph_and_refuses_bad_arguments():
    from hisparse_sglang.errors import HiSparseError

    positions, batch = 4, 5
    t = [x.cuda() for x in verify_page_table_case(11, batch, positions, 33)]
    ops = cuda_ops()
    out = torch.empty_like(t[0])
    ops.verify_page_table(t[0], t[1], positions, t[2], t[3], PAGE, out=out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.verify_page_table(t[0], t[1], positions, t[2], t[3], PAGE, out=out)
    fresh = verify_page_table_case(12, batch, positions, 33)
    for mine, new in zip(t, fresh):
        mine.copy_(new.cuda())
    graph.replay()
    torch.cuda.synchronize()
    assert_same("replayed", reference.verify_page_table(fresh[0], fresh[1], positions, fresh[2], fresh[3], PAGE), out)
    with pytest.raises((ValueError, HiSparseError), match="req_pool_indices"):
        ops.verify_page_table(t[0], t[1][:-1], positions, t[2], t[3], PAGE)
    with pytest.raises((ValueError, HiSparseError), match="device_row_of_loc"):
        ops.verify_page_table(t[0], t[1], positions, t[2], t[3][:-1], PAGE)


def test_bind_verify_slots_replays_in_a_cuda_graph():
    positions = 3
    t = verify_tables(7, 9, positions, 16, 1)
    gpu = {key: value.cuda() for key, value in t.items() if isinstance(value, torch.Tensor)}
    num_real = torch.tensor([9], dtype=torch.int32, device="cuda")
    ops = cuda_ops()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        ops.bind_verify_slots(*bind_args(gpu, num_real, positions))  # warm-up outside capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            ops.bind_verify_slots(*bind_args(gpu, num_real, positions))
    torch.cuda.synchronize()
    reference.bind_verify_slots(*bind_args(t, num_real.cpu(), positions))  # what the warm-up bound
    for step in range(3):
        t["seq_lens"] += 2  # the next verify starts two positions later
        gpu["seq_lens"].copy_(t["seq_lens"])
        reference.bind_verify_slots(*bind_args(t, num_real.cpu(), positions))
        graph.replay()
        torch.cuda.synchronize()
        assert_same(f"device_row_of_loc step {step}", t["device_row_of_loc"], gpu["device_row_of_loc"])


def commit_args(t, accept_lens, num_real, positions, device_layers, host_layers):
    return (t["req_pool_indices"], t["seq_lens"], accept_lens, num_real, positions, t["req_to_token"],
            t["device_row_of_loc"], t["buffer_of_req"], t["slot_rows"], BUFFER, device_layers, host_layers)


def commit_both(t, accept_lens, real, positions, index_dtype=torch.int64):
    """Reference on CPU copies, kernel on GPU copies (device layers on the GPU, host layers pinned)."""
    num_real = torch.tensor([real], dtype=torch.int32)
    expected_device = [layer.clone() for layer in t["device_layers"]]
    expected_host = [layer.clone() for layer in t["host_layers"]]
    valid = accept_lens.clone()
    valid[(valid < 0) | (valid > positions)] = 0  # the kernel commits nothing for them; the reference refuses them
    reference.commit_accepted(*commit_args(t, valid, num_real, positions, expected_device, expected_host))
    gpu = {key: value.cuda() for key, value in t.items() if isinstance(value, torch.Tensor)}
    device = [layer.cuda() for layer in t["device_layers"]]
    host = [layer.clone().pin_memory() for layer in t["host_layers"]]
    cuda_ops().commit_accepted(*commit_args(gpu, accept_lens.to(index_dtype).cuda(), num_real.cuda(), positions,
                                            device, host))
    torch.cuda.synchronize()
    for layer in range(len(device)):
        assert_same(f"host layer {layer}", expected_host[layer], host[layer])
        assert_same(f"device layer {layer}", expected_device[layer], device[layer])
    return expected_host


@pytest.mark.parametrize("batch", [1, 5, 64])
@pytest.mark.parametrize("positions", [1, 2, 4])
@pytest.mark.parametrize("row_bytes", [1152, 656])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_commit_accepted_matches_reference(batch, positions, row_bytes, index_dtype):
    t = verify_tables(batch * 17 + positions, batch, positions, row_bytes, 3, index_dtype)
    reference.bind_verify_slots(*bind_args(t, torch.tensor([batch], dtype=torch.int32), positions))
    g = torch.Generator().manual_seed(batch + positions)
    accept_lens = torch.randint(0, positions + 1, (batch,), generator=g)
    accept_lens[0] = positions  # at least one row accepts everything
    real = max(1, batch - 1)
    host = commit_both(t, accept_lens, real, positions, index_dtype)
    assert int((host[0] != POISON).any(dim=1).sum()) > 0, "nothing was committed"


def test_commit_accepted_commits_nothing_for_padding_zero_and_out_of_range_lengths():
    positions = 2
    t = verify_tables(5, 6, positions, 656, 2)
    reference.bind_verify_slots(*bind_args(t, torch.tensor([6], dtype=torch.int32), positions))
    accept_lens = torch.tensor([0, positions + 1, -1, 1, 2, 2])  # rows 1, 2: outside [0, T]; row 5 padding
    commit_both(t, accept_lens, 5, positions)


def test_commit_accepted_replays_in_a_cuda_graph():
    positions, layers = 2, 2
    t = verify_tables(11, 8, positions, 1152, layers)
    reference.bind_verify_slots(*bind_args(t, torch.tensor([8], dtype=torch.int32), positions))
    gpu = {key: value.cuda() for key, value in t.items() if isinstance(value, torch.Tensor)}
    device = [layer.cuda() for layer in t["device_layers"]]
    host = [layer.clone().pin_memory() for layer in t["host_layers"]]
    accept_lens = torch.ones(8, dtype=torch.int64, device="cuda")
    num_real = torch.tensor([8], dtype=torch.int32, device="cuda")
    ops = cuda_ops()
    args = commit_args(gpu, accept_lens, num_real, positions, device, host)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        ops.commit_accepted(*args)  # warm-up outside capture (builds the layer pointer tables)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            ops.commit_accepted(*args)
    torch.cuda.synchronize()
    expected_device = [layer.clone() for layer in t["device_layers"]]
    expected_host = [layer.clone() for layer in t["host_layers"]]
    reference.commit_accepted(*commit_args(t, accept_lens.cpu(), num_real.cpu(), positions, expected_device,
                                           expected_host))
    for lengths in ([2, 0, 1, 2, 1, 1, 0, 2], [1, 2, 2, 0, 0, 1, 2, 1]):
        accept_lens.copy_(torch.tensor(lengths))
        reference.commit_accepted(*commit_args(t, accept_lens.cpu(), num_real.cpu(), positions, expected_device,
                                               expected_host))
        graph.replay()
        torch.cuda.synchronize()
        for layer in range(layers):
            assert_same(f"host layer {layer} {lengths}", expected_host[layer], host[layer])
            assert_same(f"device layer {layer} {lengths}", expected_device[layer], device[layer])


def test_verify_ops_refuse_bad_arguments_by_name():
    ops = cuda_ops()
    t = verify_tables(3, 4, 2, 64, 2)
    gpu = {key: value.cuda() for key, value in t.items() if isinstance(value, torch.Tensor)}
    num_real = torch.tensor([4], dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match="16 verify positions per request, but a buffer's reserved page holds 15"):
        ops.bind_verify_slots(*bind_args(gpu, num_real, 16))
    bad = dict(gpu, seq_lens=gpu["seq_lens"].to(torch.float32))
    with pytest.raises(ValueError, match=r"bind_verify_slots: seq_lens must be a contiguous int32/int64 \[B\]"):
        ops.bind_verify_slots(*bind_args(bad, num_real, 2))
    device = [layer.cuda() for layer in t["device_layers"]]
    host = [layer.pin_memory() for layer in t["host_layers"]]
    accept_lens = torch.ones(4, dtype=torch.int64, device="cuda")
    with pytest.raises(ValueError, match="2 device layers but 1 host layers"):
        ops.commit_accepted(*commit_args(gpu, accept_lens, num_real, 2, device, host[:1]))
    with pytest.raises(ValueError, match=r"commit_accepted: accept_lens must be a contiguous int32/int64 \[B\]"):
        ops.commit_accepted(*commit_args(gpu, accept_lens[:3], num_real, 2, device, host))
    with pytest.raises(ValueError, match="device rows of 64 B but host rows of 32 B"):
        ops.commit_accepted(*commit_args(gpu, accept_lens, num_real, 2, device,
                                         [layer[:, :32].contiguous().pin_memory() for layer in t["host_layers"]]))


# ------------------------------------------------------------------------------------ cap_accepted
@pytest.mark.parametrize("batch", [1, 5, 200])
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_cap_accepted_matches_reference(batch, index_dtype):
    generator = torch.Generator().manual_seed(batch)
    width = 4
    limit = torch.randint(0, width + 1, (batch + 3,), generator=generator, dtype=torch.int32)
    limit[torch.rand(batch + 3, generator=generator) < 0.4] = reference.NO_VERIFY_LIMIT
    accept_lens = torch.randint(1, width + 1, (batch,), generator=generator).to(index_dtype)
    accept_index = torch.arange(batch * width, dtype=torch.int32).reshape(batch, width)
    accept_index[torch.arange(width).reshape(1, -1) >= accept_lens.reshape(-1, 1)] = -1
    ref = [limit.clone(), accept_lens.clone(), accept_index.clone(), torch.zeros(2, dtype=torch.int64)]
    reference.cap_accepted(*ref)
    gpu = [t.clone().cuda() for t in (limit, accept_lens, accept_index)] + [torch.zeros(2, dtype=torch.int64,
                                                                                    device="cuda")]
    cuda_ops().cap_accepted(*gpu)
    torch.cuda.synchronize()
    for name, expected, actual in zip(("verify_limit", "accept_lens", "accept_index", "counters"), ref, gpu):
        assert_same(name, expected, actual)
    assert int(ref[3][0]) > 0 or batch == 1


def test_cap_accepted_counts_into_a_view_of_the_swap_counters():
    """The coordinator passes ``SwapCounters.caps``, the view ``[2:]`` of its four int64 counters: the kernel
    adds to elements 2 and 3 and leaves the swap-in's lookups and misses (0 and 1) alone."""
    limit = torch.tensor([1, 0, reference.NO_VERIFY_LIMIT, 2], dtype=torch.int32)
    accept_lens = torch.tensor([3, 2, 4, 1], dtype=torch.int32)
    accept_index = torch.arange(16, dtype=torch.int32).reshape(4, 4)
    accept_index[torch.arange(4).reshape(1, -1) >= accept_lens.reshape(-1, 1)] = -1
    ref_counters = torch.zeros(2, dtype=torch.int64)
    reference.cap_accepted(limit.clone(), accept_lens.clone(), accept_index.clone(), ref_counters)
    swap_counters = torch.tensor([11, 7, 5, 9], dtype=torch.int64, device="cuda")
    cuda_ops().cap_accepted(limit.cuda(), accept_lens.cuda(), accept_index.cuda(), swap_counters[2:])
    torch.cuda.synchronize()
    assert int(ref_counters[0]) == 2, "the case caps two rows"
    assert swap_counters.tolist() == [11, 7, 5 + int(ref_counters[0]), 9 + int(ref_counters[1])]


def test_cap_accepted_replays_in_a_cuda_graph_and_refuses_bad_arguments():
    ops = cuda_ops()
    limit = torch.full((8,), reference.NO_VERIFY_LIMIT, dtype=torch.int32, device="cuda")
    accept_lens = torch.zeros(4, dtype=torch.int32, device="cuda")
    accept_index = torch.zeros((4, 4), dtype=torch.int32, device="cuda")
    ops.cap_accepted(limit, accept_lens, accept_index)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.cap_accepted(limit, accept_lens, accept_index)
    for lens, limits in (([4, 2, 3, 1], [2, 1, 5, 3]), ([3, 3, 3, 3], [3, 2, 1, 4])):
        limit[:4].copy_(torch.tensor(limits, dtype=torch.int32))
        accept_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        accept_index.copy_(torch.arange(16, dtype=torch.int32).reshape(4, 4))
        ref = [limit.cpu(), accept_lens.cpu(), accept_index.cpu()]
        reference.cap_accepted(*ref)
        graph.replay()
        torch.cuda.synchronize()
        for name, expected, actual in zip(("verify_limit", "accept_lens", "accept_index"), ref,
                                          (limit, accept_lens, accept_index)):
            assert_same(name, expected, actual)
    with pytest.raises(ValueError, match="cap_accepted: accept_index"):
        ops.cap_accepted(limit, accept_lens, accept_index[:3])
    with pytest.raises(ValueError, match="cap_accepted: verify_limit"):
        ops.cap_accepted(limit[:2], accept_lens, accept_index)
