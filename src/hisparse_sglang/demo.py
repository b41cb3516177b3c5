"""Demo: the HiSparse coordinator and the reference swap-in driving a simulated decode loop.

Runs on the CPU. Long requests share a device KV pool too small for all of them: with
``resident_first`` some stay resident and the others are demoted to their small buffer; each
step prints the hit rate of the offloaded requests' top-k lookups and the bytes copied host ->
device. Every row returned by the swap-in is checked against the token it must hold.

The indexer's top-k comes from a workload profile (testing/workload.py, docs/workload.md):
``calibrated`` (default: fitted to published DSA locality), ``random`` (what a tiny model with dummy
weights selects), ``high-locality``, ``low-locality``, each parameter settable (``--persistence``,
``--topic-size``, ...), or ``legacy``, the simulator's stress model (``--drift``). A demoted request's
buffer starts with its most recent tokens, so the first steps after a demotion miss more than the
profile's steady state.

    python -m hisparse_sglang.demo [--steps 12] [--requests 4] [--prompt 12000] [--mode both] [--profile calibrated]
"""

from __future__ import annotations

import argparse
import sys
import time

from hisparse_sglang.config import HiSparseConfig
from hisparse_sglang.memory import BF16_MLA_ITEM_BYTES
from hisparse_sglang.testing.sim import SimulatedServer
from hisparse_sglang.testing.workload import TopKWorkload, WorkloadParamError, add_workload_arguments, params_from_args

LEGACY_PROFILE = "legacy"


def run(resident_first: bool, args: argparse.Namespace) -> None:
    config = HiSparseConfig(
        top_k=args.top_k,
        device_buffer_size=args.buffer,
        host_to_device_ratio=args.ratio,
        resident_first=resident_first,
    )
    page = config.page_size
    device_pages = args.device_tokens // page + 1
    workload = None
    if args.profile != LEGACY_PROFILE:
        workload = TopKWorkload(params_from_args(args, top_k=config.top_k, context_len=args.prompt))
    server = SimulatedServer(
        config,
        layer_num=args.layers,
        item_bytes=BF16_MLA_ITEM_BYTES,
        device_pages=device_pages,
        max_reqs=args.requests + 1,
        max_context=args.prompt + args.steps + page,
        seed=args.seed,
        drift=args.drift,
        workload=workload,
    )
    print(
        f"\n== resident_first={resident_first}: {args.requests} requests x {args.prompt} tokens, device pool "
        f"{args.device_tokens} tokens, top_k {config.top_k}, buffer {config.device_buffer_size}+{page}, "
        f"{args.layers} layers x {BF16_MLA_ITEM_BYTES} B rows, top-k profile {args.profile}"
    )
    for _ in range(args.requests):
        if server.add_request(args.prompt, args.steps + 1) is None:
            print("   (a request did not fit and waits)")
    total_lookups = total_misses = total_bytes = 0
    started = time.monotonic()
    for step in range(1, args.steps + 1):
        report = server.step()
        server.check_invariants()
        total_lookups += report.lookups
        total_misses += report.misses
        total_bytes += report.bytes_moved
        hit = f"{100 * report.hit_rate:5.1f}%" if report.lookups else "  n/a "
        print(
            f"step {step:3d} | batch {report.batch_size} | resident {report.resident} offloaded {report.offloaded} | "
            f"lookups {report.lookups:6d} misses {report.misses:5d} hit {hit} | moved {report.bytes_moved / 2**20:7.2f} MiB"
        )
    stats = server.coordinator.stats()
    overall = 1 - total_misses / total_lookups if total_lookups else 1.0
    print(
        f"   total: hit rate {100 * overall:.1f}%, {total_bytes / 2**20:.1f} MiB moved, {stats.demotions} demotions, "
        f"{stats.promotions} promotions, every returned row verified ({time.monotonic() - started:.1f} s)"
    )
    for uid in sorted(server.requests):
        server.finish(uid)
    server.check_all_free()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=12000)
    parser.add_argument("--device-tokens", type=int, default=32768, help="device KV pool size in tokens")
    parser.add_argument("--top-k", type=int, default=2048)
    parser.add_argument("--buffer", type=int, default=4096, help="device_buffer_size")
    parser.add_argument("--ratio", type=int, default=4, help="host_to_device_ratio")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--drift", type=float, default=0.2,
                        help="--profile legacy: share of each layer's top-k that changes per step")
    parser.add_argument("--seed", type=int, default=0, help="seed of the simulator (and of the legacy top-k)")
    parser.add_argument("--mode", choices=["resident-first", "always-offload", "both"], default="both")
    # top_k and the context length come from --top-k and --prompt.
    add_workload_arguments(parser, extra_profiles=[LEGACY_PROFILE], exclude=("top_k", "context_len"))
    args = parser.parse_args(argv)
    if args.profile != LEGACY_PROFILE:
        try:
            params_from_args(args, top_k=args.top_k, context_len=args.prompt)
        except WorkloadParamError as error:
            parser.error(str(error))
    if args.mode in ("resident-first", "both"):
        run(True, args)
    if args.mode in ("always-offload", "both"):
        run(False, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
