"""``diagnose``: one benchmark cell, run a few times by ours (and SGLang's), rows checked.

    python benchmarks/bench_swap_in.py diagnose --batch 128 --miss 5 [--sglang] [--calls 3]

Meant to run under compute-sanitizer or ncu.
"""

from __future__ import annotations

import torch

from hisparse_sglang.ops import jit
from swap_in.cells import Cell, load_sglang


def run(args) -> int:
    module = jit.load_module(tuple(args.define)) if args.define else None
    cell = Cell(args.batch, args.miss / 100, args.row, seed=1, host_cache={}, module=module)
    if args.ours or not args.sglang:
        for _ in range(args.calls):
            cell.reset_ours()
            cell.run_ours(args.splits, args.threads)
            torch.cuda.synchronize()
        cell.verify(cell.out)
        print(f"ours ok: batch {args.batch} miss {args.miss}% misses {cell.misses}", flush=True)
    if args.sglang:
        kernel = load_sglang(args.row)
        for _ in range(args.calls):
            cell.reset_sglang()
            cell.run_sglang(kernel)
            torch.cuda.synchronize()
        cell.verify(cell.sg_out)
        print("sglang ok", flush=True)
    return 0
