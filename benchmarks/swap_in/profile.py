"""``profile``: one swap-in call per cell for Nsight Compute (GPU only): warm-up calls, then the profiled one.

    ncu --clock-control none --launch-skip 5 --launch-count 1 -k regex:swap_in_kernel \\
        --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \\
        python benchmarks/bench_swap_in.py profile 128 0

Arguments: batch, miss percent, optional splits (default: choose_splits). Six calls in all, each
after a GPU-side spin as in the benchmark's timing, so ``--launch-skip 5`` profiles the last.
"""

from __future__ import annotations

import torch

from hisparse_sglang.ops import jit
from swap_in.cells import Cell, cell_seed
from swap_in.timing import SPIN_CYCLES

CALLS = 6


def run(args) -> int:
    module = jit.load_module(tuple(args.define)) if args.define else None
    cell = Cell(args.batch, args.miss / 100, args.row, seed=cell_seed(args.batch, args.miss), host_cache={},
                module=module)
    for _ in range(CALLS):
        cell.reset_ours()
        torch.cuda._sleep(SPIN_CYCLES)  # the call follows a kernel, as in the benchmark's timing
        cell.run_ours(args.splits)
        torch.cuda.synchronize()
    cell.verify(cell.out)
    return 0
