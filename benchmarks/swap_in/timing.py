"""How every swap-in benchmark times: warm-up, CUDA-event medians, host time per call, the floors.

``median_us`` is the one timing of a kernel call (a GPU-side spin before the start event, so the
events time the kernel and not the host's launch path); the floors are the bandwidths of a plain
scattered gather and of a pinned memcpy, measured in the same run as the cells they bound.
"""

from __future__ import annotations

import statistics
import subprocess
import time

import torch

from hisparse_sglang.ops.swap_in import CudaOps

__all__ = [
    "SPIN_CYCLES", "warm_up", "sm_clock_mhz", "median_us", "host_us", "gather_bandwidth", "memcpy_bandwidth",
]

SPIN_CYCLES = 200_000  # about 100 us at H100/H200 clocks: longer than any host launch path


def warm_up(milliseconds: float = 100.0) -> None:
    """Keep the GPU busy long enough for its clocks to leave idle before timing."""
    torch.cuda._sleep(int(milliseconds * 1e-3 * 1.98e9))
    torch.cuda.synchronize()


def sm_clock_mhz() -> str:
    try:
        return subprocess.run(
            ["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader,nounits"], capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        return "?"


def median_us(fn, reset, reps: int, before=None) -> float:
    """Median over `reps` of one call timed with CUDA events; `reset` runs outside the timing.

    A GPU-side spin before the start event keeps the GPU busy while the host enqueues the call,
    so the events time the kernel, not the host's launch latency. `before`, if given, is enqueued
    after the spin and right before the start event: the work the timed call follows on the GPU
    (another swap-in, a kernel with little shared memory), not timed.
    """
    times = []
    for _ in range(reps + 3):
        reset()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(SPIN_CYCLES)
        if before is not None:
            before()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)
    return statistics.median(times[3:])


def host_us(fn, calls: int = 300) -> float:
    """Wall time per call of back-to-back calls (hit-only state): the host launch path when the
    kernel is shorter than it."""
    fn()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / calls * 1e6


def gather_bandwidth(row_bytes: int, total_bytes: int = 1 << 30, module=None) -> float:
    """GB/s of a large scattered gather of pinned host rows into device rows (one copy launch).

    The best over several grid sizes: the floor is what a plain gather can reach on this link.
    ``module``: the kernel library whose ``copy_rows`` gathers (default: the production build).
    """
    rows = total_bytes // row_bytes
    host = torch.empty((rows * 2, row_bytes), dtype=torch.uint8).pin_memory()
    device = torch.empty((rows, row_bytes), dtype=torch.uint8, device="cuda")
    src = torch.randperm(rows * 2, device="cuda")[:rows]
    dst = torch.randperm(rows, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    ops = CudaOps(module=module)
    best = 0.0
    for blocks in (sms // 2, sms, 2 * sms, 4 * sms):
        timings = []
        for _ in range(4):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            ops.copy_rows([host], [device], src, dst, max_blocks=blocks)
            end.record()
            end.synchronize()
            timings.append(start.elapsed_time(end) / 1000.0)
        best = max(best, rows * row_bytes / statistics.median(timings[1:]) / 1e9)
    return best


def memcpy_bandwidth(total_bytes: int = 1 << 30) -> float:
    """GB/s of one contiguous pinned host -> device copy."""
    host = torch.empty(total_bytes, dtype=torch.uint8).pin_memory()
    device = torch.empty(total_bytes, dtype=torch.uint8, device="cuda")
    timings = []
    for _ in range(6):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        device.copy_(host, non_blocking=True)
        end.record()
        end.synchronize()
        timings.append(start.elapsed_time(end) / 1000.0)
    return total_bytes / statistics.median(timings[1:]) / 1e9
