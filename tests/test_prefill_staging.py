"""Prefill staging by the copy engines (coordinator/staging.py): the runs of rows, the two phases, the
fallback to ``copy_rows``, and a request that ends or is demoted before its copy was enqueued."""

from __future__ import annotations

import pytest
import torch

from hisparse_sglang.config import HiSparseConfig
from hisparse_sglang.coordinator import staging
from hisparse_sglang.coordinator.staging import row_runs
from hisparse_sglang.ops.reference import copy_row_runs
from hisparse_sglang.testing.sim import SimulatedServer, token_rows


def test_runs_are_where_both_rows_advance_by_one():
    src = torch.tensor([8, 9, 10, 11, 40, 41, 3, 4], dtype=torch.int64)
    dst = torch.tensor([0, 1, 2, 3, 4, 5, 6, 9], dtype=torch.int64)
    assert row_runs(src, dst).tolist() == [[8, 0, 4], [40, 4, 2], [3, 6, 1], [4, 9, 1]]
    assert row_runs(torch.tensor([5]), torch.tensor([7])).tolist() == [[5, 7, 1]]
    same = torch.arange(100, 164, dtype=torch.int64)
    assert row_runs(same, same - 100).tolist() == [[100, 0, 64]]


def test_each_run_is_copied_in_every_layer_and_nothing_else():
    src = [torch.arange(64, dtype=torch.int32).reshape(16, 4) + 1000 * layer for layer in range(3)]
    dst = [torch.zeros(16, 4, dtype=torch.int32) for _ in range(3)]
    copy_row_runs(src, dst, torch.tensor([[2, 10, 3], [0, 0, 1]]))
    for layer in range(3):
        want = torch.zeros(16, 4, dtype=torch.int32)
        want[10:13] = src[layer][2:5]
        want[0] = src[layer][0]
        assert torch.equal(dst[layer], want)


@pytest.mark.parametrize("runs,text", [
    ([[10, 0, 7]], r"run 0 \(first source row 10, first destination row 0, rows 7\) must be non-empty and within 16"),
    ([[0, 0, 4], [0, 14, 3]], r"run 1 .* within 16 source and 16 destination rows"),
    ([[0, 0, 0]], r"run 0 .*rows 0\) must be non-empty"),
    ([[-1, 0, 2]], r"run 0 \(first source row -1"),
])
def test_a_run_outside_a_layer_is_refused_by_name_before_any_copy(runs, text):
    src = [torch.ones(16, 4, dtype=torch.int32) for _ in range(2)]
    dst = [torch.zeros(16, 4, dtype=torch.int32) for _ in range(2)]
    with pytest.raises(ValueError, match=text):
        copy_row_runs(src, dst, torch.tensor(runs))
    assert not any(layer.any() for layer in dst)
    with pytest.raises(ValueError, match=r"runs must be int64 \[R, 3\]"):
        copy_row_runs(src, dst, torch.tensor([1, 2, 3]))


def server(delay: int) -> SimulatedServer:
    config = HiSparseConfig(top_k=8, device_buffer_size=16, page_size=4)
    return SimulatedServer(config, layer_num=3, device_pages=64, cpu_event_delay_steps=delay)


def host_rows_hold_the_prompt(sim: SimulatedServer, uid: int, prompt_len: int) -> bool:
    slot = sim.requests[uid].slot
    locs = sim.req_to_token[slot, :prompt_len].to(torch.int64)
    return all(
        torch.equal(layer[locs], token_rows(uid, torch.arange(prompt_len), layer_id, sim.item_bytes))
        for layer_id, layer in enumerate(sim.host_pool.layers)
    )


def test_the_copy_is_enqueued_once_the_rows_reached_the_host_and_only_then_reports_done():
    sim = server(delay=2)
    uid = sim.add_request(40, 8)
    record = sim.coordinator.requests[sim.requests[uid].slot]
    plans = sim.coordinator.prefill_staging
    assert plans.unstaged_len(record.slot) == 40 and not host_rows_hold_the_prompt(sim, uid, 40)
    assert not record.staging.query()
    sim.step()
    sim.step()  # the rows arrived two steps after the prefill: enqueued in this step's prepare
    assert plans.unstaged_len(record.slot) == 0 and host_rows_hold_the_prompt(sim, uid, 40)
    assert (plans.by_dma, plans.by_kernel) == (1, 0)
    assert not record.staging.query()  # enqueued, not yet done (a CPU copy reports done two steps later)
    sim.step()
    sim.step()
    assert record.staging.query()
    sim.check_invariants()


def test_a_request_with_a_row_off_the_gpu_is_copied_by_copy_rows(row_off_the_gpu):
    sim = server(delay=0)
    uid = sim.add_request(40, 8)
    plans = sim.coordinator.prefill_staging
    assert (plans.by_dma, plans.by_kernel) == (0, 1) and host_rows_hold_the_prompt(sim, uid, 40)


def one_row_per_run(src_rows, dst_rows):
    """Every row a run of its own (every page handed out of order, at one row per page)."""
    return torch.stack([src_rows, dst_rows, torch.ones_like(src_rows)], dim=1)


def chunked_server(monkeypatch, calls: list) -> SimulatedServer:
    """3 layers, at most 30 copies in flight (10 runs), a prompt of 40 one-row runs: 4 chunks; each chunk's copy
    is done two steps after it was enqueued. ``calls``: (copies in flight before, runs) per copy_row_runs."""
    from hisparse_sglang.ops import reference

    monkeypatch.setattr(staging, "DMA_MAX_OUTSTANDING", 30)
    monkeypatch.setattr(staging, "row_runs", one_row_per_run)
    sim = server(delay=2)
    copy = reference.copy_row_runs

    def recording(src, dst, runs):
        calls.append((sim.coordinator.prefill_staging.outstanding(), runs.shape[0]))
        copy(src, dst, runs)

    monkeypatch.setattr(reference, "copy_row_runs", recording)
    return sim


def test_a_request_of_many_runs_is_enqueued_a_chunk_at_a_time_within_the_bound(monkeypatch):
    calls: list = []
    sim = chunked_server(monkeypatch, calls)
    uid = sim.add_request(40, 30)
    record = sim.coordinator.requests[sim.requests[uid].slot]
    plans = sim.coordinator.prefill_staging
    for _ in range(16):
        sim.step()
        sim.check_invariants()
        if len(calls) < 4:
            assert plans.unstaged_len(record.slot) == 40 and not record.staging.query()
    assert [runs for _, runs in calls] == [10, 10, 10, 10]
    assert all(before + 3 * runs <= 30 for before, runs in calls), calls
    assert (plans.by_dma, plans.by_kernel, plans.waiting()) == (1, 0, 0)
    assert record.staging.query() and host_rows_hold_the_prompt(sim, uid, 40)


def test_a_request_that_ends_mid_copy_enqueues_no_more_and_leaks_nothing(monkeypatch):
    calls: list = []
    sim = chunked_server(monkeypatch, calls)
    uid = sim.add_request(40, 30)
    slot = sim.requests[uid].slot
    staged = sim.coordinator.requests[slot].staging
    while not calls:
        sim.step()
    sim.abort(uid)
    # The free of its rows waited for the chunk that was enqueued: the copy's event is that chunk's.
    assert staged.enqueued is not None and sim.coordinator.prefill_staging.waiting() == 0
    for _ in range(8):
        sim.step()
    assert len(calls) == 1
    sim.check_all_free()
    assert sim.coordinator.prefill_staging.unstaged_len(slot) == 0


def test_waiting_for_a_copy_mid_way_enqueues_the_rest_at_once(monkeypatch):
    calls: list = []
    sim = chunked_server(monkeypatch, calls)
    uid = sim.add_request(40, 30)
    record = sim.coordinator.requests[sim.requests[uid].slot]
    while not calls:
        sim.step()
    record.staging.synchronize()  # as a demotion of the request orders itself after the copy
    assert [runs for _, runs in calls] == [10, 30]
    assert host_rows_hold_the_prompt(sim, uid, 40)


def test_a_request_that_ends_before_its_copy_was_enqueued_is_never_copied():
    sim = server(delay=2)
    uid = sim.add_request(40, 8)
    slot = sim.requests[uid].slot
    sim.abort(uid)
    assert sim.coordinator.prefill_staging.unstaged_len(slot) == 0
    for _ in range(4):
        sim.step()
    assert sim.coordinator.prefill_staging.by_dma == 0 and sim.coordinator.prefill_staging.by_kernel == 0
    sim.check_all_free()


@pytest.mark.parametrize("wait", ["wait_on_current_stream", "synchronize"])
def test_waiting_for_a_copy_not_yet_enqueued_enqueues_it(wait):
    sim = server(delay=2)
    uid = sim.add_request(40, 8)
    record = sim.coordinator.requests[sim.requests[uid].slot]
    getattr(record.staging, wait)()  # as a demotion of the fresh request orders itself after the copy
    assert host_rows_hold_the_prompt(sim, uid, 40)
    assert sim.coordinator.prefill_staging.unstaged_len(record.slot) == 0


def test_the_counts_reach_the_stats_and_the_harness_reads_them_from_the_log_line():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "e2e"))
    import logs

    sim = server(delay=0)
    sim.add_request(40, 8)
    stats = sim.coordinator.stats()
    assert (stats.prefills_staged_by_dma, stats.prefills_staged_by_kernel) == (1, 0)
    text = ("HiSparse: hit rate n/a, moved 0.0 MiB, resident 1, offloaded 0 (promoting 0), step host work 0.011 ms "
            "(max 0.14), prefills staged by DMA 1, by kernel 0\n"
            "HiSparse: hit rate n/a, moved 0.0 MiB, resident 2, offloaded 0 (promoting 0), step host work 0.011 ms "
            "(max 0.14), prefills staged by DMA 3, by kernel 2\n")
    summary = logs.summarize_hisparse(text)
    assert (summary["staged_by_dma"], summary["staged_by_kernel"]) == (3, 2)
