"""benchmarks/e2e/host_trace.py: the scheduler's host work per step from a torch-profiler trace with Python
stacks, and the call-by-call comparison of two servers (profile_decode.py --host-steps)."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest

E2E = Path(__file__).resolve().parents[1] / "benchmarks" / "e2e"
sys.path.insert(0, str(E2E))

import host_trace  # noqa: E402

LOOP = "sglang/srt/managers/scheduler.py(1200): event_loop_overlap"
RUN = "sglang/srt/managers/scheduler.py(2400): run_batch"
PREPARE = "hisparse_sglang/coordinator/speculative.py(240): prepare"


def py(tid, ts, dur, name):
    return {"ph": "X", "cat": "python_function", "tid": tid, "ts": ts, "dur": dur, "name": name}


def op(tid, ts, dur, name, cat="cpu_op"):
    return {"ph": "X", "cat": cat, "tid": tid, "ts": ts, "dur": dur, "name": name}


def steps_trace(with_plugin: bool, steps: int = 2) -> list[dict]:
    """``steps`` scheduler steps on thread 7: the loop holds run_batch (10 us, an aten op inside), and with the
    plugin a 3-us prepare inside run_batch; thread 9 runs a longer Python function of its own."""
    events = [py(7, 0, 100 * steps, LOOP), py(9, 0, 10_000, "threading.py(1010): run")]
    for s in range(steps):
        base = 100 * s + 10
        events.append(py(7, base, 10, RUN))
        events.append(op(7, base + 1, 2, "aten::fill_"))
        events.append(op(7, base + 4, 1, "cudaLaunchKernel", cat="cuda_runtime"))
        if with_plugin:
            events.append(py(7, base + 5, 3, PREPARE))
    return events


def test_self_time_is_the_duration_less_the_direct_children():
    summary = host_trace.summarize(steps_trace(with_plugin=True), steps=2)
    functions = summary["functions"]
    assert summary["thread"] == "7"  # the event loop's thread, not the busier other one
    assert functions[RUN] == {"calls": 1.0, "incl_us": 10.0, "self_us": 7.0}
    assert functions[PREPARE] == {"calls": 1.0, "incl_us": 3.0, "self_us": 3.0}
    assert functions[LOOP]["self_us"] == 90.0  # 200 us over 2 steps, less run_batch's 10 per step
    assert summary["ops"]["cpu_op: aten::fill_"] == {"calls": 1.0, "us": 2.0}
    assert summary["self_us_by_origin"] == {"sglang": 97.0, "hisparse_sglang": 3.0}


def test_functions_bound_to_objects_are_one_name_whatever_their_address():
    bound = "<built-in method fill_ of Tensor object at 0x7f1f09a27970>"
    events = [py(7, 0, 20, LOOP), py(7, 1, 2, bound), py(7, 5, 2, bound.replace("27970", "28a10"))]
    functions = host_trace.summarize(events, steps=1)["functions"]
    assert functions["<built-in method fill_ of Tensor object>"]["calls"] == 2


def test_compare_ranks_what_the_other_server_adds_per_step():
    base = host_trace.summarize(steps_trace(with_plugin=False), steps=2)
    other = host_trace.summarize(steps_trace(with_plugin=True), steps=2)
    diff = host_trace.compare(base, other)
    by_name = {row["name"]: row for row in diff["functions"]}
    assert by_name[PREPARE] == {"name": PREPARE, "calls": [0, 1.0], "us": [0.0, 3.0], "diff_us": 3.0}
    assert by_name[RUN]["diff_us"] == -3.0  # its self time gave the plugin's call its 3 us
    assert diff["calls"][0]["name"] == PREPARE
    assert diff["by_origin"]["hisparse_sglang"] == [0.0, 3.0]
    text = host_trace.render_comparison(("a+mtp", "c+mtp"), diff)
    assert f"| `{PREPARE}` | 0 / 1.0 | 0.0 / 3.0 | +3.0 |" in text


def test_load_reads_a_compressed_trace_and_keeps_complete_host_events(tmp_path):
    events = steps_trace(with_plugin=True) + [{"ph": "X", "cat": "kernel", "tid": 1, "ts": 0, "dur": 5, "name": "k"},
                                              {"ph": "i", "cat": "python_function", "tid": 7, "ts": 0, "name": "x"}]
    (tmp_path / "rank0").mkdir()
    with gzip.open(tmp_path / "rank0" / "t.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    name, loaded = host_trace.load_events(tmp_path)
    assert name == "t.trace.json.gz"
    assert len(loaded) == len(steps_trace(with_plugin=True))
    with pytest.raises(FileNotFoundError):
        host_trace.load_events(tmp_path / "rank0" / "none")


def test_a_trace_without_python_events_is_refused():
    with pytest.raises(ValueError, match="with_stack"):
        host_trace.summarize([op(7, 0, 1, "aten::add")], steps=1)
    with pytest.raises(ValueError, match="positive"):
        host_trace.summarize(steps_trace(with_plugin=False), steps=0)


def test_the_cost_index_compares_the_same_calls_whatever_the_other_server_adds():
    base = host_trace.summarize(steps_trace(with_plugin=False), steps=2)
    other = host_trace.summarize(steps_trace(with_plugin=True), steps=2)
    # The plugin's prepare is left out; run_batch's self time per call fell from 10 to 7 us (the plugin's call
    # inside it): the Python index weighs the loop's 90 and run_batch's 7 against 90 and 10.
    index = host_trace.cost_index(base, other)
    assert index["ops"] == {"index": 1.0, "names": 2}
    assert index["python"] == {"index": round(97 / 100, 4), "names": 2}
    slower = [dict(e, dur=e["dur"] * 1.1) if e["cat"] != "python_function" else e
              for e in steps_trace(with_plugin=True)]
    assert host_trace.cost_index(base, host_trace.summarize(slower, steps=2))["ops"]["index"] == 1.1


def test_paired_rounds_report_the_spread_of_each_arms_cost_index():
    import paired_decode

    def round_with(index):
        return {"host": {"a+mtp": {"python_calls_per_step": 1.0},
                         "c+mtp": {"cost_index": {"ops": {"index": index, "names": 3},
                                                  "python": {"index": index + 0.1, "names": 5}}}}}

    rounds = [round_with(1.0), round_with(1.2), {"host": {"c+mtp": {"error": "no trace"}}}, round_with(1.1)]
    spread = paired_decode.host_indices(["a+mtp", "c+mtp"], rounds)["c+mtp"]
    assert spread["ops"]["median"] == 1.1 and spread["ops"]["n"] == 3
    assert spread["python"]["median"] == 1.2
