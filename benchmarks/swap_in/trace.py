"""``trace``: phase timeline of the swap-in kernel for a few benchmark cells (diagnostics, GPU only).

Builds the kernels with -DHISPARSE_TRACE (``jit.load_module(defines=...)``: a separate cache entry,
used by these calls only): thread 0 of batch row 0's CTAs records the global timer at each phase
mark and prints it when the CTA ends. Prints, per cell, the median over calls of each mark in
microseconds after the earliest CTA of that call started.

    python benchmarks/bench_swap_in.py trace --cells 1:5 1:20 8:20 [--splits N] [--calls 9]

Planner marks: 1 lookups done, 2 slot tables staged, 3 misses ranked, 4 victims chosen, 5 copiers
counted, 6 tables updated, 7 outputs published (or, with one CTA per request, rows copied).
Copier marks: 1 lookups done, 2 first rows staged, 3 plan seen, 4 rows written.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile

import torch

from hisparse_sglang.ops import jit
from swap_in.cells import Cell, cell_seed

PLANNER_MARKS = ["looked", "staged", "ranked", "victims", "copiers", "updated", "published"]
COPIER_MARKS = ["looked", "staged", "plan", "written"]
SAME_CALL_NS = 200_000  # trace lines whose CTAs started within 200 us of the call's first belong to it


def traced_calls(cell: Cell, splits, calls: int) -> str:
    """Run the cell `calls` times with stdout (where device printf lands) sent to a file."""
    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 1)
        try:
            for _ in range(calls):
                cell.reset_ours()
                torch.cuda.synchronize()
                cell.run_ours(splits)
                torch.cuda.synchronize()
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
        sink.seek(0)
        return sink.read().decode()


def summarize(text: str) -> dict[str, list[float]]:
    """Median per mark over calls; a call is the group of lines between two planner lines.

    ``text``: the kernel's printf output, lines ``trace plan|copy <part> <start ns> <mark deltas ns>...``
    (a delta of 0 or less: mark not reached). Returns, per ``plan.<mark>`` / ``copy.<mark>`` (and
    ``.start``), the µs after the earliest CTA start of the call, one value per CTA and call.
    """
    lines = [line.split() for line in text.splitlines() if line.startswith("trace ")]
    calls: list[list[list[str]]] = []
    for fields in sorted(lines, key=lambda f: int(f[3])):
        if calls and int(fields[3]) - int(calls[-1][0][3]) < SAME_CALL_NS:
            calls[-1].append(fields)
        else:
            calls.append([fields])
    per_mark: dict[str, list[float]] = {}
    for group in calls:
        origin = min(int(f[3]) for f in group)
        for fields in group:
            role = fields[1]
            offset = (int(fields[3]) - origin) / 1000
            names = PLANNER_MARKS if role == "plan" else COPIER_MARKS
            key_prefix = "plan" if role == "plan" else "copy"
            per_mark.setdefault(f"{key_prefix}.start", []).append(offset)
            for name, value in zip(names, fields[4:]):
                delta = int(value)
                if delta > 0:
                    per_mark.setdefault(f"{key_prefix}.{name}", []).append(offset + delta / 1000)
    return per_mark


def format_marks(marks: dict[str, list[float]]) -> list[str]:
    """One line per mark: median and max µs and how many CTA-calls reached it."""
    return [
        f"  {key:16s} median {statistics.median(values):7.2f} us  max {max(values):7.2f} us  (n={len(values)})"
        for key, values in marks.items()
    ]


def run(args) -> int:
    module = jit.load_module(("HISPARSE_TRACE", *args.define))
    for batch, miss in args.cells:
        cell = Cell(batch, miss / 100, args.row, seed=cell_seed(batch, miss), host_cache={}, module=module)
        splits = args.splits or cell.default_splits()
        marks = summarize(traced_calls(cell, args.splits, args.calls))
        print(f"cell batch {batch} miss {miss:g}% splits {splits} ({cell.misses} missed rows):")
        for line in format_marks(marks):
            print(line)
    return 0
