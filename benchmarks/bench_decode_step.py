"""Host time of HiSparse's per-step decode bookkeeping (``Coordinator.prepare_decode``).

Every decode step the scheduler calls ``prepare_decode`` (SGLang's ``map_last_loc_to_buffer``):
the eager backup of each request's previous token and the binding of each new token to a device
row. It runs on the scheduler's thread, so its host time adds to every step unless the forward
pass in flight is longer. This benchmark drives a simulated decode server on the GPU and prints,
per batch size and mode mix, the median host time of ``prepare_decode`` with the CUDA row kernels
(``backup_rows``/``bind_rows``, one launch each) and with their pure-torch twins (the reference
ops, a dozen small launches each), measured in the same run, and the ratio.

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
    from hisparse_sglang.ops import swap_in as cuda

    kernels = types.SimpleNamespace(
        swap_in=cuda.swap_in, copy_rows=cuda.copy_rows, backup_rows=cuda.backup_rows, bind_rows=cuda.bind_rows
    )
    twins = types.SimpleNamespace(
        swap_in=cuda.swap_in, copy_rows=cuda.copy_rows, backup_rows=reference.backup_rows, bind_rows=reference.bind_rows
    )
    return {"kernels": kernels, "torch twins": twins}


def build(batch: int, mode: str, ops) -> SimulatedServer:
    config = HiSparseConfig(
        top_k=TOP_K, device_buffer_size=BUFFER, page_size=PAGE, host_to_device_ratio=4,
        resident_first=mode != "offloaded", switch_cooldown_steps=1_000_000,
    )
    pages_per_request = -(-(PROMPT + 400) // PAGE)
    server = SimulatedServer(
        config, layer_num=LAYERS, item_bytes=ITEM_BYTES, device_pages=batch * pages_per_request + 64,
        max_reqs=batch + 1, max_context=PROMPT + 512, verify=False, ops=ops, device="cuda",
    )
    for _ in range(batch):
        if server.add_request(PROMPT, 400) is None:
            raise RuntimeError(f"could not admit {batch} requests of {PROMPT} tokens")
    server.step()
    if mode == "mixed":
        # demote every other request (the longest first): free what half of them hold beyond a buffer
        coordinator = server.coordinator
        record = next(iter(coordinator.requests.values()))
        gain = -(-record.seq_len // PAGE) - coordinator.buffer_pages
        coordinator.reclaim(coordinator.allocator.device_rows.free_pages + (batch // 2) * gain)
    server.step()
    return server


def time_prepare(server: SimulatedServer, steps: int, profiler=None) -> tuple[float, dict]:
    coordinator = server.coordinator
    original = coordinator.prepare_decode
    spent: list[float] = []

    def timed(*args, **kwargs):
        if profiler is not None:
            profiler.enable()
        started = time.perf_counter()
        original(*args, **kwargs)
        spent.append(time.perf_counter() - started)
        if profiler is not None:
            profiler.disable()

    coordinator.prepare_decode = timed
    try:
        for _ in range(steps):
            server.step()
    finally:
        coordinator.prepare_decode = original
    torch.cuda.synchronize()
    modes = [record.mode for record in coordinator.requests.values()]
    return 1e6 * statistics.median(spent), {"resident": modes.count(RESIDENT), "offloaded": modes.count(OFFLOADED)}


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
    print(f"{gpu}: host time of prepare_decode per step (median of {args.steps}), microseconds")
    print(f"{'bs':>4} {'mode':>9} {'resident/offloaded':>18} {'torch twins':>12} {'kernels':>9} {'kernels/twins':>14}")
    for batch in args.batch:
        for mode in args.modes:
            cell = {"batch": batch, "mode": mode}
            for name, ops in sets.items():
                server = build(batch, mode, ops)
                time_prepare(server, 5)  # warm-up: compile, allocator caches
                cell[name], cell["modes"] = time_prepare(server, args.steps)
                del server
                torch.cuda.empty_cache()
            cell["ratio"] = cell["kernels"] / cell["torch twins"]
            if args.profile and len(rows) == 0:
                import cProfile
                import pstats

                profiler = cProfile.Profile()
                server = build(batch, mode, sets["kernels"])
                time_prepare(server, 5)
                time_prepare(server, args.steps, profiler)
                pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
                del server
            rows.append(cell)
            split = f"{cell['modes']['resident']}/{cell['modes']['offloaded']}"
            print(f"{batch:>4} {mode:>9} {split:>18} {cell['torch twins']:>12.1f} {cell['kernels']:>9.1f} "
                  f"{cell['ratio']:>14.2f}")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.date.today().isoformat()
    tag = gpu.replace("NVIDIA ", "").split()[0]
    meta = {"gpu": gpu, "date": stamp, "torch": torch.__version__, "steps": args.steps, "layers": LAYERS,
            "prompt": PROMPT, "page_size": PAGE}
    (out / f"decode_step_{tag}_{stamp}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    lines = [f"# prepare_decode host time per step ({gpu}, {stamp})", "",
             "| bs | mode | resident / offloaded | torch twins (us) | kernels (us) | kernels / twins |", "|---|---|---|---|---|---|"]
    for cell in rows:
        lines.append(f"| {cell['batch']} | {cell['mode']} | {cell['modes']['resident']} / {cell['modes']['offloaded']} | "
                     f"{cell['torch twins']:.1f} | {cell['kernels']:.1f} | {cell['ratio']:.2f} |")
    (out / f"decode_step_{tag}_{stamp}.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
