#!/usr/bin/env python3
"""Preflight of the bundle's Mooncake part, run by run_e2e.py in the environment of the PD servers
(PYTHONPATH with the bundle, LD_LIBRARY_PATH with /tmp/mooncake-sys/lib, MC_FORCE_TCP=1).

1. `import torch` first, as the servers do (it loads the CUDA runtime the engine links against);
2. `import mooncake.engine`; which copies of libibverbs, libmlx5, libcurl and libcudart the process
   loaded (from /proc/self/maps);
3. two TransferEngines initialised like SGLang 0.5.17's `--disaggregation-transfer-backend
   mooncake_tcp` does it (hostname 127.0.0.1, P2PHANDSHAKE, protocol $MOONCAKE_PROTOCOL or "rdma",
   no device, MC_FORCE_TCP=1: Mooncake installs its TCP transport);
4. a write over TCP on 127.0.0.1 from host memory into host memory and, with a GPU, from GPU memory
   (as the prefill's KV pool) into host memory (as the decode's host pool), bytes compared;
5. with --connector: `import sglang.srt.disaggregation.mooncake.conn` (SGLang's PD connector).

Prints one line MOONCAKE_JSON=<json> (ok: every step passed) and exits 0 if ok, else 1.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time
import traceback

WATCHED_LIBRARIES = ("libibverbs.so", "libmlx5.so", "libcurl.so", "libcudart.so", "libnuma.so", "libcuda.so")


def loaded_libraries() -> dict[str, str]:
    """Path of each watched library this process mapped (which copy the loader picked)."""
    found = {}
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1] if line.count("/") else ""
                base = os.path.basename(path)
                for lib in WATCHED_LIBRARIES:
                    if base.startswith(lib):
                        found.setdefault(lib, path)
    except OSError:
        pass
    return found


def write_and_compare(sender, receiver, src_addr: int, dst: ctypes.Array, size: int, expected: bytes) -> dict:
    session = f"127.0.0.1:{receiver.get_rpc_port()}"
    t0 = time.perf_counter()
    rc = sender.transfer_sync_write(session, src_addr, ctypes.addressof(dst), size)
    seconds = time.perf_counter() - t0
    return {"rc": rc, "seconds": round(seconds, 4), "match": rc == 0 and bytes(dst) == expected}


def run(size: int, connector: bool) -> dict:
    out: dict = {"env": {k: os.environ.get(k) for k in ("LD_LIBRARY_PATH", "MC_FORCE_TCP", "MOONCAKE_PROTOCOL")}}
    torch = None
    try:
        import torch  # noqa: F811
        out["torch_cuda"] = torch.cuda.is_available()
    except Exception as e:
        out["torch_error"] = f"{type(e).__name__}: {e}"
    t0 = time.perf_counter()
    try:
        from mooncake.engine import TransferEngine
    except Exception as e:
        out["import_error"] = f"{type(e).__name__}: {e}"
        out["loaded"] = loaded_libraries()
        return out
    out["import_s"] = round(time.perf_counter() - t0, 3)
    out["loaded"] = loaded_libraries()
    try:
        import importlib.metadata as md

        out["version"] = next((md.version(d) for d in ("mooncake-transfer-engine-cuda13", "mooncake-transfer-engine",
                                                       "mooncake-transfer-engine-non-cuda") if _has_dist(md, d)), None)
    except Exception:
        out["version"] = None
    protocol = os.environ.get("MOONCAKE_PROTOCOL", "rdma")
    engines = []
    for _ in range(2):
        engine = TransferEngine()
        rc = engine.initialize("127.0.0.1", "P2PHANDSHAKE", protocol, "")
        engines.append(engine)
        out.setdefault("initialize_rc", []).append(rc)
    out["protocol"] = protocol
    if any(out["initialize_rc"]):
        return out
    sender, receiver = engines
    pattern = bytes((i * 7 + 3) % 251 for i in range(size))
    src = ctypes.create_string_buffer(pattern, size)
    dst = ctypes.create_string_buffer(size)
    out["register_rc"] = [sender.register_memory(ctypes.addressof(src), size),
                          receiver.register_memory(ctypes.addressof(dst), size)]
    out["host_to_host"] = write_and_compare(sender, receiver, ctypes.addressof(src), dst, size, pattern)
    if torch is not None and out.get("torch_cuda"):
        gpu = torch.frombuffer(bytearray(pattern), dtype=torch.uint8).cuda()
        dst2 = ctypes.create_string_buffer(size)
        out["register_rc"] += [sender.register_memory(gpu.data_ptr(), size),
                               receiver.register_memory(ctypes.addressof(dst2), size)]
        out["gpu_to_host"] = write_and_compare(sender, receiver, gpu.data_ptr(), dst2, size, pattern)
    if connector:
        try:
            import sglang.srt.disaggregation.mooncake.conn  # noqa: F401

            out["connector_import"] = "ok"
        except Exception as e:
            out["connector_import"] = f"{type(e).__name__}: {e}"
    return out


def _has_dist(md, name: str) -> bool:
    try:
        md.version(name)
        return True
    except md.PackageNotFoundError:
        return False


def verdict(out: dict) -> bool:
    return (not out.get("import_error") and not any(out.get("initialize_rc", [1]))
            and not any(out.get("register_rc", [1])) and out.get("host_to_host", {}).get("match") is True
            and out.get("gpu_to_host", {"match": True}).get("match") is True
            and out.get("connector_import", "ok") == "ok")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=float, default=4.0, help="bytes written per check (default %(default)s MiB)")
    ap.add_argument("--connector", action="store_true", help="also import SGLang's Mooncake PD connector")
    args = ap.parse_args(argv)
    try:
        out = run(int(args.size_mib * (1 << 20)), args.connector)
    except Exception as e:
        out = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-2000:]}
    out["ok"] = "error" not in out and verdict(out)
    print("MOONCAKE_JSON=" + json.dumps(out), flush=True)
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
