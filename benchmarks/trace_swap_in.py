"""Phase timeline of the swap-in kernel for a few benchmark cells (diagnostics, GPU only).

Builds the kernels with -DHISPARSE_TRACE (a separate cache entry): thread 0 of batch row 0's CTAs
records the global timer at each phase mark and prints it when the CTA ends. Prints, per cell,
the median over calls of each mark in microseconds after the earliest CTA of that call started.

    python benchmarks/trace_swap_in.py --cells 1:5 1:20 8:20 [--splits N] [--calls 9]

Planner marks: 1 lookups done, 2 slot tables staged, 3 misses ranked, 4 victims chosen, 5 copiers
counted, 6 tables updated, 7 outputs published (or, with one CTA per request, rows copied).
Copier marks: 1 lookups done, 2 first rows staged, 3 plan seen, 4 rows written.
"""

import argparse
import os
import statistics
import sys
import tempfile

import torch

sys.path.insert(0, "benchmarks")
import bench_swap_in as bench  # noqa: E402
from hisparse_sglang.ops import jit  # noqa: E402
from hisparse_sglang.ops import swap_in as ours  # noqa: E402

PLANNER_MARKS = ["looked", "staged", "ranked", "victims", "copiers", "updated", "published"]
COPIER_MARKS = ["looked", "staged", "plan", "written"]


def traced_calls(cell: bench.Cell, splits, calls: int) -> str:
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
    """Median per mark over calls; a call is the group of lines between two planner lines."""
    lines = [line.split() for line in text.splitlines() if line.startswith("trace ")]
    calls: list[list[list[str]]] = []
    for fields in sorted(lines, key=lambda f: int(f[3])):
        if calls and int(fields[3]) - int(calls[-1][0][3]) < 200_000:  # within 200 us: same call
            calls[-1].append(fields)
        else:
            calls.append([fields])
    per_mark: dict[str, list[float]] = {}
    for group in calls:
        origin = min(int(f[3]) for f in group)
        for fields in group:
            role, part = fields[1], int(fields[2])
            offset = (int(fields[3]) - origin) / 1000
            names = PLANNER_MARKS if role == "plan" else COPIER_MARKS
            key_prefix = "plan" if role == "plan" else "copy"
            per_mark.setdefault(f"{key_prefix}.start", []).append(offset)
            for name, value in zip(names, fields[4:]):
                delta = int(value)
                if delta > 0:
                    per_mark.setdefault(f"{key_prefix}.{name}", []).append(offset + delta / 1000)
    return per_mark


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", nargs="+", default=["1:5", "1:20", "1:100", "8:20"], help="batch:miss%%")
    parser.add_argument("--row", type=int, default=1152)
    parser.add_argument("--splits", type=int, default=None)
    parser.add_argument("--calls", type=int, default=9)
    parser.add_argument("--define", nargs="*", default=[], metavar="NAME=VALUE", help="extra -D macros (variants)")
    args = parser.parse_args()
    jit._NVCC_FLAGS = (*jit._NVCC_FLAGS, "-DHISPARSE_TRACE", *(f"-D{d}" for d in args.define))
    for spec in args.cells:
        batch, miss = (float(x) for x in spec.split(":"))
        batch = int(batch)
        cell = bench.Cell(batch, miss / 100, args.row, seed=batch * 1000 + int(miss), host_cache={})
        splits = args.splits or ours.choose_splits(batch, bench.TOP_K, bench.BUFFER, ours.DEFAULT_THREADS,
                                                   torch.device("cuda"))
        marks = summarize(traced_calls(cell, args.splits, args.calls))
        print(f"cell batch {batch} miss {miss:g}% splits {splits} ({cell.misses} missed rows):")
        for key, values in marks.items():
            print(f"  {key:16s} median {statistics.median(values):7.2f} us  max {max(values):7.2f} us  (n={len(values)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
