"""Swap-in kernel benchmark: ours vs SGLang 0.5.17's in-tree kernel vs the PCIe gather floor.

One run on a GPU prints, for every batch size x miss rate x row size, the median time per call of
our kernel (with the hit/miss counters, as the coordinator calls it) and of SGLang's kernel on
identical inputs (best of --rounds rounds alternating the two), the floor (missed bytes /
scattered zero-copy gather bandwidth measured in the same run), the copy-only time (``copy_rows``
of exactly the cell's missed rows, known in advance: the data movement alone at that size, launch
included), the all-padding launch (``num_real_reqs`` = 0) and the ratios; writes JSON and
Markdown to --out (default $OUT or benchmarks/results).

    python benchmarks/bench_swap_in.py                       # the full table (embedded defaults)
    python benchmarks/bench_swap_in.py --batch 1 8 --miss 20 --sweep   # try splits/threads variants

SGLang's kernel comes from ``benchmarks/baseline`` (compiled from the installed sglang package by
build_sglang_kernel.py, never copied here); without it the table has no SGLang column.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import statistics
import sys

import torch

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "benchmarks" / "baseline"))

from hisparse_sglang.ops import swap_in as ours  # noqa: E402
from hisparse_sglang.testing.cases import make_case  # noqa: E402

TOP_K = 2048
BUFFER = 4096
PAGE = 64
SEQ_LEN = 8192
SPIN_CYCLES = 200_000  # about 100 us at H100/H200 clocks: longer than any host launch path


def warm_up(milliseconds: float = 100.0) -> None:
    """Keep the GPU busy long enough for its clocks to leave idle before timing."""
    torch.cuda._sleep(int(milliseconds * 1e-3 * 1.98e9))
    torch.cuda.synchronize()


def sm_clock_mhz() -> str:
    import subprocess

    try:
        return subprocess.run(
            ["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader,nounits"], capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        return "?"


def median_us(fn, reset, reps: int) -> float:
    """Median over `reps` of one call timed with CUDA events; `reset` runs outside the timing.

    A GPU-side spin before the start event keeps the GPU busy while the host enqueues the call,
    so the events time the kernel, not the host's launch latency.
    """
    times = []
    for _ in range(reps + 3):
        reset()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(SPIN_CYCLES)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0)
    return statistics.median(times[3:])


def host_us(fn, calls: int = 300) -> float:
    """Wall time per call of back-to-back calls (hit-only state): the host launch path when the
    kernel is shorter than it."""
    import time

    fn()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / calls * 1e6


def gather_bandwidth(row_bytes: int, total_bytes: int = 1 << 30) -> float:
    """GB/s of a large scattered gather of pinned host rows into device rows (one copy launch).

    The best over several grid sizes: the floor is what a plain gather can reach on this link.
    """
    rows = total_bytes // row_bytes
    host = torch.empty((rows * 2, row_bytes), dtype=torch.uint8).pin_memory()
    device = torch.empty((rows, row_bytes), dtype=torch.uint8, device="cuda")
    src = torch.randperm(rows * 2, device="cuda")[:rows]
    dst = torch.randperm(rows, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    best = 0.0
    for blocks in (sms // 2, sms, 2 * sms, 4 * sms):
        timings = []
        for _ in range(4):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            ours.copy_rows([host], [device], src, dst, max_blocks=blocks)
            end.record()
            end.synchronize()
            timings.append(start.elapsed_time(end) / 1000.0)
        best = max(best, rows * row_bytes / statistics.median(timings[1:]) / 1e9)
    return best


def memcpy_bandwidth(total_bytes: int = 1 << 30) -> float:
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


def unique_first(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct values and the index of each one's first occurrence."""
    distinct, inverse = torch.unique(values, return_inverse=True)
    order = torch.arange(values.numel(), device=values.device)
    first = torch.full((distinct.numel(),), values.numel(), dtype=torch.int64, device=values.device)
    first.scatter_reduce_(0, inverse, order, reduce="amin")
    return distinct, first


class Cell:
    """One (batch, miss rate, row size) case on the GPU, in both layouts."""

    def __init__(self, batch: int, miss_rate: float, row_bytes: int, seed: int, host_cache: dict):
        key = (batch, row_bytes)
        case = make_case(
            batch, TOP_K, BUFFER, row_bytes, page_size=PAGE, miss_rate=miss_rate, seq_len=SEQ_LEN,
            newest_fraction=0.0, newest_count=1, seed=seed, extra_slots=0, host_kv=host_cache.get(key),
        )
        if key not in host_cache:
            host_cache[key] = case.host_kv
        self.misses = case.expected_misses
        self.bytes = self.misses * row_bytes
        self.gpu = case.clone(device="cuda")
        pinned = host_cache.get(("pinned", batch, row_bytes))
        if pinned is None:
            pinned = case.host_kv.pin_memory()
            host_cache[("pinned", batch, row_bytes)] = pinned
        self.gpu.host_kv = pinned
        self.saved = [t.clone() for t in (self.gpu.slot_tokens, self.gpu.slot_stamps, self.gpu.token_slot)]
        self.out = torch.empty((batch, TOP_K), dtype=torch.int32, device="cuda")
        self.counters = torch.zeros(2, dtype=torch.int64, device="cuda")
        self._sglang_layout(case)

    def _sglang_layout(self, case) -> None:
        """The same state in SGLang's in-tree tables (indexed by request slot)."""
        slots = case.buffer_of_req.numel()
        padded = BUFFER + PAGE
        tokens = torch.full((slots, padded), -1, dtype=torch.int32)
        locs = torch.zeros((slots, padded), dtype=torch.int32)
        lru = torch.zeros((slots, BUFFER), dtype=torch.int16)
        for slot in range(slots):
            buffer = int(case.buffer_of_req[slot])
            if buffer >= 0:
                tokens[slot, :BUFFER] = case.slot_tokens[buffer]
                locs[slot] = case.slot_rows[buffer]
                # SGLang keeps an explicit order, least recently used first: ours by (stamp, slot).
                key = case.slot_stamps[buffer].to(torch.int64) * BUFFER + torch.arange(BUFFER)
                lru[slot] = torch.argsort(key).to(torch.int16)
        self.sg_tokens0, self.sg_lru0 = tokens.cuda(), lru.cuda()
        self.sg_tokens, self.sg_lru = tokens.cuda(), lru.cuda()
        self.sg_locs = locs.cuda()
        self.sg_host_locs = case.req_to_token.to(torch.int64).cuda()
        self.sg_out = torch.empty((case.top_k.shape[0], TOP_K), dtype=torch.int32, device="cuda")

    def reset_ours(self) -> None:
        for table, saved in zip((self.gpu.slot_tokens, self.gpu.slot_stamps, self.gpu.token_slot), self.saved):
            table.copy_(saved)

    def run_ours(self, splits=None, threads=None) -> None:
        # With the hit/miss counters, as the coordinator calls it in production.
        ours.swap_in(*self.gpu.args(), out=self.out, counters=self.counters, splits=splits, threads=threads)

    def copy_only(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Host and device rows of this cell's misses, from a call's outputs (run after one call).

        Copying exactly these rows with ``copy_rows`` (rows known in advance, one launch) is what
        the swap-in's data movement alone costs at this size: no lookups, no planning.
        """
        top_k = self.gpu.top_k.to(torch.int64)
        seq = self.gpu.seq_lens.reshape(-1, 1).to(torch.int64)
        slots = self.gpu.req_pool_indices.to(torch.int64)
        buffers = self.gpu.buffer_of_req[slots].to(torch.int64)
        token_slot0 = self.saved[2]
        src, dst = [], []
        for b in range(top_k.shape[0]):
            if int(buffers[b]) < 0:
                continue
            entries = top_k[b]
            valid = (entries >= 0) & (entries < seq[b] - 1)
            positions = entries.clamp(min=0)
            missed = valid & (token_slot0[buffers[b], positions] < 0)
            index = torch.nonzero(missed).flatten()
            tokens, first = unique_first(entries[index])
            src.append(self.gpu.req_to_token[slots[b], tokens])
            dst.append(self.out[b, index[first]])
        src = torch.cat(src).to(torch.int64) if src else torch.empty(0, dtype=torch.int64, device=top_k.device)
        dst = torch.cat(dst).to(torch.int64) if dst else torch.empty(0, dtype=torch.int64, device=top_k.device)
        if src.numel() != self.misses:
            raise AssertionError(f"copy-only rows {src.numel()} != the cell's misses {self.misses}")
        return src, dst

    def reset_sglang(self) -> None:
        self.sg_tokens.copy_(self.sg_tokens0)
        self.sg_lru.copy_(self.sg_lru0)

    def run_sglang(self, kernel) -> None:
        empty = torch.empty(0)
        kernel(
            self.gpu.top_k, self.sg_tokens, self.sg_host_locs, self.sg_locs, self.gpu.host_kv, empty,
            self.gpu.device_kv, empty, self.sg_out, self.gpu.req_pool_indices, self.gpu.seq_lens, self.sg_lru,
            self.gpu.num_real_reqs, 1, self.gpu.host_kv.shape[1],
        )

    def verify(self, out: torch.Tensor) -> None:
        """Every valid entry's row must hold its token's host bytes."""
        top_k = self.gpu.top_k
        valid = (top_k >= 0) & (top_k < self.gpu.seq_lens.reshape(-1, 1))
        rows = out[valid].to(torch.int64)
        slots = self.gpu.req_pool_indices.reshape(-1, 1).expand_as(top_k)[valid]
        host_rows = self.gpu.req_to_token[slots, top_k[valid].to(torch.int64)].to(torch.int64)
        newest = (top_k == self.gpu.seq_lens.reshape(-1, 1) - 1)[valid]
        got = self.gpu.device_kv[rows[~newest]].cpu()
        want = self.gpu.host_kv[host_rows[~newest].cpu()]
        if not torch.equal(got, want):
            raise AssertionError("a swap-in returned a row with the wrong KV")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    parser.add_argument("--miss", type=float, nargs="+", default=[0, 5, 20, 50, 100], help="miss rates in percent")
    parser.add_argument("--rows", type=int, nargs="+", default=[1152, 656])
    parser.add_argument("--reps", type=int, default=20, help="timed calls per round (median)")
    parser.add_argument("--rounds", type=int, default=5,
                        help="rounds alternating ours and SGLang's kernel; each reports its best round median")
    parser.add_argument("--sweep", action="store_true", help="also time splits/threads variants of our kernel")
    parser.add_argument("--out", default=os.environ.get("OUT", str(REPO / "benchmarks" / "results")))
    parser.add_argument("--define", nargs="*", default=[], metavar="NAME=VALUE",
                        help="compile our kernel with these -D macros (variant experiments; a separate cache entry)")
    parser.add_argument("--tag", default="", help="suffix of the output file names")
    args = parser.parse_args()
    if args.define:
        from hisparse_sglang.ops import jit

        jit._NVCC_FLAGS = (*jit._NVCC_FLAGS, *(f"-D{d}" for d in args.define))

    torch.cuda.init()
    properties = torch.cuda.get_device_properties(0)
    try:
        import sglang_kernel

        baseline = {row: sglang_kernel.load(row, TOP_K, BUFFER, 960) for row in args.rows}
    except Exception as exc:  # the SGLang column is optional; say why it is missing
        print(f"[bench] SGLang baseline unavailable: {exc}", flush=True)
        baseline = {}
    memcpy = memcpy_bandwidth()
    gather = {row: gather_bandwidth(row) for row in args.rows}
    print(f"[bench] {properties.name}: pinned H2D memcpy {memcpy:.1f} GB/s; scattered gather "
          + ", ".join(f"{row} B rows {bw:.1f} GB/s" for row, bw in gather.items()), flush=True)

    results = []
    host_cache: dict = {}
    for row_bytes in args.rows:
        for batch in args.batch:
            for miss in args.miss:
                cell = Cell(batch, miss / 100.0, row_bytes, seed=batch * 1000 + int(miss), host_cache=host_cache)
                cell.reset_ours()
                cell.run_ours()
                torch.cuda.synchronize()
                cell.verify(cell.out)
                kernel = baseline.get(row_bytes)
                if kernel is not None:
                    cell.reset_sglang()
                    cell.run_sglang(kernel)
                    torch.cuda.synchronize()
                    cell.verify(cell.sg_out)
                # Rounds alternate ours and SGLang's kernel; each keeps its best round median, so a
                # burst of interference on the shared host (seen on the device machines as 3-6x
                # slower medians of single cells) hits both or neither.
                ours_rounds, sglang_rounds = [], []
                for _ in range(args.rounds):
                    warm_up()
                    ours_rounds.append(median_us(cell.run_ours, cell.reset_ours, args.reps))
                    if kernel is not None:
                        sglang_rounds.append(
                            median_us(lambda: cell.run_sglang(kernel), cell.reset_sglang, args.reps)
                        )
                ours_us = min(ours_rounds)
                copy_us = None
                if cell.misses:
                    # Best over grid sizes and rounds, like the floor's bandwidth: the copy at its fastest.
                    src, dst = cell.copy_only()
                    sms = properties.multi_processor_count
                    copy_us = min(
                        median_us(lambda: ours.copy_rows([cell.gpu.host_kv], [cell.gpu.device_kv], src, dst,
                                                         max_blocks=blocks), lambda: None, args.reps)
                        for _ in range(args.rounds) for blocks in (sms // 2, sms, 4 * sms)
                    )
                record = {
                    "row_bytes": row_bytes, "batch": batch, "miss_percent": miss, "missed_rows": cell.misses,
                    "missed_bytes": cell.bytes, "ours_us": ours_us,
                    "splits": ours.choose_splits(batch, TOP_K, BUFFER, ours.DEFAULT_THREADS, torch.device("cuda")),
                    "floor_us": cell.bytes / (gather[row_bytes] * 1e9) * 1e6,
                    "ours_rounds_us": ours_rounds,
                }
                if copy_us is not None:
                    record["copy_only_us"] = copy_us
                if sglang_rounds:
                    record["sglang_us"] = min(sglang_rounds)
                    record["sglang_rounds_us"] = sglang_rounds
                if args.sweep:
                    variants = {}
                    for threads in (512, 1024):
                        resident = ours.resident_ctas(TOP_K, BUFFER, threads, torch.device("cuda"))
                        for splits in sorted({1, 2, 3, 5, 9, 17, 33, 65, record["splits"]}):
                            if splits > 1 and batch * splits > resident:
                                continue  # copiers wait for their planner: the grid must be co-resident
                            variants[f"t{threads}s{splits}"] = median_us(
                                lambda: cell.run_ours(splits, threads), cell.reset_ours, args.reps
                            )
                    record["variants_us"] = variants
                if miss == 0:
                    # The same launch with every row padding (num_real_reqs = 0): launch and prologue only.
                    real = cell.gpu.num_real_reqs.clone()
                    cell.gpu.num_real_reqs.zero_()
                    record["ours_padding_us"] = min(median_us(cell.run_ours, lambda: None, args.reps)
                                                    for _ in range(args.rounds))
                    cell.gpu.num_real_reqs.copy_(real)
                    record["ours_host_us"] = host_us(cell.run_ours)
                    if kernel is not None:
                        record["sglang_host_us"] = host_us(lambda: cell.run_sglang(kernel))
                record["sm_clock_mhz_after"] = sm_clock_mhz()
                results.append(record)
                print(format_row(record), flush=True)
                del cell
            torch.cuda.empty_cache()

    table = markdown(results, properties.name, memcpy, gather, args.rounds)
    print(table)
    out_dir = pathlib.Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    name = f"swap_in_{properties.name.replace(' ', '_')}_{stamp}{args.tag}"
    (out_dir / f"{name}.json").write_text(json.dumps({
        "gpu": properties.name, "date": stamp, "torch": torch.__version__, "defines": args.define, "memcpy_gbps": memcpy,
        "gather_gbps": gather, "top_k": TOP_K, "buffer": BUFFER, "seq_len": SEQ_LEN, "results": results,
    }, indent=1))
    (out_dir / f"{name}.md").write_text(table)
    return 0


def format_row(r: dict) -> str:
    sglang = f"{r['sglang_us']:8.1f}" if "sglang_us" in r else "     n/a"
    vs = f"{r['ours_us'] / r['sglang_us']:6.2f}" if "sglang_us" in r else "   n/a"
    floor = f"{r['ours_us'] / r['floor_us']:6.3f}" if r["floor_us"] > 0 else "     -"
    extra = ""
    if "ours_host_us" in r:
        extra += f" host/call ours {r['ours_host_us']:.1f} us sglang {r.get('sglang_host_us', float('nan')):.1f} us"
    if "variants_us" in r:
        best = min(r["variants_us"], key=r["variants_us"].get)
        extra = f" best {best} {r['variants_us'][best]:.1f}"
    if "ours_padding_us" in r:
        extra += f" all-padding launch {r['ours_padding_us']:.1f} us"
    copy = f"{r['copy_only_us']:8.1f} us ours/copy {r['ours_us'] / r['copy_only_us']:6.3f}" if "copy_only_us" in r else "       - us"
    extra += f" clock {r.get('sm_clock_mhz_after', '?')} MHz"
    return (f"row {r['row_bytes']:5d} bs {r['batch']:4d} miss {r['miss_percent']:5.1f}% | ours {r['ours_us']:8.1f} us "
            f"(splits {r['splits']}) | sglang {sglang} us | copy-only {copy} | floor {r['floor_us']:8.1f} us | "
            f"ours/floor {floor} | ours/sglang {vs}{extra}")


def markdown(results: list, gpu: str, memcpy: float, gather: dict, rounds: int) -> str:
    lines = [
        f"# Swap-in kernel: {gpu}, {datetime.date.today().isoformat()}",
        "",
        f"top_k {TOP_K}, device_buffer_size {BUFFER}, seq_len {SEQ_LEN}; median of CUDA-event-timed single calls, "
        f"state reset outside the timed region; best of "
        f"{rounds} rounds that alternate the two kernels. Floor = missed bytes / scattered zero-copy gather bandwidth "
        f"measured in the same run ({', '.join(f'{k} B rows: {v:.1f} GB/s' for k, v in gather.items())}; "
        f"pinned H2D memcpy {memcpy:.1f} GB/s).",
        "",
        "Copy-only = `copy_rows` of exactly the cell's missed rows (host and device rows known in advance, one "
        "launch, same timing, best of three grid sizes): the data movement alone at that size, launch included. "
        "All-padding = our launch "
        "with `num_real_reqs` = 0 (launch and prologue only), in the 0 % rows.",
        "",
        "| row B | batch | miss % | ours µs | SGLang µs | copy-only µs | floor µs | ours / copy-only | ours / floor "
        "| ours / SGLang |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        sglang = f"{r['sglang_us']:.1f}" if "sglang_us" in r else "n/a"
        vs = f"{r['ours_us'] / r['sglang_us']:.2f}" if "sglang_us" in r else "n/a"
        floor = f"{r['ours_us'] / r['floor_us']:.3f}" if r["floor_us"] > 0 else "-"
        if "copy_only_us" in r:
            copy, vs_copy = f"{r['copy_only_us']:.1f}", f"{r['ours_us'] / r['copy_only_us']:.3f}"
        else:
            copy = f"all-padding {r['ours_padding_us']:.1f}" if "ours_padding_us" in r else "-"
            vs_copy = "-"
        lines.append(
            f"| {r['row_bytes']} | {r['batch']} | {r['miss_percent']:g} | {r['ours_us']:.1f} | {sglang} | "
            f"{copy} | {r['floor_us']:.1f} | {vs_copy} | {floor} | {vs} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
