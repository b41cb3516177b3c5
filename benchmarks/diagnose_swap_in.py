"""Diagnostics for one benchmark cell: run ours (and SGLang's) once, check rows, print timings.

    python benchmarks/diagnose_swap_in.py --batch 128 --miss 5 [--sglang] [--reps 0]
Meant to run under compute-sanitizer or ncu.
"""

import argparse
import sys

import torch

sys.path.insert(0, "benchmarks")
import bench_swap_in as bench  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--miss", type=float, default=0)
    parser.add_argument("--row", type=int, default=1152)
    parser.add_argument("--sglang", action="store_true")
    parser.add_argument("--ours", action="store_true")
    parser.add_argument("--splits", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--calls", type=int, default=3)
    args = parser.parse_args()
    cell = bench.Cell(args.batch, args.miss / 100, args.row, seed=1, host_cache={})
    if args.ours or not args.sglang:
        for _ in range(args.calls):
            cell.reset_ours()
            cell.run_ours(args.splits, args.threads)
            torch.cuda.synchronize()
        cell.verify(cell.out)
        print(f"ours ok: batch {args.batch} miss {args.miss}% misses {cell.misses}", flush=True)
    if args.sglang:
        sys.path.insert(0, "benchmarks/baseline")
        import sglang_kernel

        kernel = sglang_kernel.load(args.row, bench.TOP_K, bench.BUFFER, 960)
        for _ in range(args.calls):
            cell.reset_sglang()
            cell.run_sglang(kernel)
            torch.cuda.synchronize()
        cell.verify(cell.sg_out)
        print("sglang ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
