"""The storm phase: how long one decoding request stalls while a burst of long requests arrives."""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from client import make_prompt
from common import Run
from logs import file_size, parse_prefill_lines, read_from, summarize_hisparse, summarize_log
from phases import warm_up
from stats import pct

STORM_TPOT_FROM = 20  # the storm's TPOT before the burst: gaps of tokens STORM_TPOT_FROM+1 .. --storm-after-tokens


def stream_chunks(arrivals: list) -> list[tuple[float, float, int, int]]:
    """Chunks of a streamed request as (t_prev, t, first_token, tokens), from its arrivals
    [(time, cumulative tokens), ...].  The first arrival has no gap (its tokens come after the
    TTFT) and starts nothing; an arrival that adds no token is skipped.  Tokens are numbered from 1."""
    out, prev_t, prev_n = [], None, 0
    for t, n in arrivals:
        n = int(n)
        if n <= prev_n:
            continue
        if prev_t is not None:
            out.append((float(prev_t), float(t), prev_n + 1, n - prev_n))
        prev_t, prev_n = t, n
    return out


def storm_gap_stats(arrivals: list, window: tuple[float, float] | None, tpot_from: int, tpot_to: int,
                    min_gaps: int = 3) -> dict:
    """Stall statistics of a decoding request from its token arrival times.

    A chunk of k tokens that arrives G seconds after the previous one gives each of its tokens the
    gap G/k (the stream does not say when within G each was made).  tpot_before_ms: median gap of
    tokens tpot_from+1 .. tpot_to.  A chunk is in `window` (start, end) if its interval
    (t_prev, t] overlaps it; over those chunks: max_gap_ms (longest time without a token, G),
    p99_gap_ms (per-token gaps), gaps_over_2x (tokens whose gap exceeds 2x tpot_before), stall_ms
    (sum of max(0, G - k * tpot_before), the time lost against the pace before).  tpot_after_ms:
    median gap of the chunks that start at or after the window's end.  A figure that would rest on
    fewer than `min_gaps` gaps (or on a missing tpot_before or window) is None."""
    chunks = stream_chunks(arrivals)

    def per_token(sel) -> list[float]:
        return [g for (t0, t1, _, k) in sel for g in [(t1 - t0) / k] * k]

    def median_ms(gaps: list[float]) -> float | None:
        return round(1000 * statistics.median(gaps), 3) if len(gaps) >= min_gaps else None

    before = [(t1 - t0) / k for (t0, t1, first, k) in chunks for j in range(first, first + k)
              if tpot_from < j <= tpot_to]
    tpot = median_ms(before)
    out = {"tokens": max((int(n) for _, n in arrivals), default=0), "chunks": len(chunks),
           "multi_token_chunks": sum(1 for c in chunks if c[3] > 1), "tpot_before_ms": tpot,
           "tpot_before_gaps": len(before), "window_s": None, "window_tokens": 0, "max_gap_ms": None,
           "p99_gap_ms": None, "gaps_over_2x": None, "stall_ms": None, "tpot_after_ms": None}
    if window is None:
        return out
    w0, w1 = window
    out["window_s"] = round(w1 - w0, 4)
    inside = [c for c in chunks if c[1] > w0 and c[0] < w1]
    gaps = per_token(inside)
    out["window_tokens"] = len(gaps)
    if inside:
        out["max_gap_ms"] = round(1000 * max(t1 - t0 for (t0, t1, _, _) in inside), 3)
    if len(gaps) >= min_gaps:
        out["p99_gap_ms"] = round(1000 * pct(gaps, 0.99), 3)
    if tpot is not None and inside:
        out["gaps_over_2x"] = sum(1 for g in gaps if 1000 * g > 2 * tpot)
        out["stall_ms"] = round(sum(max(0.0, 1000 * (t1 - t0) - k * tpot) for (t0, t1, _, k) in inside), 3)
    out["tpot_after_ms"] = median_ms(per_token([c for c in chunks if c[0] >= w1]))
    return out


def storm_burst(target, prompts: list[list[int]], out_len: int, timeout: float) -> tuple[ThreadPoolExecutor, list, list]:
    """Start the burst: one thread per prompt, released together by a barrier.  Every row gets
    start/end (perf_counter), finish or error, and log_end (server log size right after it ended)."""
    n = len(prompts)
    barrier = threading.Barrier(n)
    rows: list[dict] = [{} for _ in range(n)]

    def worker(i: int) -> None:
        with contextlib.suppress(threading.BrokenBarrierError):
            barrier.wait(timeout=30)
        row = rows[i]
        row["start"] = time.perf_counter()
        try:
            out = target.endpoint.generate(prompts[i], out_len, rid=f"storm-{target.arm}-{i}", timeout=timeout)
            fin = out.get("meta_info", {}).get("finish_reason")
            row.update(finish=fin.get("type") if isinstance(fin, dict) else fin, tokens=len(out.get("output_ids") or []))
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"[:200]
        row["end"] = time.perf_counter()
        row["log_end"] = file_size(target.log_path)

    pool = ThreadPoolExecutor(max_workers=n)
    futs = [pool.submit(worker, i) for i in range(n)]
    return pool, futs, rows


def phase_storm(target, run: Run) -> dict:
    """R0 streams; once it has --storm-after-tokens tokens, --storm-requests long requests arrive at once.
    The window is [first burst request sent, last burst request done]; R0's token gaps in it are
    compared with its pace before (storm_gap_stats), the server log of the window is parsed."""
    args, dl, log = run.args, run.deadline, run.log
    L, O, K = args.storm_input_len, args.storm_output_len, args.storm_after_tokens
    B, OB = args.storm_requests, args.storm_burst_output_len
    res: dict = {"input_len": L, "output_len": O, "after_tokens": K, "requests": B, "burst_output_len": OB,
                 "tpot_from_token": STORM_TPOT_FROM, "timed_out": False}
    budget = min(args.storm_timeout, dl.left() - args.reserve_s - 15)
    if budget < 20:
        res["skipped"] = "deadline"
        return res
    warm = warm_up(target, run, 98, L)
    if warm is not None:
        res["warmup_s"] = warm
    t_end = time.monotonic() + budget
    r0_ids = make_prompt(400_000, L, run.vocab)
    burst_prompts = [make_prompt(400_001 + i, L, run.vocab) for i in range(B)]
    fired, r0_done = threading.Event(), threading.Event()
    r0: dict = {}

    def on_tokens(n: int) -> None:
        if n >= K:
            fired.set()

    def run_r0() -> None:
        try:
            r0.update(target.endpoint.generate_stream(r0_ids, O, timeout=budget + 30, trace=True, on_tokens=on_tokens))
        finally:
            r0_done.set()

    r0_thread = threading.Thread(target=run_r0, name="storm-r0", daemon=True)
    r0_thread.start()
    while not fired.is_set() and not r0_done.is_set() and time.monotonic() < t_end:
        fired.wait(0.05)
        target.check()
    pool, futs, rows = None, [], []
    log_start = file_size(target.log_path)
    try:
        if fired.is_set():
            pool, futs, rows = storm_burst(target, burst_prompts, OB, timeout=max(10.0, t_end - time.monotonic() + 30))
            while not (r0_done.is_set() and all(f.done() for f in futs)) and time.monotonic() < t_end:
                time.sleep(0.05)
                target.check()
        else:
            r0_done.wait(max(0.0, t_end - time.monotonic()))
            res["error"] = (f"R0 ended after {r0.get('tokens')} tokens, before {K} ({r0.get('error')})"
                            if r0_done.is_set() else f"R0 did not reach {K} tokens in {budget:.0f}s")
        if not (r0_done.is_set() and all(f.done() for f in futs)):
            res["timed_out"] = True
            log(f"  storm: not done after {budget:.0f}s: aborting all requests")
            with contextlib.suppress(Exception):
                target.endpoint.abort_all()
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=False)
        r0_thread.join(timeout=60)
    res.update(storm_summary(r0, rows, K, target.log_path, log_start))
    log(f"  storm: TPOT before {res.get('tpot_before_ms')} ms, in the {res.get('window_s')}s window max gap "
        f"{res.get('max_gap_ms')} ms, p99 {res.get('p99_gap_ms')} ms, stall {res.get('stall_ms')} ms, "
        f"{res.get('gaps_over_2x')} gaps > 2x, TPOT after {res.get('tpot_after_ms')} ms; burst latency median "
        f"{res.get('burst_latency_s_median')} s max {res.get('burst_latency_s_max')} s, {res.get('burst_ok')}/{B} ok; "
        f"{res.get('prefill_batches_window')} prefill batches; HiSparse {res.get('hisparse_window')}"
        + (" (TIMED OUT)" if res["timed_out"] else ""))
    return res


def storm_summary(r0: dict, rows: list[dict], after_tokens: int, log_path: Path, log_start: int) -> dict:
    """Figures of a storm run: R0's gaps (storm_gap_stats), the burst's latencies, the server log
    of the window (from the burst's start to the end of its last request) and after the burst start."""
    arrivals, t0 = r0.get("arrivals") or [], r0.get("t0")
    started = [r for r in rows if "start" in r and "end" in r]
    window = (min(r["start"] for r in started), max(r["end"] for r in started)) if started else None
    out = storm_gap_stats(arrivals, window, STORM_TPOT_FROM, after_tokens)
    lat = [r["end"] - r["start"] for r in started if "error" not in r]
    out.update({
        "r0": {"tokens": r0.get("tokens"), "finish": r0.get("finish"), "error": r0.get("error"),
               "ttft_s": round(r0["ttft_s"], 3) if r0.get("ttft_s") is not None else None,
               "tokens_at_burst": max((n for t, n in arrivals if t < window[0]), default=0) if window else None,
               # [ms since R0 was sent, cumulative tokens] per chunk, for a later look at the timeline
               "arrivals_ms": [[round(1000 * (t - t0), 3), n] for t, n in arrivals] if t0 is not None else []},
        "window_start_ms": round(1000 * (window[0] - t0), 3) if window and t0 is not None else None,
        "burst_ok": len(lat),
        "burst_errors": sorted({r["error"] for r in rows if "error" in r})[:3],
        "burst_finish": {k: sum(1 for r in rows if str(r.get("finish")) == k) for k in sorted({str(r.get("finish")) for r in rows})},
        "burst_start_spread_ms": round(1000 * (max(r["start"] for r in started) - window[0]), 3) if started else None,
        "burst_latency_s_median": round(statistics.median(lat), 3) if lat else None,
        "burst_latency_s_max": round(max(lat), 3) if lat else None,
    })
    log_end = max(started, key=lambda r: r["end"])["log_end"] if started else log_start
    text_window = read_from(log_path, log_start, log_end)
    pre = parse_prefill_lines(text_window)
    out.update({
        "prefill_batches_window": len(pre) if started else None,
        "prefill_tokens_window": sum(x["new_token"] for x in pre) if started else None,
        "retracted_reqs_window": summarize_log(text_window)["retracted_reqs"] if started else None,
        # the plugin logs once per decode-log interval and decoding nearly stops during the burst,
        # so the window may hold no HiSparse line; the lines after it (to the end of R0) cover it
        "hisparse_window": summarize_hisparse(text_window),
        "hisparse_after_burst_start": summarize_hisparse(read_from(log_path, log_start)) if started else None,
    })
    return out
