"""The scheduler's host work per step from a torch-profiler trace with CPU activity and Python stacks.

SGLang's ``/start_profile`` with ``"activities": ["CPU"]`` (``with_stack`` on, SGLang's default) records every
Python call of the scheduler process (``python_function`` events), every aten op (``cpu_op``) and every CUDA
runtime call (``cuda_runtime``, ``cuda_driver``) over ``num_steps`` forward steps. Unlike py-spy's samples these
are counts and durations of each call, so two servers' steps can be compared call by call: which functions one
calls more often, or spends more time in, per step. The tracer's own cost is added to every Python call, so
durations rank the work; they do not time the untraced step.

:func:`summarize` reads one trace (the busiest thread holding the scheduler's event loop), :func:`compare` ranks
the differences of two summaries, :func:`render_comparison` prints them as a Markdown table, and :func:`cost_index`
asks whether one server runs the *same* work slower than another: the other's time per call of the calls both
make, weighted by the base's calls (1.0: the same speed; the plugin's own Python frames left out).
"""

from __future__ import annotations

import collections
import gzip
import json
import re
from pathlib import Path

__all__ = ["read_trace", "load_events", "summarize", "compare", "cost_index", "render_comparison", "origin"]

_CATEGORIES = ("python_function", "cpu_op", "cuda_runtime", "cuda_driver")
EVENT_LOOP = "event_loop"
# A C function bound to an object is named with the object's address, which differs between processes.
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def read_trace(trace_dir: Path) -> tuple[str, list[dict]]:
    """The name and every event of the first torch-profiler trace file SGLang wrote under ``trace_dir``
    (``*.json.gz`` before ``*.json``). Raises FileNotFoundError when there is none."""
    files = sorted(trace_dir.rglob("*.json.gz")) + sorted(trace_dir.rglob("*.json"))
    if not files:
        raise FileNotFoundError(f"no trace under {trace_dir}")
    opener = gzip.open if files[0].suffix == ".gz" else open
    with opener(files[0], "rt") as f:
        return files[0].name, json.load(f).get("traceEvents", [])


def load_events(trace_dir: Path) -> tuple[str, list[dict]]:
    """The complete (``ph == "X"``) host events of the first trace file under ``trace_dir`` and its name."""
    name, events = read_trace(trace_dir)
    return name, [e for e in events if e.get("ph") == "X" and e.get("cat") in _CATEGORIES]


def origin(name: str) -> str:
    """Which code a Python event's name belongs to: ``hisparse_sglang``, ``sglang``, ``torch``, ``builtin`` or
    ``other`` (the tracer names a function ``<file>(<line>): <function>``, a C function ``<built-in ...>``)."""
    if "hisparse_sglang" in name:
        return "hisparse_sglang"
    if "sglang/" in name or name.startswith("sglang"):
        return "sglang"
    if "torch/" in name or name.startswith("torch"):
        return "torch"
    if name.startswith("<built-in") or name.startswith("<method"):
        return "builtin"
    return "other"


def _scheduler_thread(events: list[dict]) -> object:
    """The thread whose Python events include the scheduler's event loop (the longest such event); without one,
    the thread with the most Python time."""
    loops = [e for e in events if e["cat"] == "python_function" and EVENT_LOOP in e["name"]]
    if loops:
        return max(loops, key=lambda e: float(e.get("dur", 0.0)))["tid"]
    time_of: collections.Counter = collections.Counter()
    for e in events:
        if e["cat"] == "python_function":
            time_of[e["tid"]] += float(e.get("dur", 0.0))
    if not time_of:
        raise ValueError("no python_function events in the trace: was it recorded with_stack and CPU activity?")
    return time_of.most_common(1)[0][0]


def _self_times(intervals: list[tuple[float, float, str]]) -> collections.Counter:
    """Self time per name of properly nested ``(start, end, name)`` intervals of one thread: each interval's
    duration less its direct children's."""
    self_time: collections.Counter = collections.Counter()
    stack: list[list] = []  # [end, name, children's time]
    for start, end, name in sorted(intervals, key=lambda i: (i[0], -i[1])):
        while stack and stack[-1][0] <= start:
            _, done_name, children = stack.pop()
            self_time[done_name] -= children
        if stack:
            stack[-1][2] += end - start
        self_time[name] += end - start
        stack.append([end, name, 0.0])
    while stack:
        _, done_name, children = stack.pop()
        self_time[done_name] -= children
    return self_time


def summarize(events: list[dict], steps: int) -> dict:
    """Per step on the scheduler's thread: calls and inclusive / self microseconds of every Python function,
    calls and microseconds of every aten op and CUDA runtime call, and the Python self time by origin."""
    if steps <= 0:
        raise ValueError(f"steps must be positive, got {steps}")
    tid = _scheduler_thread(events)
    mine = [e for e in events if e["tid"] == tid]
    calls: collections.Counter = collections.Counter()
    inclusive: collections.Counter = collections.Counter()
    intervals = []
    ops: collections.Counter = collections.Counter()
    op_us: collections.Counter = collections.Counter()
    for e in mine:
        dur = float(e.get("dur", 0.0))
        if e["cat"] == "python_function":
            name = _ADDRESS.sub("", e["name"])
            calls[name] += 1
            inclusive[name] += dur
            start = float(e["ts"])
            intervals.append((start, start + dur, name))
        else:
            key = f"{e['cat']}: {e['name']}"
            ops[key] += 1
            op_us[key] += dur
    self_time = _self_times(intervals)
    by_origin: collections.Counter = collections.Counter()
    for name, us in self_time.items():
        by_origin[origin(name)] += us
    per = 1.0 / steps
    return {
        "steps": steps,
        "thread": str(tid),
        "functions": {name: {"calls": round(calls[name] * per, 3), "incl_us": round(inclusive[name] * per, 2),
                             "self_us": round(self_time[name] * per, 2)} for name in calls},
        "ops": {name: {"calls": round(ops[name] * per, 3), "us": round(op_us[name] * per, 2)} for name in ops},
        "self_us_by_origin": {k: round(v * per, 1) for k, v in by_origin.most_common()},
        "python_calls_per_step": round(sum(calls.values()) * per, 1),
    }


def compare(base: dict, other: dict, top: int = 40) -> dict:
    """The functions and ops whose per-step self time (ops: time) differs most between two summaries, ``other``
    minus ``base``, with the calls of each; and the totals by origin."""
    def ranked(a: dict, b: dict, key: str) -> list[dict]:
        rows = []
        for name in set(a) | set(b):
            ra, rb = a.get(name, {}), b.get(name, {})
            rows.append({"name": name, "calls": [ra.get("calls", 0), rb.get("calls", 0)],
                         "us": [ra.get(key, 0.0), rb.get(key, 0.0)],
                         "diff_us": round(rb.get(key, 0.0) - ra.get(key, 0.0), 2)})
        rows.sort(key=lambda r: -abs(r["diff_us"]))
        return rows[:top]

    origins = sorted(set(base["self_us_by_origin"]) | set(other["self_us_by_origin"]))
    return {
        "functions": ranked(base["functions"], other["functions"], "self_us"),
        "calls": sorted(
            ({"name": n, "calls": [base["functions"].get(n, {}).get("calls", 0), other["functions"].get(n, {}).get("calls", 0)]}
             for n in set(base["functions"]) | set(other["functions"])),
            key=lambda r: -abs(r["calls"][1] - r["calls"][0]))[:top],
        "ops": ranked(base["ops"], other["ops"], "us"),
        "by_origin": {k: [base["self_us_by_origin"].get(k, 0.0), other["self_us_by_origin"].get(k, 0.0)] for k in origins},
        "python_calls_per_step": [base["python_calls_per_step"], other["python_calls_per_step"]],
    }


def render_comparison(names: tuple[str, str], diff: dict, rows: int = 30) -> str:
    """Markdown of :func:`compare`'s result for the servers ``names`` (base, other)."""
    a, b = names
    lines = [f"Host work per step on the scheduler's thread, {b} against {a} (torch profiler, Python tracer on: "
             f"durations inflated by the tracer, calls exact). Python calls per step: "
             f"{diff['python_calls_per_step'][0]} / {diff['python_calls_per_step'][1]}.", "",
             f"| origin | {a} self us/step | {b} self us/step |", "|---|---|---|"]
    lines += [f"| {k} | {v[0]} | {v[1]} |" for k, v in diff["by_origin"].items()]
    lines += ["", f"| function | calls/step {a} / {b} | self us/step {a} / {b} | difference |", "|---|---|---|---|"]
    lines += [f"| `{r['name'][:110]}` | {r['calls'][0]} / {r['calls'][1]} | {r['us'][0]} / {r['us'][1]} | "
              f"{r['diff_us']:+} |" for r in diff["functions"][:rows]]
    lines += ["", f"| op | calls/step {a} / {b} | us/step {a} / {b} | difference |", "|---|---|---|---|"]
    lines += [f"| `{r['name'][:110]}` | {r['calls'][0]} / {r['calls'][1]} | {r['us'][0]} / {r['us'][1]} | "
              f"{r['diff_us']:+} |" for r in diff["ops"][:rows]]
    return "\n".join(lines) + "\n"


def cost_index(base: dict, other: dict) -> dict:
    """How long ``other``'s process takes for the calls both servers make, relative to ``base``: for ``ops``
    (aten ops and CUDA runtime calls) and for ``python`` (self time of the Python functions outside
    hisparse_sglang), the sum over the names both have of ``base`` calls x ``other``'s time per call, over the same
    sum at ``base``'s time per call. Above 1: the same work runs slower in ``other`` (its process or its
    minute), whatever the work it adds; the count of names compared comes with each."""
    def index(a: dict, b: dict, key: str, keep) -> dict:
        num = den = 0.0
        names = 0
        for name, ra in a.items():
            rb = b.get(name)
            if not keep(name) or rb is None or not ra["calls"] or not rb["calls"] or ra[key] <= 0 or rb[key] <= 0:
                continue
            num += ra["calls"] * rb[key] / rb["calls"]
            den += ra[key]
            names += 1
        return {"index": round(num / den, 4) if den else None, "names": names}

    return {"ops": index(base["ops"], other["ops"], "us", lambda name: True),
            "python": index(base["functions"], other["functions"], "self_us",
                            lambda name: origin(name) != "hisparse_sglang")}
