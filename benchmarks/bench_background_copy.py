#!/usr/bin/env python3
"""What a copy beside the forward costs the forward: ``copy_rows`` of one prompt's KV (device -> pinned host, as
the coordinator stages a prefill of too many runs of rows for the copy engines; or host -> device, as it promotes a
request) on a side stream while a decode-like loop of kernels runs on the main stream, for several grid caps
(``max_blocks``; 0: four CTAs per SM, the whole GPU).

For each cap it prints the copy's time and bandwidth, the loop's time per step alone and while the copy runs, and
the loop's total delay over the copy (its steps during the copy, each minus the time alone): what an admitted
request costs the requests decoding beside it. ``--blocks`` lists the caps (the coordinator's background copies
take ``coordinator.staging.BACKGROUND_COPY_BLOCKS``); ``dma`` among them copies each layer's rows as one contiguous
``Tensor.copy_`` instead (the copy engines, no SM: the best case of a copy by DMA, whose rows would come in pages),
``dma/PAGES`` one ``copy_`` per run of PAGES pages of 64 rows (a request's pages in runs of that length), and
``runs/PAGES`` the same runs, each to a shuffled place, by ``CudaOps.copy_row_runs`` (one ``cudaMemcpyAsync`` per
run and layer from C++: what the coordinator stages a prefill with). The host's time to enqueue each copy is
printed too: one ``copy_`` per page from Python is bound by it, and such a row gives no delay (the loop starts once
the copy is enqueued).

    PYTHONPATH=src python3 benchmarks/bench_background_copy.py                      # 16K tokens x 61 layers, bf16
    PYTHONPATH=src python3 benchmarks/bench_background_copy.py --tokens 8192 --layers 16 --direction h2d

The loop's step is ``--gemms`` bf16 GEMMs of ``[--m, 4096] x [4096, 4096]`` (weight-bandwidth bound, as a small
decode batch's are) and one 64-MB elementwise pass; it stands for the forward's kernels, not for any model's.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

# A copy whose enqueue takes more than this fraction of its time is bound by the host issuing it (one copy_ per run
# from Python): the loop, which starts after the enqueue, overlaps too little of it to measure a delay.
ENQUEUE_BOUND = 0.25


def run_rows(block: str) -> int:
    """Rows per run of a ``dma/PAGES`` or ``runs/PAGES`` entry of ``--blocks`` (pages of 64 rows); ValueError if
    PAGES is not a positive integer."""
    pages = block.partition("/")[2]
    if not (pages.isdigit() and int(pages) > 0):
        raise ValueError(block)
    return 64 * int(pages)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16384, help="rows per layer copied (one prompt's tokens)")
    parser.add_argument("--layers", type=int, default=61)
    parser.add_argument("--row-bytes", type=int, default=1152, help="1152: bf16 MLA KV; 656: fp8")
    parser.add_argument("--direction", choices=("d2h", "h2d"), default="d2h", help="d2h: staging; h2d: promotion")
    parser.add_argument("--blocks", default="0,64,32,16,8,dma",
                        help="grid caps, comma-separated (0: the whole GPU; dma: one contiguous copy per layer; dma/PAGES, "
                             "runs/PAGES: runs of PAGES pages, by one copy_ each from Python or by copy_row_runs)")
    parser.add_argument("--gemms", type=int, default=8, help="GEMMs per loop step")
    parser.add_argument("--m", type=int, default=16, help="rows of each GEMM's activation (tokens of a batch)")
    parser.add_argument("--repeats", type=int, default=3, help="copies per cap (the median is printed)")
    args = parser.parse_args(argv)
    try:
        args.blocks = [b if b.startswith(("dma", "runs/")) else int(b) for b in args.blocks.split(",")]
        for b in args.blocks:
            if isinstance(b, str) and b != "dma":
                run_rows(b)
    except ValueError:
        parser.error(f"--blocks {args.blocks!r}: comma-separated integers, dma, dma/PAGES or runs/PAGES")
    if any(isinstance(b, int) and b < 0 for b in args.blocks) or min(args.tokens, args.layers, args.gemms, args.m, args.repeats) < 1:
        parser.error("--blocks must be >= 0; --tokens, --layers, --gemms, --m, --repeats >= 1")
    if args.row_bytes <= 0 or args.row_bytes % 16:
        parser.error(f"--row-bytes {args.row_bytes}: a positive multiple of 16 (the copy moves 16-byte pieces)")
    return args


class Loop:
    """The main stream's stand-in for a decode forward: a few weight-bound GEMMs and one elementwise pass."""

    def __init__(self, gemms: int, m: int) -> None:
        self.x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        self.weights = [torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) for _ in range(gemms)]
        self.big = torch.zeros(32 * 1024 * 1024, device="cuda", dtype=torch.bfloat16)

    def step(self) -> None:
        for w in self.weights:
            torch.mm(self.x, w)
        self.big.add_(1)

    def time_alone(self, steps: int = 100) -> float:
        """Seconds per step with nothing beside it."""
        for _ in range(10):
            self.step()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            self.step()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / steps


def run_beside(loop: Loop, copy, side: torch.cuda.Stream) -> tuple[float, float, int]:
    """(copy seconds, loop seconds per step while it ran, loop steps during it): the copy is enqueued on ``side``
    and the loop runs step by step on the main stream until the copy's end event has passed."""
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(side):
        begin.record()
        copy()
        end.record()
    start = time.perf_counter()
    steps = 0
    while not end.query():
        loop.step()
        torch.cuda.current_stream().synchronize()  # one step at a time, as a decode step's host waits
        steps += 1
    loop_s = time.perf_counter() - start
    torch.cuda.synchronize()
    copy_s = begin.elapsed_time(end) / 1e3
    return copy_s, loop_s / max(steps, 1), steps


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_background_copy.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from hisparse_sglang.ops.swap_in import CudaOps

    ops = CudaOps()
    host = [torch.zeros(args.tokens, args.row_bytes, dtype=torch.uint8).pin_memory() for _ in range(args.layers)]
    device = [torch.ones(args.tokens, args.row_bytes, dtype=torch.uint8, device="cuda") for _ in range(args.layers)]
    rows = torch.randperm(args.tokens, device="cuda")
    src, dst = (device, host) if args.direction == "d2h" else (host, device)
    total_bytes = args.tokens * args.row_bytes * args.layers
    loop = Loop(args.gemms, args.m)
    side = torch.cuda.Stream()
    name = torch.cuda.get_device_name()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{name} ({sms} SMs), torch {torch.__version__}; copy {args.direction} of {args.tokens} rows x "
          f"{args.layers} layers x {args.row_bytes} B = {total_bytes / 2**20:.0f} MiB; loop step: {args.gemms} "
          f"GEMMs [{args.m}, 4096] x [4096, 4096] bf16 + one 64-MiB elementwise pass")
    print("| max_blocks | copy ms | copy GB/s | host ms to enqueue it | loop us/step alone | "
          "loop us/step beside the copy | slowdown | loop delay over the copy, ms |")
    print("|---|---|---|---|---|---|---|---|")
    for blocks in args.blocks:
        if blocks == "dma":
            def copy():
                for s_layer, d_layer in zip(src, dst):
                    d_layer.copy_(s_layer, non_blocking=True)
        elif isinstance(blocks, str) and blocks.startswith("runs/"):  # runs of PAGES pages to shuffled places
            run = run_rows(blocks)
            starts = torch.arange(0, args.tokens, run)
            full = args.tokens // run  # the whole runs trade places; a shorter last run stays
            places = starts.clone()
            places[:full] = starts[:full][torch.randperm(full)]
            page_runs = torch.stack([starts, places, (args.tokens - starts).clamp(max=run)], 1)
            def copy():
                ops.copy_row_runs(src, dst, page_runs)
        elif isinstance(blocks, str):  # dma/PAGES: one copy_ per run of PAGES pages of 64 rows, as pages would come
            run = run_rows(blocks)
            def copy():
                for s_layer, d_layer in zip(src, dst):
                    for start in range(0, args.tokens, run):
                        d_layer[start:start + run].copy_(s_layer[start:start + run], non_blocking=True)
        else:
            def copy():
                ops.copy_rows(src, dst, rows, rows, max_blocks=blocks)
        copy()  # warm-up
        torch.cuda.synchronize()
        issued = time.perf_counter()
        with torch.cuda.stream(side):
            copy()
        issue_ms = (time.perf_counter() - issued) * 1e3  # host time to enqueue the copy
        torch.cuda.synchronize()
        runs = []
        for _ in range(args.repeats):
            alone = loop.time_alone()
            copy_s, beside, steps = run_beside(loop, copy, side)
            runs.append((copy_s, alone, beside, steps))
        copy_s, alone, beside, steps = sorted(runs)[len(runs) // 2]
        label = f"| {blocks or f'0 ({4 * sms})'} | {copy_s * 1e3:.2f} | {total_bytes / copy_s / 1e9:.1f} | {issue_ms:.2f} | "
        if issue_ms > ENQUEUE_BOUND * copy_s * 1e3:
            # The loop starts once the copy is enqueued: it ran beside only the copy's tail, no delay to tell.
            print(label + f"{alone * 1e6:.1f} | – | – | – (bound by its enqueue) |")
            continue
        delay_ms = max(beside - alone, 0.0) * steps * 1e3
        print(label + f"{alone * 1e6:.1f} | {beside * 1e6:.1f} | {beside / alone:.2f}x | {delay_ms:.2f} |")
    print(f"(median of {args.repeats} copies per cap, by copy time; each row's loop alone measured just before)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
