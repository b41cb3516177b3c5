"""``latency``: where the fixed cost of a swap-in call goes: launch, shared-memory reconfiguration, planning.

    python benchmarks/bench_swap_in.py latency [batch]

Times, with CUDA events (``timing.median_us``: GPU-side spin before the start event so host latency
is excluded), on one hit-only cell (1152-B rows):
  A  a call whose rows are all CUDA-graph padding (launch + prologue only)
  B  a hit-only call after a small-smem kernel (the SM must reconfigure shared memory)
  C  the same hit-only call right after another swap-in (no reconfiguration)
for our kernel and SGLang's.
"""

from __future__ import annotations

from hisparse_sglang.ops import jit
from swap_in.cells import Cell, load_sglang
from swap_in.timing import median_us, warm_up

REPS = 30
ROW_BYTES = 1152


def run(args) -> int:
    batch = args.batch
    module = jit.load_module(tuple(args.define)) if args.define else None
    cell = Cell(batch, 0.0, ROW_BYTES, seed=3, host_cache={}, module=module)
    kernel = load_sglang(ROW_BYTES)
    real = cell.gpu.num_real_reqs.clone()
    nothing = lambda: None  # noqa: E731
    warm_up()
    for name, run_kernel in (("ours", cell.run_ours), ("sglang", lambda: cell.run_sglang(kernel))):
        cell.gpu.num_real_reqs.zero_()
        padded = median_us(run_kernel, nothing, REPS)
        cell.gpu.num_real_reqs.copy_(real)
        after_small = median_us(run_kernel, nothing, REPS)
        after_same = median_us(run_kernel, nothing, REPS, before=run_kernel)
        print(f"bs {batch} {name:6s}: all padding {padded:6.1f} us | hit-only after sleep kernel {after_small:6.1f} us | "
              f"hit-only after a swap-in {after_same:6.1f} us", flush=True)
    return 0
