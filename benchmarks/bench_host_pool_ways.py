"""Four ways to make host memory ready for the GPU, timed first on memory this machine has not used
yet ("cold") and then on memory used once ("warm") (issue #27 item 3; the numbers in
benchmarks/results/e2e_H200_2026-11-26.md section 10a):

  touch+register     every page touched by a thread pool (memset), then registered with
                     cudaHostRegister by the same pool (HostRegion's way before 2026-11-26);
  register-only      cudaHostRegister of untouched pages (the driver faults them in);
  populate+register  madvise(MADV_POPULATE_WRITE) by the thread pool, then registered;
  pipelined          each 256 MiB piece touched and then registered in one task: HostRegion's way
                     (memory/pinning.py) since section 10a's runs showed it the fastest.

Cold: the four regions of --gib each are made and kept alive together, so each gets pages not used
before (run it first on a freshly booted or lent machine: a virtual machine's first touch of its
memory may wait for the host to back it). Warm: one at a time, in reverse order, after releasing
them. Without CUDA the ways run with a registrar that registers nothing (touching only).

    python benchmarks/bench_host_pool_ways.py --gib 22

Prints one JSON line per way and phase; writes bench_host_pool_ways.json to $OUT if set.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import gc
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
from hisparse_sglang.memory.pinning import (  # noqa: E402
    MAX_REGISTER_BYTES,
    TOUCH_CHUNK_BYTES,
    CudaRegistrar,
    HostRegion,
    anonymous_mapping,
    default_threads,
    plan_chunks,
)

GIB = 2**30
libc = ctypes.CDLL("libc.so.6", use_errno=True)
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
MADV_POPULATE_WRITE = 23


def meminfo(key):
    for line in open("/proc/meminfo"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return -1


def vmstat(keys):
    out = {}
    for line in open("/proc/vmstat"):
        k, v = line.split()
        if k in keys:
            out[k] = int(v)
    return out


THP_KEYS = ("thp_fault_alloc", "thp_fault_fallback", "thp_collapse_alloc")


class TouchThenRegister:
    """HostRegion's way before 2026-11-26: every page touched by the threads, then the region
    registered by the threads in pieces of at most MAX_REGISTER_BYTES."""

    def __init__(self, nbytes, reg, threads):
        self.mapping = anonymous_mapping(nbytes)
        self.tensor = torch.frombuffer(self.mapping, dtype=torch.uint8, count=nbytes)
        self.address = self.tensor.data_ptr()
        self.reg = reg
        self.done = []
        with concurrent.futures.ThreadPoolExecutor(threads, initializer=reg.enter_thread) as pool:
            started = time.monotonic()
            list(pool.map(lambda piece: ctypes.memset(self.address + piece[0], 0, piece[1]),
                          plan_chunks([(0, nbytes)], TOUCH_CHUNK_BYTES)))
            self.touch_s = time.monotonic() - started
            errors = [e for e in pool.map(self._register, plan_chunks([(0, nbytes)], MAX_REGISTER_BYTES)) if e]
            self.register_s = time.monotonic() - started - self.touch_s
        if errors:
            self.close()
            raise RuntimeError(f"cudaHostRegister failed: {errors[:2]}")

    def _register(self, piece):
        error = self.reg.register(self.address + piece[0], piece[1])
        if error is None:
            self.done.append(self.address + piece[0])
        return error

    def close(self):
        for address in self.done:
            self.reg.unregister(address)
        self.done = []


def touch_then_register(nbytes, reg, threads):
    region = TouchThenRegister(nbytes, reg, threads)
    return region, {"touch_s": region.touch_s, "register_s": region.register_s}


def register_only(nbytes, reg, threads):
    region = HostRegion(nbytes, registrar=reg, threads=threads, log_every_s=60, touch=False)
    return region, {"touch_s": region.timing.touch_s, "register_s": region.timing.register_s}


def populate_register(nbytes, reg, threads):
    mapping = anonymous_mapping(nbytes)
    address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    started = time.monotonic()

    def populate(piece):
        offset, length = piece
        rc = libc.madvise(address + offset, length, MADV_POPULATE_WRITE)
        return rc, ctypes.get_errno()

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        codes = list(pool.map(populate, plan_chunks([(0, nbytes)], TOUCH_CHUNK_BYTES)))
    populate_s = time.monotonic() - started
    bad = [c for c in codes if c[0] != 0]
    region = HostRegion(nbytes, registrar=reg, threads=threads, log_every_s=60, mapping=mapping, touch=False)
    return region, {"populate_s": populate_s, "register_s": region.timing.register_s, "populate_errors": bad[:2]}


def pipelined(nbytes, reg, threads):
    """HostRegion's way (memory/pinning.py): each piece touched, then registered, by one thread."""
    region = HostRegion(nbytes, registrar=reg, threads=threads, log_every_s=60)
    timing = region.timing
    return region, {"touch_s": timing.touch_s, "register_s": timing.register_s}


WAYS = {"touch+register": touch_then_register, "register-only": register_only,
        "populate+register": populate_register, "pipelined": pipelined}


def run(name, nbytes, reg, threads, phase):
    before_huge, before = meminfo("AnonHugePages"), vmstat(THP_KEYS)
    started = time.monotonic()
    obj, parts = WAYS[name](nbytes, reg, threads)
    seconds = time.monotonic() - started
    after_huge, after = meminfo("AnonHugePages"), vmstat(THP_KEYS)
    row = {"phase": phase, "way": name, "gib": nbytes / GIB, "seconds": round(seconds, 3),
           "gib_per_s": round(nbytes / GIB / seconds, 2), **{k: round(v, 3) if isinstance(v, float) else v
                                                              for k, v in parts.items()},
           "anon_huge_gib": round((after_huge - before_huge) / GIB, 2),
           **{k: after.get(k, 0) - before.get(k, 0) for k in THP_KEYS}}
    print(json.dumps(row), flush=True)
    return obj, row


class NoRegistrar:
    """Registers nothing (a machine without CUDA): the ways then only touch or populate."""

    def enter_thread(self) -> None:
        pass

    def register(self, address: int, length: int) -> None:
        return None

    def unregister(self, address: int) -> None:
        pass


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=22.0, help="size of each way's region (default %(default)s)")
    parser.add_argument("--threads", type=int, default=None, help="default: memory/pinning.default_threads()")
    args = parser.parse_args(argv)
    nbytes = max(2 << 20, int(args.gib * GIB) // (2 << 20) * (2 << 20))
    threads = args.threads or default_threads()
    reg = CudaRegistrar(torch.device("cuda", 0)) if torch.cuda.is_available() else NoRegistrar()
    sysinfo = {"threads": threads, "cuda": torch.cuda.is_available(), "kernel": os.uname().release, "mem_total_gib": meminfo("MemTotal") / GIB,
               "mem_free_gib": meminfo("MemFree") / GIB}
    for path in ("/sys/kernel/mm/transparent_hugepage/enabled", "/sys/kernel/mm/transparent_hugepage/defrag",
                 "/sys/kernel/mm/transparent_hugepage/khugepaged/defrag"):
        try:
            sysinfo[path.rsplit("/", 2)[-2] + "/" + path.rsplit("/", 1)[-1]] = open(path).read().strip()
        except OSError as exc:
            sysinfo[path] = str(exc)
    print(json.dumps(sysinfo), flush=True)
    rows = []
    order = list(WAYS)
    alive = []
    for name in order:  # cold: all alive at once, each on pages never used
        obj, row = run(name, nbytes, reg, threads, "cold")
        alive.append(obj)
        rows.append(row)
    for obj in alive:
        obj.close()
    del alive, obj
    gc.collect()
    for name in reversed(order):  # warm: one at a time on memory used above
        obj, row = run(name, nbytes, reg, threads, "warm")
        obj.close()
        del obj
        gc.collect()
        rows.append(row)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "bench_host_pool_ways.json"), "w") as fh:
            json.dump({"system": sysinfo, "rows": rows}, fh, indent=1)
    return rows


if __name__ == "__main__":
    main()
