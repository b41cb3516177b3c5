"""The top-k workload model (testing/workload.py): calibration targets, indexer-shaped output, the
exact-LRU counter against the swap-in's reference, and the simulator driven by a workload.

Calibration targets (docs/workload.md): at a 32K prompt and top-k 2048 the ``calibrated`` profile
misses within 2 points of 30 / 13.4 / 6.7 % with exact-LRU buffers of k / 2k / 4k slots (HiSparse
paper, GLM-5.1), and its step-to-step persistence is 60 +- 5 %, read as the Jaccard similarity of
consecutive top-k sets: read as the overlap |T_t & T_t-1| / k it cannot be 60 % together with 30 %
misses at k slots, since a buffer of k slots holds the previous step's top-k, so misses >= 1 - overlap.
"""

from __future__ import annotations

import types

import pytest
import torch

from hisparse_sglang.config import HiSparseConfig
from hisparse_sglang.ops import reference
from hisparse_sglang.ops.tables import SwapInTables
from hisparse_sglang.testing.sim import SimulatedServer
from hisparse_sglang.testing.workload import (
    PROFILES,
    TopKWorkload,
    WorkloadParamError,
    WorkloadParams,
    lru_misses,
    main,
    measure,
    profile,
    request_key_from_tokens,
    step_overlap,
    verify_unions,
)

TOP_K = 2048
LRU_TARGETS = {TOP_K: 0.300, 2 * TOP_K: 0.134, 4 * TOP_K: 0.067}  # HiSparse paper, GLM-5.1
LRU_TOLERANCE = 0.02
PERSISTENCE_TARGET, PERSISTENCE_TOLERANCE = 0.60, 0.05  # GVR paper, as Jaccard (module docstring)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Small tensors: two OpenMP threads contending on two cores are many times slower than one."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def check_persistence(stats) -> None:
    assert abs(stats.jaccard - PERSISTENCE_TARGET) <= PERSISTENCE_TOLERANCE, (
        f"persistence (Jaccard of consecutive top-k) {stats.jaccard:.3f} is not within {PERSISTENCE_TOLERANCE} "
        f"of {PERSISTENCE_TARGET} (overlap {stats.overlap:.3f})"
    )


def check_lru(stats, slots: int) -> None:
    got, want = stats.lru_miss[slots], LRU_TARGETS[slots]
    assert abs(got - want) <= LRU_TOLERANCE, (
        f"exact-LRU miss rate with {slots} slots: {100 * got:.1f} %, target {100 * want:.1f} +- "
        f"{100 * LRU_TOLERANCE:.0f} points"
    )


def stats_of(params: WorkloadParams, steps: int = 128, requests: int = 2):
    return measure(TopKWorkload(params), requests=requests, layers=2, steps=steps, warmup=64)


@pytest.fixture(scope="module")
def calibrated_stats():
    params = PROFILES["calibrated"]
    assert (params.top_k, params.context_len) == (TOP_K, 32768)
    return stats_of(params)


# --------------------------------------------------------------------------------- calibration
def test_calibrated_persistence(calibrated_stats):
    check_persistence(calibrated_stats)
    # The parameter is the overlap the dwell times are solved for.
    assert abs(calibrated_stats.overlap - PROFILES["calibrated"].persistence) <= 0.01


@pytest.mark.parametrize("multiple", [1, 2, 4])
def test_calibrated_lru_miss_rates(calibrated_stats, multiple):
    check_lru(calibrated_stats, multiple * TOP_K)


@pytest.mark.parametrize(
    "overrides, failing",
    [
        # Far too little persistence: every check fails.
        ({"persistence": 0.3}, {"persistence", TOP_K, 2 * TOP_K, 4 * TOP_K}),
        # A flatter draw among the candidates: returns are rarer, so the larger buffers miss more,
        # while the k-slot buffer (which only ever holds the last step) stays on target.
        ({"topic_skew": 1.2}, {2 * TOP_K, 4 * TOP_K}),
        # Faster drift with a steeper draw: new candidates keep arriving, which the largest buffer
        # cannot hold, while the returns to recent candidates keep the 2k buffer on target.
        ({"drift": 0.04, "topic_skew": 2.6}, {4 * TOP_K}),
    ],
)
def test_calibration_checks_fail_on_misparameterised_profiles(overrides, failing):
    stats = stats_of(profile("calibrated", **overrides), steps=96, requests=1)
    checks = {"persistence": lambda: check_persistence(stats)}
    checks.update({slots: (lambda slots=slots: check_lru(stats, slots)) for slots in LRU_TARGETS})
    failed = set()
    for name, check in checks.items():
        try:
            check()
        except AssertionError:
            failed.add(name)
    assert failed == failing, f"{overrides}: failed {failed}, expected {failing} ({stats})"


def test_random_profile_hits_like_the_tiny_model():
    """Uniform picks: an LRU of D slots holds D of the n positions, hit rate ~ D / n (the tiny model
    with dummy weights: 22 % with 4096 slots at 16K)."""
    workload = TopKWorkload(PROFILES["random"])
    seq_lens = torch.arange(16385, 16385 + 48)
    rows = workload.stream(5, 16384, 0, seq_lens)
    hit = 1 - lru_misses(rows, seq_lens, 4096).miss_rate(start=16)
    assert abs(hit - 4096 / 16384) < 0.02, hit
    overlap, _ = step_overlap(rows)
    assert abs(float(overlap.mean()) - TOP_K / 16384) < 0.02


# --------------------------------------------------------------------------------- indexer shape
def generate(workload, keys, prompts, seq_lens, layer):
    as_tensor = lambda values: torch.tensor(values, dtype=torch.int64)  # noqa: E731
    return workload.topk(as_tensor(keys), as_tensor(prompts), as_tensor(seq_lens), layer)


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_rows_are_distinct_positions_in_range(name):
    workload = TopKWorkload(profile(name, context_len=9000))
    params = workload.params
    seq_lens = [2049, 2050, 5000, 9001, 9500, 40000, 130000]
    rows = generate(workload, list(range(7)), [2000, 2000, 4990, 9000, 9000, 39000, 129000], seq_lens, 3)
    assert rows.shape == (7, TOP_K) and rows.dtype == torch.int64
    for row, seq_len in zip(rows, seq_lens):
        assert torch.unique(row).numel() == TOP_K, "duplicate positions"
        assert int(row.min()) >= 0 and int(row.max()) < seq_len, "position out of range"
        if params.recent_window:
            assert seq_len - 1 in row.tolist(), "the newest token is not selected"
            assert set(range(seq_len - params.recent_window, seq_len)) <= set(row.tolist())
        assert set(range(params.sinks)) <= set(row.tolist())


@pytest.mark.parametrize("seq_len", [1, 2, 1000, TOP_K - 1, TOP_K])
def test_short_context_selects_everything_then_padding(seq_len):
    """seq_len <= top_k: what the indexer returns, 0 .. seq_len - 1 in order, then -1."""
    rows = generate(TopKWorkload(PROFILES["calibrated"]), [7], [max(seq_len - 1, 1)], [seq_len], 0)
    want = torch.full((TOP_K,), -1, dtype=torch.int64)
    want[:seq_len] = torch.arange(seq_len)
    assert torch.equal(rows[0], want)


def test_just_above_top_k_leaves_one_position_out():
    seq_len = TOP_K + 1
    row = generate(TopKWorkload(PROFILES["calibrated"]), [7], [TOP_K - 100], [seq_len], 0)[0]
    assert torch.unique(row).numel() == TOP_K and int(row.max()) < seq_len


def test_deterministic_and_independent_of_the_batch():
    params = profile("calibrated", seed=11)
    keys, prompts, seq_lens = [3, 9, 3, 12], [30000, 31000, 30000, 8000], [30100, 31007, 30100, 8200]
    batch = generate(TopKWorkload(params), keys, prompts, seq_lens, 5)
    again = generate(TopKWorkload(params), keys, prompts, seq_lens, 5)
    assert torch.equal(batch, again)
    assert torch.equal(batch[0], batch[2]), "the same request, layer and step must give the same row"
    alone = generate(TopKWorkload(params), [9], [31000], [31007], 5)
    assert torch.equal(alone[0], batch[1]), "a row must not depend on the rest of the batch"


def test_differs_per_request_layer_step_and_seed():
    workload = TopKWorkload(PROFILES["calibrated"])
    base = generate(workload, [1], [30000], [30100], 0)[0]

    def shared(other):
        return int(torch.isin(other, base).sum()) / TOP_K

    fixed = workload.params.sinks + workload.params.recent_window
    assert shared(generate(workload, [2], [30000], [30100], 0)[0]) < 0.2, "another request"
    assert shared(generate(workload, [1], [30000], [30100], 1)[0]) < 0.2, "another layer"
    assert shared(generate(TopKWorkload(profile("calibrated", seed=1)), [1], [30000], [30100], 0)[0]) < 0.2
    step = shared(generate(workload, [1], [30000], [30101], 0)[0])
    assert (fixed / TOP_K) < step < 1.0, "the next step keeps part of the selection and changes the rest"


def test_layers_tensor_and_int_agree():
    workload = TopKWorkload(PROFILES["high-locality"])
    by_int = generate(workload, [4, 5], [20000, 20000], [20010, 20020], 2)
    by_tensor = workload.topk(
        torch.tensor([4, 5]), torch.tensor([20000, 20000]), torch.tensor([20010, 20020]), torch.tensor([2, 2])
    )
    assert torch.equal(by_int, by_tensor)


def test_request_key_from_tokens():
    assert request_key_from_tokens([1, 2, 3]) == request_key_from_tokens(torch.tensor([1, 2, 3]))
    assert request_key_from_tokens([1, 2, 3]) != request_key_from_tokens([1, 2, 4])


@pytest.mark.parametrize(
    "changes",
    [
        {"top_k": 0},
        {"sinks": -1},
        {"sinks": 1000, "recent_window": 1048},
        {"persistence": 1.5},
        {"topic_size": 0},
        {"topic_skew": -1.0},
        {"drift": 2.0},
        {"seed": -1},
        {"context_len": 0},
        {"persistence": float("nan")},
        {"top_k": 2048.0},
    ],
)
def test_bad_parameters_raise_naming_the_value(changes):
    name = next(iter(changes))
    with pytest.raises(WorkloadParamError, match=name):
        WorkloadParams(**changes)


def test_unknown_profile_is_named():
    with pytest.raises(WorkloadParamError, match="unknown profile 'nope'"):
        profile("nope")


# --------------------------------------------------------------------------------- exact LRU
def swap_in_counts(
    rows: torch.Tensor, seq_lens: torch.Tensor, buffer_slots: int, page: int = 8
) -> list[tuple[int, int]]:
    """Per-step (lookups, misses) of ops/reference.py::swap_in for one offloaded request whose buffer
    starts empty (the counters the coordinator reports)."""
    steps, width = rows.shape
    context = int(seq_lens.max()) + 1
    tables = SwapInTables(
        req_to_token=torch.arange(1, context + 1, dtype=torch.int32).reshape(1, -1),
        device_row_of_loc=torch.cat(
            [torch.zeros(context + 1, dtype=torch.int32), torch.tensor([-1], dtype=torch.int32)]
        ),
        buffer_of_req=torch.zeros(1, dtype=torch.int32),
        slot_rows=torch.arange(buffer_slots + page, dtype=torch.int32).reshape(1, -1),
        slot_tokens=torch.full((1, buffer_slots), -1, dtype=torch.int32),
        slot_stamps=torch.zeros((1, buffer_slots), dtype=torch.int32),
        token_slot=torch.full((1, context + 1), -1, dtype=torch.int16),
        host_kv=torch.zeros((context + 1, 16), dtype=torch.uint8),
        device_kv=torch.zeros((buffer_slots + page, 16), dtype=torch.uint8),
    )
    counts, counters = [], torch.zeros(2, dtype=torch.int64)
    for step in range(steps):
        before = counters.clone()
        reference.swap_in(
            rows[step : step + 1].to(torch.int32),
            seq_lens[step : step + 1],
            torch.zeros(1, dtype=torch.int64),
            torch.ones(1, dtype=torch.int32),
            tables,
            counters=counters,
        )
        counts.append(tuple((counters - before).tolist()))
    return counts


@pytest.mark.parametrize("buffer_slots", [64, 96, 256])
def test_lru_counter_matches_the_swap_in_reference(buffer_slots):
    workload = TopKWorkload(
        WorkloadParams(
            top_k=64,
            context_len=700,
            sinks=2,
            recent_window=3,
            persistence=0.6,
            topic_size=8,
            topic_skew=1.5,
            drift=0.02,
            seed=4,
        )
    )
    seq_lens = torch.arange(701, 761)
    rows = workload.stream(3, 700, 1, seq_lens)
    # Duplicates, padding and out-of-range entries as the stress model makes them, in some rows.
    generator = torch.Generator().manual_seed(buffer_slots)
    messy = rows.clone()
    for step in range(0, 60, 3):
        messy[step, torch.randint(1, 64, (4,), generator=generator)] = int(messy[step, 0])
        messy[step, 5] = -1
        messy[step, 6] = int(seq_lens[step]) + 3
    for stream in (rows, messy):
        ours = lru_misses(stream, seq_lens, buffer_slots)
        want = swap_in_counts(stream, seq_lens, buffer_slots)
        assert list(zip(ours.lookups.tolist(), ours.misses.tolist())) == want


def test_lru_buffer_smaller_than_top_k_is_refused():
    with pytest.raises(WorkloadParamError, match="buffer_slots"):
        lru_misses(torch.zeros((1, 8), dtype=torch.int64), torch.tensor([20]), 4)


# --------------------------------------------------------------------------------- CLI and simulator
def test_cli_prints_a_row_per_context(capsys):
    assert (
        main(
            [
                "--profile",
                "random",
                "--context-len",
                "3000",
                "--requests",
                "1",
                "--layers",
                "1",
                "--steps",
                "4",
                "--warmup",
                "2",
                "--contexts",
                "3000,4000",
                "--persistence",
                "0.2",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert '"persistence": 0.2' in out and "| 3000 |" in out and "| 4000 |" in out


def test_cli_rejects_a_bad_parameter(capsys):
    with pytest.raises(SystemExit):
        main(["--profile", "calibrated", "--persistence", "1.5"])
    assert "persistence must be in [0, 1]" in capsys.readouterr().err


def small_server(workload, buffer_pages: int = 4, ops=reference) -> SimulatedServer:
    config = HiSparseConfig(
        top_k=32, device_buffer_size=8 * buffer_pages, page_size=8, host_to_device_ratio=4, resident_first=False
    )
    return SimulatedServer(
        config, layer_num=2, item_bytes=16, device_pages=40, max_reqs=4, max_context=400, workload=workload, ops=ops
    )


def test_simulator_runs_on_a_workload_and_verifies_rows():
    workload = TopKWorkload(profile("calibrated", top_k=32, context_len=200, recent_window=4, topic_size=8))
    server = small_server(workload)
    for prompt in (200, 150, 20):
        server.add_request(prompt, 30)
    lookups = misses = 0
    while server.requests:
        report = server.step()
        server.check_invariants()
        lookups += report.lookups
        misses += report.misses
    server.check_all_free()
    assert lookups and 0 < misses < lookups


def recording_ops(seen: list):
    def swap_in(top_k, *args, **kwargs):
        seen.append(top_k.clone())
        return reference.swap_in(top_k, *args, **kwargs)

    return types.SimpleNamespace(
        swap_in=swap_in,
        copy_rows=reference.copy_rows,
        copy_row_runs=reference.copy_row_runs,
        backup_newest=reference.backup_newest,
        bind_rows=reference.bind_rows,
    )


def test_simulator_top_k_stream_does_not_depend_on_the_buffer_size():
    """Two policies, one workload: every step's top-k is identical (rows differ, positions do not)."""
    workload = TopKWorkload(profile("low-locality", top_k=32, context_len=200, recent_window=2, topic_size=8))
    streams = []
    for buffer_pages in (4, 8):
        seen: list = []
        server = small_server(workload, buffer_pages, ops=recording_ops(seen))
        server.add_request(200, 12)
        server.add_request(180, 12)
        while server.requests:
            server.step()
        streams.append(seen)
    assert len(streams[0]) == len(streams[1]) > 0
    assert all(torch.equal(a, b) for a, b in zip(*streams))


def test_simulator_refuses_a_workload_of_another_top_k():
    config = HiSparseConfig(top_k=32, device_buffer_size=32, page_size=8, host_to_device_ratio=2)
    with pytest.raises(ValueError, match="workload top_k \\(2048\\) must equal the config's top_k \\(32\\)"):
        SimulatedServer(config, workload=TopKWorkload(PROFILES["calibrated"]))


# ------------------------------------------------------------------------ speculative verify positions
def test_verify_unions_count_distinct_tokens_of_consecutive_steps():
    rows = torch.tensor([[0, 1, 2, -1], [0, 1, 2, -1], [3, 4, 5, 6], [0, 3, 7, -1]])
    assert verify_unions(rows, 1).tolist() == [3, 3, 4, 3]
    assert verify_unions(rows, 2).tolist() == [3, 7, 6]  # padding is no token
    assert verify_unions(rows, 4).tolist() == [8]
    assert verify_unions(rows[:2], 3).numel() == 0
    with pytest.raises(ValueError, match="positions must be >= 1"):
        verify_unions(rows, 0)


def test_calibrated_verify_of_four_positions_fits_a_buffer_of_two_top_k_where_random_does_not():
    """The figure docs/speculative.md section 7 states: under ``calibrated`` four consecutive steps name at most
    ~3.5K distinct tokens (2 x top_k = 4096 slots hold them), under ``random`` ~6.9K (T x top_k is needed)."""
    calibrated = measure(TopKWorkload(profile("calibrated", context_len=16384)), requests=1, layers=2, steps=48,
                         warmup=8, verify_positions=(2, 4))
    random = measure(TopKWorkload(profile("random", context_len=16384)), requests=1, layers=2, steps=48, warmup=8,
                     verify_positions=(4,))
    median, largest = calibrated.verify_union[4]
    assert TOP_K < median <= largest <= 2 * TOP_K, calibrated.verify_union
    assert calibrated.verify_union[2][1] < largest
    assert 2 * TOP_K < random.verify_union[4][0] <= 4 * TOP_K, random.verify_union
    assert calibrated.as_dict()["verify_union"] == {"2": list(calibrated.verify_union[2]), "4": [median, largest]}


def test_cli_reports_verify_unions(capsys):
    assert main(["--profile", "high-locality", "--context-len", "8192", "--requests", "1", "--layers", "1",
                 "--steps", "16", "--warmup", "4", "--buffers", "1", "--verify-positions", "2"]) == 0
    assert "union of 2 steps, median / max" in capsys.readouterr().out
    assert main(["--profile", "high-locality", "--context-len", "8192", "--requests", "1", "--layers", "1",
                 "--steps", "3", "--warmup", "1", "--buffers", "1", "--verify-positions", "4"]) == 0
    assert capsys.readouterr().out.rstrip().split(" | ")[-2] == "–"  # fewer counted steps than T
    with pytest.raises(SystemExit):
        main(["--verify-positions", "0"])
