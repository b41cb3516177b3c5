"""Where the fixed cost of a swap-in call goes: launch, shared-memory reconfiguration, planning.

Times, with CUDA events (GPU-side spin before the start event so host latency is excluded):
  A  a call whose rows are all CUDA-graph padding (launch + prologue only)
  B  a hit-only call after a small-smem kernel (the SM must reconfigure shared memory)
  C  the same hit-only call right after another swap-in (no reconfiguration)
for our kernel and SGLang's, on one hit-only case.
"""

import statistics
import sys

import torch

sys.path.insert(0, "benchmarks")
import bench_swap_in as bench  # noqa: E402


def timed(before, fn, reps=30):
    times = []
    for _ in range(reps + 3):
        torch.cuda._sleep(200_000)
        before()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return statistics.median(times[3:])


def main() -> int:
    batch = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    cell = bench.Cell(batch, 0.0, 1152, seed=3, host_cache={})
    sys.path.insert(0, "benchmarks/baseline")
    import sglang_kernel

    kernel = sglang_kernel.load(1152, bench.TOP_K, bench.BUFFER, 960)
    real = cell.gpu.num_real_reqs.clone()
    nothing = lambda: None  # noqa: E731
    bench.warm_up()
    for name, run in (("ours", cell.run_ours), ("sglang", lambda: cell.run_sglang(kernel))):
        cell.gpu.num_real_reqs.zero_()
        padded = timed(nothing, run)
        cell.gpu.num_real_reqs.copy_(real)
        after_small = timed(nothing, run)
        after_same = timed(run, run)
        print(f"bs {batch} {name:6s}: all padding {padded:6.1f} us | hit-only after sleep kernel {after_small:6.1f} us | "
              f"hit-only after a swap-in {after_same:6.1f} us", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
