"""Host time of HiSparse's per-step decode bookkeeping on the scheduler's critical path.

Every decode step the scheduler calls the allocator's ``alloc_decode`` (a logical location per new
token) and the coordinator's ``prepare_decode`` (SGLang's ``map_last_loc_to_buffer``: binds new
tokens that need it and switches modes). Both run on the scheduler's thread before the step is
launched, so their host time adds to every step at low load. (The eager backup of each new token
runs inside the forward, in ``swap_in``, and costs the host nothing under CUDA graphs.)

This benchmark drives a simulated decode server on the GPU and prints, per batch size and mode mix,
the median host time of ``prepare_decode`` and of ``alloc_decode`` with the CUDA bind kernel and
with its pure-torch twin, measured in the same run. Target: the sum at most 50 us at bs 64.

    python benchmarks/bench_decode_step.py                 # bs 8/32/64 x resident/offloaded/mixed
    python benchmarks/bench_decode_step.py --batch 128 --steps 100
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import statistics
import sys
import time
import types

import torch

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from hisparse_sglang.config import HiSparseConfig  # noqa: E402
from hisparse_sglang.coordinator import OFFLOADED, RESIDENT  # noqa: E402
from hisparse_sglang.ops import reference  # noqa: E402
from hisparse_sglang.testing.sim import SimulatedServer  # noqa: E402

PAGE = 64
TOP_K = 256  # the swap-in is not timed here; a small top-k keeps the simulated steps quick
BUFFER = 512
PROMPT = 1500
LAYERS = 4
ITEM_BYTES = 64


def op_sets():
    from hisparse_sglang.ops.swap_in import CudaOps

    cuda = CudaOps()
    kernels = types.SimpleNamespace(
        swap_in=cuda.swap_in, copy_rows=cuda.copy_rows, copy_row_runs=cuda.copy_row_runs,
        backup_newest=cuda.backup_newest, bind_rows=cuda.bind_rows,
    )
    twins = types.SimpleNamespace(
        swap_in=cuda.swap_in, copy_rows=cuda.copy_rows, copy_row_runs=cuda.copy_row_runs,
        backup_newest=cuda.backup_newest, bind_rows=reference.bind_rows,
    )
    return {"kernels": kernels, "torch twins": twins}


def build(batch: int, mode: str, ops, device: str = "cuda") -> SimulatedServer:
    """A simulated decode server with ``batch`` requests of PROMPT tokens, one decode step in, in
    ``mode``: all resident, all offloaded, or half of them demoted ("mixed"). ``device`` "cpu" (with
    the reference ops) is how tests/test_bench_decode_step.py checks this setup without a GPU."""
    config = HiSparseConfig(
        top_k=TOP_K, device_buffer_size=BUFFER, page_size=PAGE, host_to_device_ratio=4,
        resident_first=mode != "offloaded", switch_cooldown_steps=1_000_000,
    )
    pages_per_request = -(-(PROMPT + 400) // PAGE)
    server = SimulatedServer(
        config, layer_num=LAYERS, item_bytes=ITEM_BYTES, device_pages=batch * pages_per_request + 64,
        max_reqs=batch + 1, max_context=PROMPT + 512, verify=False, ops=ops, device=device, checked=False,
    )
    for _ in range(batch):
        if server.add_request(PROMPT, 400) is None:
            raise RuntimeError(f"could not admit {batch} requests of {PROMPT} tokens")
    server.step()
    if mode == "mixed":
        # demote every other request (the longest first): free what half of them hold beyond a buffer
        coordinator = server.coordinator
        record = next(iter(coordinator.requests.values()))
        gain = -(-record.seq_len // PAGE) - coordinator.policy.buffer_pages
        coordinator.reclaim(coordinator.allocator.device_rows.free_pages + (batch // 2) * gain)
    server.step()
    return server


def time_step_work(server: SimulatedServer, steps: int, profiler=None) -> tuple[float, float, dict]:
    """Median host time (us) of prepare_decode and of alloc_decode over ``steps`` decode steps."""
    coordinator, allocator = server.coordinator, server.allocator
    spent: dict[str, list[float]] = {"prepare_decode": [], "alloc_decode": []}

    def timed(owner, name):
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            if profiler is not None:
                profiler.enable()
            started = time.perf_counter()
            result = original(*args, **kwargs)
            spent[name].append(time.perf_counter() - started)
            if profiler is not None:
                profiler.disable()
            return result

        setattr(owner, name, wrapper)
        return original

    originals = {"prepare_decode": timed(coordinator, "prepare_decode"), "alloc_decode": timed(allocator, "alloc_decode")}
    try:
        for _ in range(steps):
            server.step()
    finally:
        coordinator.prepare_decode = originals["prepare_decode"]
        allocator.alloc_decode = originals["alloc_decode"]
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    modes = [record.mode for record in coordinator.requests.values()]
    return (
        1e6 * statistics.median(spent["prepare_decode"]),
        1e6 * statistics.median(spent["alloc_decode"]),
        {"resident": modes.count(RESIDENT), "offloaded": modes.count(OFFLOADED)},
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--modes", nargs="+", default=["resident", "offloaded", "mixed"])
    parser.add_argument("--steps", type=int, default=60, help="timed decode steps per cell (median)")
    parser.add_argument("--out", default=os.environ.get("OUT", str(REPO / "benchmarks" / "results")))
    parser.add_argument("--profile", action="store_true",
                        help="print where prepare_decode's host time goes (cProfile of the kernels path, first cell)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_decode_step.py needs a CUDA GPU")
    gpu = torch.cuda.get_device_name()
    sets = op_sets()
    rows = []
    print(f"{gpu}: host time per decode step (median of {args.steps}), microseconds")
    print(f"{'bs':>4} {'mode':>9} {'resident/offloaded':>18} {'prepare (twins)':>15} {'prepare':>8} "
          f"{'alloc_decode':>12} {'prepare + alloc':>15}")
    for batch in args.batch:
        for mode in args.modes:
            cell = {"batch": batch, "mode": mode}
            for name, ops in sets.items():
                server = build(batch, mode, ops)
                time_step_work(server, 5)  # warm-up: compile, allocator caches
                cell[name], cell[f"alloc_decode ({name})"], cell["modes"] = time_step_work(server, args.steps)
                del server
                torch.cuda.empty_cache()
            cell["alloc_decode"] = cell["alloc_decode (kernels)"]
            cell["step_work"] = cell["kernels"] + cell["alloc_decode"]
            if args.profile and len(rows) == 0:
                import cProfile
                import pstats

                profiler = cProfile.Profile()
                server = build(batch, mode, sets["kernels"])
                time_step_work(server, 5)
                time_step_work(server, args.steps, profiler)
                pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
                del server
            rows.append(cell)
            split = f"{cell['modes']['resident']}/{cell['modes']['offloaded']}"
            print(f"{batch:>4} {mode:>9} {split:>18} {cell['torch twins']:>15.1f} {cell['kernels']:>8.1f} "
                  f"{cell['alloc_decode']:>12.1f} {cell['step_work']:>15.1f}")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.date.today().isoformat()
    tag = gpu.replace("NVIDIA ", "").split()[0]
    meta = {"gpu": gpu, "date": stamp, "torch": torch.__version__, "steps": args.steps, "layers": LAYERS,
            "prompt": PROMPT, "page_size": PAGE}
    (out / f"decode_step_{tag}_{stamp}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"# HiSparse host work per decode step ({gpu}, {stamp})", "",
             "| bs | mode | resident / offloaded | prepare_decode, torch twin (us) | prepare_decode (us) | "
             "alloc_decode (us) | prepare + alloc (us) |", "|---|---|---|---|---|---|---|"]
    for cell in rows:
        lines.append(f"| {cell['batch']} | {cell['mode']} | {cell['modes']['resident']} / {cell['modes']['offloaded']} | "
                     f"{cell['torch twins']:.1f} | {cell['kernels']:.1f} | {cell['alloc_decode']:.1f} | "
                     f"{cell['step_work']:.1f} |")
    (out / f"decode_step_{tag}_{stamp}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
