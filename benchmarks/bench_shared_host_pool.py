"""Host memory and start-up of N TP ranks on one node: one shared host pool against one pool per rank.

Each mode spawns --ranks processes (rank r on GPU r % GPUs, pinned; unpinned without CUDA) on one gloo
group. Each builds its pool with ``memory.shared_host_pool.open_host_pool`` (with the group: "shared";
without: "private") and holds it while this process reads /proc: MemAvailable and Shmem of
/proc/meminfo before, while the pools are held and after the ranks exit, and VmRSS, RssAnon, RssShmem
and VmPTE (page tables) of every rank. Then the ranks exit; the shared segment must be mapped by no
process afterwards.

    python benchmarks/bench_shared_host_pool.py --ranks 2 --gib 40                 # both modes
    python benchmarks/bench_shared_host_pool.py --ranks 8 --gib 40 --modes shared

Prints one table ("pools": the ranks' RssAnon beyond that of the same ranks without a pool, mode
"none", run first, plus the growth of Shmem; "host taken": MemAvailable before less while held, which
other processes on the host also move) and writes bench_shared_host_pool.json to --out (default $OUT).
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import pathlib
import sys
import tempfile
import time

import torch

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from hisparse_sglang.memory import BF16_MLA_ITEM_BYTES  # noqa: E402
from hisparse_sglang.testing.tp_ranks import wait_until_unused  # noqa: E402

GiB = 2**30
DEADLINE_S = 1800.0


def rank_main(rank: int, ranks: int, init_file: str, shared: bool, layers: int, rows: int, item_bytes: int,
              reports, release) -> None:
    import torch.distributed as dist

    from hisparse_sglang.memory.shared_host_pool import open_host_pool

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=ranks,
                            timeout=datetime.timedelta(seconds=DEADLINE_S))
    started = time.monotonic()
    pool = None
    if rows:
        pool = open_host_pool(layers, rows, item_bytes, pin=cuda, group=dist.group.WORLD if shared else None)
    dist.barrier()
    segment = pool.segment.name if pool is not None and pool.segment is not None else None
    reports.put({"rank": rank, "pid": os.getpid(), "seconds": time.monotonic() - started, "segment": segment,
                 "writable": pool is not None and pool.writable})
    release.get(timeout=DEADLINE_S)
    dist.barrier()
    dist.destroy_process_group()


def meminfo() -> dict[str, int]:
    values = {}
    for line in pathlib.Path("/proc/meminfo").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name in ("MemAvailable", "Shmem", "Mlocked"):
            values[name] = int(rest.split()[0]) * 1024
    return values


def status(pid: int) -> dict[str, int]:
    values = {}
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name in ("VmRSS", "RssAnon", "RssShmem", "VmPTE"):
            values[name] = int(rest.split()[0]) * 1024
    return values


def run_mode(mode: str, args, rows: int) -> dict:
    context = multiprocessing.get_context("spawn")
    reports, releases = context.Queue(), [context.Queue() for _ in range(args.ranks)]
    before = meminfo()
    with tempfile.TemporaryDirectory() as scratch:
        processes = [
            context.Process(target=rank_main, args=(rank, args.ranks, f"{scratch}/group", mode == "shared", args.layers,
                                                    rows if mode != "none" else 0, args.item_bytes, reports,
                                                    releases[rank]), daemon=True)
            for rank in range(args.ranks)
        ]
        try:
            for process in processes:
                process.start()
            ranks = sorted((reports.get(timeout=DEADLINE_S) for _ in processes), key=lambda report: report["rank"])
            held = meminfo()
            for report in ranks:
                report.update(status(report["pid"]))
            for release in releases:
                release.put("done")
            for process in processes:
                process.join(120)
        finally:
            for process in processes:
                if process.is_alive():
                    process.kill()
                    process.join(10)
    segment = ranks[0]["segment"]
    leftover = sorted(wait_until_unused(segment, time.monotonic() + 10)) if segment else []
    after = meminfo()
    return {"mode": mode, "ranks": ranks, "before": before, "held": held, "after": after,
            "host_bytes_taken": before["MemAvailable"] - held["MemAvailable"],
            "shmem_bytes": held["Shmem"] - before["Shmem"], "segment_left_mapped_by": leftover}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--gib", type=float, default=8.0, help="one pool's size in GiB")
    parser.add_argument("--layers", type=int, default=61)
    parser.add_argument("--item-bytes", type=int, default=BF16_MLA_ITEM_BYTES)
    parser.add_argument("--modes", nargs="+", default=["private", "shared"], choices=["private", "shared"])
    parser.add_argument("--out", default=os.environ.get("OUT"))
    args = parser.parse_args()
    rows = int(args.gib * GiB / args.layers / args.item_bytes)
    pool_bytes = rows * args.layers * args.item_bytes
    print(f"{args.ranks} ranks, pool {args.layers} layers x {rows} rows x {args.item_bytes} B = {pool_bytes / GiB:.2f} "
          f"GiB; {'CUDA, pinned' if torch.cuda.is_available() else 'no CUDA: unpinned'}")
    results = [run_mode(mode, args, rows) for mode in ["none", *args.modes]]
    # The pools' memory: the ranks' anonymous memory beyond what they take without a pool (mode "none"),
    # plus the shared memory that appeared (counted once, however many ranks map it).
    baseline = sum(rank.get("RssAnon", 0) for rank in results[0]["ranks"])
    for result in results:
        anonymous = sum(rank.get("RssAnon", 0) for rank in result["ranks"]) - baseline
        result["pool_bytes_taken"] = anonymous + result["shmem_bytes"]
    print(f"{'mode':8} {'pools GiB':>10} {'host GiB taken':>15} {'Shmem GiB':>10} {'RssAnon GiB/rank':>17} {'RssShmem GiB/rank':>18} "
          f"{'VmPTE MiB/rank':>15} {'start s (max)':>14}  segment left mapped by")
    for result in results:
        ranks = result["ranks"]
        print(f"{result['mode']:8} {result['pool_bytes_taken'] / GiB:10.2f} {result['host_bytes_taken'] / GiB:15.2f} {result['shmem_bytes'] / GiB:10.2f} "
              f"{max(r.get('RssAnon', 0) for r in ranks) / GiB:17.2f} {max(r.get('RssShmem', 0) for r in ranks) / GiB:18.2f} "
              f"{max(r.get('VmPTE', 0) for r in ranks) / 2**20:15.1f} {max(r['seconds'] for r in ranks):14.1f}  "
              f"{result['segment_left_mapped_by'] or '-'}")
    if args.out:
        path = pathlib.Path(args.out) / "bench_shared_host_pool.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"args": vars(args), "pool_bytes": pool_bytes, "results": results}, indent=1))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
