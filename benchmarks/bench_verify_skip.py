#!/usr/bin/env python3
"""GPU time of a captured verify forward's swap-ins with the fused top-k: each layer's ``swap_in_positions``
launched as before ("launches", the code before the conditional skip) against the same swap-ins in conditional
nodes ("conditional", ``VerifySteps.swap_in`` with ``top_k_writable``: one ``swap_in_needed_conditions`` launch
per forward, then per layer a node that runs the swap-in and copies its rows into the top-k only when a real row
is offloaded). Two batches: every request resident (the conditional skips every layer) and one request of the
batch offloaded (every layer runs, plus the copy).

Each variant is one CUDA graph of ``--layers`` layers (nothing else in it), replayed ``--replays`` times per round
between CUDA events, the variants alternating over ``--rounds`` rounds; the table gives the median time per
replay and its spread (min - max over rounds) and the ratio conditional / launches per round.

    python3 benchmarks/bench_verify_skip.py --layers 16 --batch 4 --positions 4
"""

from __future__ import annotations

import argparse
import statistics

import torch

from hisparse_sglang.ops import reference
from hisparse_sglang.testing.cases import make_positions_case


def build_graph(ops, case, layers: int, conditional: bool):
    """One graph of ``layers`` swap-ins over the case's tables (each layer its own top-k and output)."""
    top_ks = [case.top_k.clone() for _ in range(layers)]
    outs = [torch.full_like(case.top_k, -1) for _ in range(layers)]
    # The forward copies the rows into its top-k; here into a tensor of the same size, so the replays keep their
    # input (the same bytes copied).
    copies = [torch.empty_like(case.top_k) for _ in range(layers)]
    limit = torch.full((case.top_k.shape[0],), reference.NO_VERIFY_LIMIT, dtype=torch.int32, device="cuda")
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        conditions = [None] * layers
        if conditional:
            conditions = ops.swap_in_needed_conditions(case.req_pool_indices, case.num_real_reqs, case.buffer_of_req,
                                                       layers)
        for top_k, out, condition, copy in zip(top_ks, outs, conditions, copies):
            ops.swap_in_positions(top_k, *case.args()[1:], out=out, verify_limit=limit, resident_rows=True,
                                  condition=condition, copy_to=None if condition is None else copy)
    return graph


def time_replays(graph, replays: int) -> float:
    """Microseconds per replay."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000.0 / replays


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--positions", type=int, default=4)
    parser.add_argument("--top-k", type=int, default=2048)
    parser.add_argument("--buffer-size", type=int, default=4096)
    parser.add_argument("--replays", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    from hisparse_sglang.ops.swap_in import CudaOps

    ops = CudaOps()
    print(f"GPU: {torch.cuda.get_device_name()}; {args.layers} layers, batch {args.batch}, T = {args.positions}, "
          f"top_k {args.top_k}, device_buffer_size {args.buffer_size}; {args.replays} replays x {args.rounds} rounds")
    print("| batch | launches us/forward | conditional us/forward | conditional / launches |")
    print("|---|---|---|---|")
    for label, resident_fraction in (("all resident", 1.0), ("one offloaded", 1.0 - 1.0 / args.batch)):
        case = make_positions_case(args.batch, args.positions, args.top_k, args.buffer_size, 1152, miss_rate=0.0,
                                   resident_fraction=resident_fraction, seed=5)
        resident = case.buffer_of_req[case.req_pool_indices.long()] < 0
        given = reference.swap_in_positions(*case.clone().args())
        case.top_k[resident] = given[resident]  # the fused top-k's entries of resident requests: their rows
        gpu = case.clone(device="cuda", pin_host=True)
        ops.swap_in_positions(*gpu.clone(device="cuda", pin_host=True).args(), resident_rows=True)  # load, warm
        variants = {name: build_graph(ops, gpu, args.layers, name == "conditional")
                    for name in ("launches", "conditional")}
        times: dict[str, list[float]] = {name: [] for name in variants}
        for r in range(args.rounds):
            for name in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
                times[name].append(time_replays(variants[name], args.replays))
        ratios = [c / b for c, b in zip(times["conditional"], times["launches"])]

        def cell(values):
            return f"{statistics.median(values):.1f} ({min(values):.1f} - {max(values):.1f})"

        print(f"| {label} | {cell(times['launches'])} | {cell(times['conditional'])} | "
              f"{statistics.median(ratios):.3f} ({min(ratios):.3f} - {max(ratios):.3f}) |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
