"""The CUDA swap-in and copy kernels against their reference twins, bit for bit (GPU only)."""

import pytest
import torch

from hisparse_sglang.ops import reference
from hisparse_sglang.ops.swap_in_plan import SYNC_COUNTERS_PER_ROW
from hisparse_sglang.testing.cases import POISON, make_case

pytestmark = pytest.mark.gpu

# The test hook of a variant build (jit.load_module(defines=...); the production build has no hook):
# a copier that claimed its chunk sleeps 30 us before its lookups, long after the planner reached its
# map update. benchmarks/gpu_progress_check.sh builds the same variant ahead of the tests.
LATE_COPIERS = ("HISPARSE_TEST_LATE_COPIERS_NS=30000",)


def cuda_ops(module=None):
    from hisparse_sglang.ops.swap_in import CudaOps

    return CudaOps(module=module)


def variant(defines):
    from hisparse_sglang.ops.jit import load_module

    return load_module(defines)


def run_both(case, splits=None, threads=None, graph=False, module=None):
    """Run the reference on CPU copies and the kernel (of ``module``, default the production build)
    on GPU copies; return both states. The launch workspace must be all zero afterwards."""
    expected = case.clone()
    expected_counters = torch.zeros(2, dtype=torch.int64)
    expected_out = reference.swap_in(*expected.args(), counters=expected_counters)

    actual = case.clone(device="cuda", pin_host=True)
    counters = torch.zeros(2, dtype=torch.int64, device="cuda")
    out = torch.full(tuple(case.top_k.shape), 777, dtype=torch.int32, device="cuda")  # sentinel
    ops = cuda_ops(module)
    if graph:
        ops.reserve(case.top_k.shape[0], case.top_k.shape[1])
        ops.swap_in(*actual.clone(device="cuda", pin_host=True).args(), out=out.clone(), splits=splits, threads=threads)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            ops.swap_in(*actual.args(), out=out, counters=counters, splits=splits, threads=threads)
        g.replay()
    else:
        ops.swap_in(*actual.args(), out=out, counters=counters, splits=splits, threads=threads)
    torch.cuda.synchronize()
    assert_workspace_clear(ops)
    return (expected, expected_out, expected_counters), (actual, out.cpu(), counters.cpu())


def assert_workspace_clear(ops):
    """The launch workspace (per row: the plan flag and the word of arrivals, lookups and CTAs done) is
    back to 0 after a launch: what lets the next launch or CUDA-graph replay run without host work."""
    from hisparse_sglang.ops.swap_in_plan import SYNC_COUNTERS_PER_ROW

    workspace = ops._sync.cpu()
    if bool(workspace.any()):
        rows = workspace.numel() // SYNC_COUNTERS_PER_ROW
        raise AssertionError(f"launch workspace not reset: [flags | row counts] x {rows} rows = "
                             f"{workspace.reshape(SYNC_COUNTERS_PER_ROW, rows).tolist()}")


def assert_same(name, expected, actual):
    expected = expected.cpu()
    actual = actual.cpu()
    if not torch.equal(expected, actual):
        diff = torch.nonzero(expected != actual)
        first = tuple(diff[0].tolist())
        raise AssertionError(
            f"{name}: {diff.shape[0]} elements differ; first at {first}: expected {expected[first].item()}, "
            f"got {actual[first].item()}"
        )


def check(case, **kwargs):
    (exp, exp_out, exp_counters), (act, out, counters) = run_both(case, **kwargs)
    assert_same("out", exp_out, out)
    assert_same("slot_tokens", exp.slot_tokens, act.slot_tokens)
    assert_same("slot_stamps", exp.slot_stamps, act.slot_stamps)
    assert_same("token_slot", exp.token_slot, act.token_slot)
    assert_same("device_kv", exp.device_kv, act.device_kv)
    assert_same("counters", exp_counters, counters)
    assert torch.equal(act.host_kv, case.host_kv), "the kernel wrote host memory"
    return exp_out


CORRECTNESS = [
    # (batch, top_k, buffer_size, row_bytes, miss_rate)
    (1, 2048, 4096, 1152, 0.2),
    (8, 2048, 4096, 1152, 0.2),
    (33, 2048, 4096, 656, 0.05),
    (4, 2048, 6144, 1152, 0.5),
    (5, 1024, 2048, 656, 0.3),
    (3, 512, 512, 1152, 1.0),
    (7, 512, 1024, 64, 0.0),
    (2, 2048, 2048, 1152, 1.0),
]


@pytest.mark.parametrize("batch,top_k,buffer_size,row_bytes,miss_rate", CORRECTNESS)
@pytest.mark.parametrize("threads", [256, 512, 1024])
def test_matches_reference(batch, top_k, buffer_size, row_bytes, miss_rate, threads):
    case = make_case(
        batch, top_k, buffer_size, row_bytes, miss_rate=miss_rate, duplicate_fraction=0.03, padding_fraction=0.02,
        out_of_range_fraction=0.01, resident_fraction=0.25, empty_slot_fraction=0.1, seed=batch * 31 + top_k,
    )
    check(case, threads=threads)


@pytest.mark.parametrize("splits", [1, 2, 3, 5, 16, 17])
def test_split_copies_match_reference(splits):
    case = make_case(3, 2048, 4096, 1152, miss_rate=0.4, duplicate_fraction=0.02, seed=splits)
    check(case, splits=splits)


@pytest.mark.parametrize("splits", [1, 2, 3, 7, 65])
@pytest.mark.parametrize("top_k,buffer_size", [(2048, 4096), (100, 512)])
def test_resident_rows_translated_by_every_cta(splits, top_k, buffer_size):
    """A resident row's entries are split over all its CTAs (whole-warp shares; at a top_k of 100 and 65
    CTAs most own none), beside padded rows and entries out of range; also under graph replay."""
    case = make_case(4, top_k, buffer_size, 1152, miss_rate=0.3, resident_fraction=1.0, padding_fraction=0.02,
                     out_of_range_fraction=0.02, num_real=3, seed=50 + splits)
    assert bool((case.buffer_of_req[case.req_pool_indices[:3].long()] < 0).all())
    check(case, splits=splits)
    check(case, splits=splits, graph=True)


@pytest.mark.parametrize("row_bytes,miss_rate", [(1152, 0.03), (1152, 0.3), (656, 0.1), (64, 1.0)])
def test_planner_alone_matches_reference(row_bytes, miss_rate):
    """One CTA per request (the large-batch path): the planner copies every missed row itself after
    choosing the slots; few and many misses, duplicates, every row size; also under graph replay."""
    case = make_case(4, 2048, 4096, row_bytes, miss_rate=miss_rate, duplicate_fraction=0.03, newest_count=1,
                     seed=40 + int(miss_rate * 100))
    check(case, splits=1)
    check(case, splits=1, graph=True)


@pytest.mark.parametrize("splits", [2, 5, 17, 65])
def test_planner_waits_for_late_copiers(splits):
    """Copiers held back 30 us (variant build) look the entries up long after the planner reached its
    map update; they claimed their chunks before, so the planner must wait for them (a copier that
    looked after the update would take its misses for hits and copy nothing)."""
    case = make_case(3, 2048, 4096, 1152, miss_rate=0.4, duplicate_fraction=0.05, newest_fraction=0.01,
                     seed=30 + splits)
    check(case, splits=splits, module=variant(LATE_COPIERS))


def test_late_copiers_under_graph_replay():
    case = make_case(4, 1024, 2048, 656, miss_rate=0.3, duplicate_fraction=0.02, seed=35)
    check(case, splits=5, graph=True, module=variant(LATE_COPIERS))


def test_copiers_with_all_hits_and_small_odd_top_k():
    check(make_case(4, 2048, 4096, 656, miss_rate=0.0, seed=31), splits=5, module=variant(LATE_COPIERS))
    # 17 copiers over 100 entries: most copiers own no entry.
    check(make_case(3, 100, 256, 64, miss_rate=0.6, duplicate_fraction=0.1, seed=32), splits=17)
    check(make_case(3, 100, 256, 64, miss_rate=0.6, seed=33), splits=17, module=variant(LATE_COPIERS))


def test_splits_out_of_range_are_refused_by_name():
    from hisparse_sglang.ops.swap_in import MAX_SPLITS

    case = make_case(1, 512, 1024, 64, miss_rate=0.2, seed=34).clone(device="cuda", pin_host=True)
    limit = 127  # csrc/swap_in_config.h kMaxSplits: 1 + 2 claim words x 63 copiers
    assert MAX_SPLITS <= limit
    for splits in (0, limit + 1):
        with pytest.raises(ValueError, match=rf"swap_in: splits must be in \[1, {limit}\]; got {splits}"):
            cuda_ops().swap_in(*case.args(), splits=splits)


@pytest.mark.parametrize("offset", [-1, 0, 1])
def test_seq_len_around_buffer_size(offset):
    buffer_size = 1024
    case = make_case(4, 512, buffer_size, 656, seq_len=buffer_size + offset, miss_rate=0.3, seed=100 + offset)
    check(case)


@pytest.mark.parametrize("spread,old", [(1, 0.0), (3, 0.5), (400, 0.0)])
def test_lru_ties_and_spread_of_ages(spread, old):
    case = make_case(5, 1024, 2048, 656, miss_rate=0.4, stamp_spread=spread, old_stamp_fraction=old, seed=spread)
    check(case)


def test_ages_beyond_the_cap_and_stamps_ahead():
    case = make_case(3, 512, 1024, 64, miss_rate=0.5, seq_len=reference.AGE_CAP + 2000, stamp_spread=4000,
                     old_stamp_fraction=0.3, seed=12)
    case.slot_stamps[:, :50] = int(case.seq_lens[0]) + 7  # ahead of the request: age 0
    check(case)


def test_all_hits_copy_nothing():
    case = make_case(16, 2048, 4096, 1152, miss_rate=0.0, seed=5)
    (exp, exp_out, _), (act, out, counters) = run_both(case)
    assert int(counters[1]) == 0
    assert torch.equal(exp_out, out)
    assert torch.equal(act.device_kv.cpu(), case.device_kv)


def test_all_misses_with_duplicates_and_newest():
    case = make_case(6, 2048, 4096, 1152, miss_rate=1.0, duplicate_fraction=0.2, newest_fraction=0.05, seed=6)
    check(case)


def test_padded_rows_output_minus_one_and_touch_nothing():
    case = make_case(8, 1024, 2048, 1152, miss_rate=0.5, num_real=3, seed=7)
    exp_out = check(case)
    assert bool((exp_out[3:] == -1).all())


def test_empty_real_batch():
    case = make_case(4, 512, 1024, 64, miss_rate=0.5, num_real=0, seed=8)
    exp_out = check(case)
    assert bool((exp_out == -1).all())


def test_graph_replay_matches_reference():
    case = make_case(8, 2048, 4096, 1152, miss_rate=0.2, duplicate_fraction=0.02, seed=9)
    check(case, graph=True, splits=4)


def test_graph_replays_many_times_with_changing_inputs():
    """Capture once, replay over several steps whose inputs change in place (flags reset each time)."""
    ops = cuda_ops()
    base = make_case(4, 1024, 2048, 656, miss_rate=0.3, seed=10)
    gpu = base.clone(device="cuda", pin_host=True)
    ref = base.clone()
    out = torch.empty(tuple(base.top_k.shape), dtype=torch.int32, device="cuda")
    ops.reserve(4, 1024)
    ops.swap_in(*gpu.clone(device="cuda", pin_host=True).args(), out=out.clone(), splits=3)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.swap_in(*gpu.args(), out=out, splits=3)
    top_k = base.top_k.clone()
    for step in range(12):
        # Each step keeps most of the previous top-k (as a decode does), draws the rest anew and
        # advances every request by one token, so ages, ties and evictions change step by step.
        generator = torch.Generator().manual_seed(step)
        seq_len = int(base.seq_lens[0]) + step
        fresh = torch.randint(0, seq_len - 1, tuple(top_k.shape), generator=generator, dtype=torch.int32)
        keep = torch.rand(tuple(top_k.shape), generator=generator) < 0.8
        top_k = torch.where(keep & (top_k >= 0), top_k, fresh)
        for state in (ref, gpu):
            state.top_k.copy_(top_k)
            state.seq_lens.fill_(seq_len)
        expected = reference.swap_in(*ref.args())
        graph.replay()
        torch.cuda.synchronize()
        assert_same(f"out step {step}", expected, out)
        assert_same(f"slot_stamps step {step}", ref.slot_stamps, gpu.slot_stamps)
        assert_same(f"token_slot step {step}", ref.token_slot, gpu.token_slot)
        assert_same(f"device_kv step {step}", ref.device_kv, gpu.device_kv)


@pytest.mark.parametrize("row_bytes", [1152, 656, 64])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("max_blocks", [0, 1, 16])  # 0: the whole grid; the coordinator's background copies: 16
def test_copy_rows_every_layer_both_directions(row_bytes, index_dtype, max_blocks):
    ops = cuda_ops()
    layers = 5
    host = [torch.arange(300 * row_bytes, dtype=torch.int64).add(layer * 7).remainder(251).to(torch.uint8)
            .reshape(300, row_bytes).pin_memory() for layer in range(layers)]
    device = [torch.full((200, row_bytes), POISON, dtype=torch.uint8, device="cuda") for _ in range(layers)]
    src = torch.randperm(300)[:97]
    dst = torch.randperm(200)[:97]
    ops.copy_rows(host, device, src.to("cuda", index_dtype), dst.to("cuda", index_dtype), max_blocks=max_blocks)
    back = [torch.zeros((300, row_bytes), dtype=torch.uint8).pin_memory() for _ in range(layers)]
    ops.copy_rows(device, back, dst.to("cuda", index_dtype), src.to("cuda", index_dtype), max_blocks=max_blocks)
    torch.cuda.synchronize()
    for layer in range(layers):
        expected = torch.full((200, row_bytes), POISON, dtype=torch.uint8)
        expected[dst] = host[layer][src]
        assert_same(f"device layer {layer}", expected, device[layer])
        assert_same(f"host layer {layer}", host[layer][src], back[layer][src])


@pytest.mark.parametrize("row_bytes", [1152, 656, 64])
def test_copy_row_runs_matches_reference_both_directions(row_bytes):
    """Runs of rows (a 64-row page each, shorter ones, one row) of every layer by the copy engines, device -> host
    (staging) and back, equal to the reference twin's; nothing outside the runs is touched."""
    ops = cuda_ops()
    layers, host_rows, device_rows = 5, 600, 400
    device = [torch.arange(device_rows * row_bytes, dtype=torch.int64).add(layer * 11).remainder(253).to(torch.uint8)
              .reshape(device_rows, row_bytes).cuda() for layer in range(layers)]
    host = [torch.full((host_rows, row_bytes), POISON, dtype=torch.uint8).pin_memory() for _ in range(layers)]
    runs = torch.tensor([[64, 320, 64], [0, 0, 64], [300, 200, 37], [399, 599, 1], [130, 70, 5]], dtype=torch.int64)
    expected = [layer.clone() for layer in host]
    reference.copy_row_runs([layer.cpu() for layer in device], expected, runs)
    ops.copy_row_runs(device, host, runs)
    torch.cuda.synchronize()
    for layer in range(layers):
        assert_same(f"host layer {layer}", expected[layer], host[layer])
    back = [torch.full((device_rows, row_bytes), POISON, dtype=torch.uint8, device="cuda") for _ in range(layers)]
    swapped = runs[:, [1, 0, 2]].contiguous()
    ops.copy_row_runs(host, back, swapped)
    torch.cuda.synchronize()
    for layer in range(layers):
        want = torch.full((device_rows, row_bytes), POISON, dtype=torch.uint8)
        reference.copy_row_runs([expected[layer]], [want], swapped)
        assert_same(f"device layer {layer}", want, back[layer])


def test_copy_row_runs_refuses_a_run_outside_a_layer_by_name():
    ops = cuda_ops()
    device = [torch.zeros((16, 64), dtype=torch.uint8, device="cuda")]
    host = [torch.zeros((32, 64), dtype=torch.uint8).pin_memory()]
    for runs, text in (([[10, 0, 7]], r"run 0 \(first source row 10, first destination row 0, rows 7\)"),
                       ([[0, 0, 4], [0, 30, 3]], r"run 1 .*within 16 source and 32 destination rows"),
                       ([[0, 0, 0]], r"run 0 .*rows 0\) must be non-empty")):
        with pytest.raises(ValueError, match="copy_row_runs: " + text):
            ops.copy_row_runs(device, host, torch.tensor(runs))
        with pytest.raises(ValueError, match=text.split(" .*")[0]):
            reference.copy_row_runs([device[0].cpu()], [host[0].clone()], torch.tensor(runs))
    assert not host[0].any()  # nothing was copied by a refused call


def test_the_largest_buffer_that_fits_this_gpu_runs_and_matches_reference():
    """The plan at the device's shared-memory limit (14272 slots for top_k 2048 on sm_90) launches."""
    from hisparse_sglang.ops.swap_in_plan import largest_device_buffer_size, shared_memory_per_block

    largest = largest_device_buffer_size(2048, 64, 1024, shared_memory_per_block(torch.cuda.current_device()))
    case = make_case(2, 2048, largest, 1152, miss_rate=0.5, duplicate_fraction=0.02, seed=50)
    check(case, threads=1024)
    check(case, threads=1024, splits=1)


def raw_swap_in(case, plan_values, threads=1024):
    """The binding called directly, past the op's Python checks (as a caller that skips them would)."""
    from hisparse_sglang.ops.jit import load_module

    gpu = case.clone(device="cuda", pin_host=True)
    batch, top_k = case.top_k.shape
    *batch_args, tables = gpu.args()
    load_module().swap_in(
        *batch_args, *tables.tensors(), torch.empty((batch, top_k), dtype=torch.int32, device="cuda"),
        torch.empty(0, dtype=torch.int64, device="cuda"),
        torch.zeros(SYNC_COUNTERS_PER_ROW * batch, dtype=torch.int32, device="cuda"),
        torch.tensor(plan_values, dtype=torch.int64), 1, threads, torch.cuda.current_stream().cuda_stream,
    )


def fail_in_shared_memory_setup():
    from hisparse_sglang.ops.swap_in_plan import swap_in_plan

    case = make_case(1, 2048, 16384, 64, miss_rate=0.5, seed=51)
    with pytest.raises(RuntimeError) as info:
        raw_swap_in(case, swap_in_plan(2048, 16384, 1024).as_ints())
    return str(info.value), ["swap_in", "cudaFuncSetAttribute", str(swap_in_plan(2048, 16384, 1024).total_bytes)]


def fail_in_occupancy_query():
    from hisparse_sglang.ops.jit import load_module
    from hisparse_sglang.ops.swap_in_plan import swap_in_plan

    plan = torch.tensor(swap_in_plan(2048, 16384, 512).as_ints(), dtype=torch.int64)
    with pytest.raises(RuntimeError) as info:
        load_module().swap_in_occupancy(512, plan)
    return str(info.value), ["swap_in_occupancy", "512 threads"]


def fail_in_argument_check():
    case = make_case(1, 512, 1024, 64, miss_rate=0.5, seed=52).clone(device="cuda", pin_host=True)
    case.top_k = case.top_k.to(torch.int64)
    with pytest.raises(ValueError) as info:
        cuda_ops().swap_in(*case.args())
    return str(info.value), ["swap_in: top_k must be int32", "got int64 [1, 512]", "on cuda:"]


@pytest.mark.parametrize("fail", [fail_in_shared_memory_setup, fail_in_occupancy_query, fail_in_argument_check])
def test_a_failed_call_leaves_no_error_for_the_next_valid_call(fail):
    """Issue #18: after a refused launch the next valid launch in the same process failed with the
    stale 'invalid argument'. Every failure path clears CUDA's last error."""
    message, fragments = fail()
    assert all(fragment in message for fragment in fragments), message
    check(make_case(3, 1024, 2048, 656, miss_rate=0.3, seed=53), splits=2)
    rows = torch.arange(8, device="cuda")
    layers = [torch.zeros((16, 64), dtype=torch.uint8, device="cuda")]
    cuda_ops().copy_rows(layers, layers, rows, rows + 8)
    torch.cuda.synchronize()


def test_the_op_and_reserve_reject_a_shape_beyond_this_gpu_naming_the_key_and_the_fix():
    from hisparse_sglang.errors import HiSparseConfigError

    case = make_case(1, 2048, 14336, 64, miss_rate=0.5, seed=54).clone(device="cuda", pin_host=True)
    for call in (lambda: cuda_ops().swap_in(*case.args()), lambda: cuda_ops().reserve(4, 2048, 14336)):
        with pytest.raises(HiSparseConfigError) as info:
            call()
        assert "device_buffer_size (14336)" in str(info.value) and "device_buffer_size <= 14272" in str(info.value)
    check(make_case(2, 2048, 4096, 1152, miss_rate=0.2, seed=55))


def test_binding_errors_name_the_op_and_the_values():
    ops = cuda_ops()
    layers = [torch.zeros((16, 64), dtype=torch.uint8, device="cuda")]
    with pytest.raises(ValueError, match=r"copy_rows: src_rows must be int32/int64 on CUDA; got int64 \[4\] .* on cpu"):
        ops.copy_rows(layers, layers, torch.arange(4), torch.arange(4, device="cuda"))
    with pytest.raises(ValueError, match=r"bind_rows: plan must be a contiguous int64 \[3, n\].*got int64 \[2, 5\]"):
        empty = torch.zeros(0, dtype=torch.int64, device="cuda")
        ops.bind_rows(torch.zeros((2, 5), dtype=torch.int64, device="cuda"), empty, empty, *[
            torch.zeros(shape, dtype=torch.int32, device="cuda") for shape in ((9,), (4,), (1, 80))], 64, 16)
    with pytest.raises(ValueError, match=r"backup_newest: seq_lens must be a contiguous int32/int64 \[B\].*got int64 \[3\]"):
        ops.backup_newest(torch.zeros(2, dtype=torch.int64, device="cuda"), torch.zeros(3, dtype=torch.int64, device="cuda"),
                          *[torch.zeros(shape, dtype=torch.int32, device="cuda") for shape in ((1,), (4, 8), (9,))],
                          layers[0], torch.zeros((16, 64), dtype=torch.uint8).pin_memory())
