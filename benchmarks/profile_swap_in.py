"""One swap-in call per cell for Nsight Compute (GPU only): warm-up calls, then the profiled one.

    ncu --clock-control none --launch-skip 5 --launch-count 1 -k regex:swap_in_kernel \\
        --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \\
        python benchmarks/profile_swap_in.py 128 0

Arguments: batch, miss percent, optional splits (default: choose_splits).
"""

import sys

import torch

sys.path.insert(0, "benchmarks")
import bench_swap_in as bench  # noqa: E402


def main() -> int:
    batch, miss = int(sys.argv[1]), float(sys.argv[2])
    splits = int(sys.argv[3]) if len(sys.argv) > 3 else None
    cell = bench.Cell(batch, miss / 100, 1152, seed=batch * 1000 + int(miss), host_cache={})
    for _ in range(6):
        cell.reset_ours()
        torch.cuda._sleep(200_000)  # the call follows a kernel, as in the benchmark's timing
        cell.run_ours(splits)
        torch.cuda.synchronize()
    cell.verify(cell.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
