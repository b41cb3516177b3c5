"""Host-pool start-up: the old way (one cudaHostAlloc per layer) against the new one, in one run.

The old way is what HostKVPool did before: ``torch.empty(..., pin_memory=True)`` per layer (torch's
caching host allocator, cudaHostAlloc: pages faulted, zeroed and pinned in one thread). The new way
is HostKVPool now (memory/pinning.py: one anonymous region cut into 256 MiB pieces within layers,
each piece touched and then registered with cudaHostRegister by one thread of a pool; the ways of
doing that part are compared by bench_host_pool_ways.py). Each way builds a pool of
--gib GiB, is timed to the moment every layer is usable, then released before the next one.
Without CUDA only the new way runs, unpinned (touching alone).

    python benchmarks/bench_host_pool.py --gib 54 --layers 61            # both ways, GiB/s each
    python benchmarks/bench_host_pool.py --gib 16 --threads 1 4 16       # new way, thread sweep

Prints one line per way and writes bench_host_pool.json to --out (default $OUT, if set).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import pathlib
import sys
import time

import torch

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from hisparse_sglang.memory import BF16_MLA_ITEM_BYTES, HostKVPool  # noqa: E402
from hisparse_sglang.memory.pinning import default_threads  # noqa: E402


def old_way(layers: int, rows: int, item_bytes: int) -> float:
    """Seconds to pin the pool as HostKVPool did before (one pinned torch tensor per layer)."""
    started = time.monotonic()
    regions = [torch.empty((rows, item_bytes), dtype=torch.uint8, pin_memory=True) for _ in range(layers)]
    seconds = time.monotonic() - started
    assert all(region.is_pinned() for region in regions)
    del regions
    gc.collect()
    torch._C._host_emptyCache()  # the caching host allocator keeps freed pinned blocks otherwise
    return seconds


def new_way(layers: int, rows: int, item_bytes: int, pin: bool, threads: int | None) -> dict:
    started = time.monotonic()
    pool = HostKVPool(layers, rows, item_bytes, pin=pin, threads=threads)
    seconds = time.monotonic() - started
    if pin:
        assert all(layer.is_pinned() for layer in pool.layers), "a layer is not page-locked"
        probe = pool.layers[-1][-4:].to("cuda", non_blocking=True)  # the device reads the last rows
        torch.cuda.synchronize()
        assert probe.shape == (4, item_bytes)
    timing = pool.region.timing
    result = {"seconds": seconds, "touch_s": timing.touch_s, "register_s": timing.register_s,
              "threads": pool.region.threads}
    del pool
    gc.collect()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=54.0, help="pool size in GiB")
    parser.add_argument("--layers", type=int, default=61)
    parser.add_argument("--item-bytes", type=int, default=BF16_MLA_ITEM_BYTES)
    parser.add_argument("--threads", type=int, nargs="*", default=[], help="new-way thread counts (default: automatic)")
    parser.add_argument("--skip-old", action="store_true", help="time the new way only")
    parser.add_argument("--out", default=os.environ.get("OUT"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    rows = int(args.gib * 2**30 / args.layers / args.item_bytes)
    nbytes = rows * args.layers * args.item_bytes
    gib = nbytes / 2**30
    cuda = torch.cuda.is_available()
    print(f"pool: {args.layers} layers x {rows} rows x {args.item_bytes} B = {gib:.2f} GiB; "
          f"{'GPU ' + torch.cuda.get_device_name() if cuda else 'no CUDA: unpinned'}; {default_threads()} CPUs usable")
    results = []
    for threads in args.threads or [None]:
        timed = new_way(args.layers, rows, args.item_bytes, cuda, threads)
        results.append({"way": "new", "gib": gib, **timed, "gib_per_s": gib / timed["seconds"]})
        print(f"new way ({'pinned' if cuda else 'touched only'}, {timed['threads']} threads): {timed['seconds']:.2f} s, "
              f"{gib / timed['seconds']:.1f} GiB/s (touch {timed['touch_s']:.2f} s, register {timed['register_s']:.2f} s)")
    if cuda and not args.skip_old:
        seconds = old_way(args.layers, rows, args.item_bytes)
        results.append({"way": "old", "gib": gib, "seconds": seconds, "gib_per_s": gib / seconds})
        print(f"old way (cudaHostAlloc per layer): {seconds:.2f} s, {gib / seconds:.1f} GiB/s")
    elif not cuda:
        print("old way: skipped (needs CUDA)")
    if args.out:
        path = pathlib.Path(args.out) / "bench_host_pool.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"args": vars(args), "cuda": cuda, "results": results}, indent=1))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
