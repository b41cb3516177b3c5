"""The PD phases (issue #15) and the evidence of where the transferred KV lands.

longprompt  (PD arms) one prompt longer than the decode instance's GPU KV pool (--long-len, default 48K
            against a --pd-decode-max-total-tokens 40960 pool): admitted and decoded, or what the arm
            does instead; the decode log's HiSparse line (host and device rows in use) and the GPU memory
            of each instance (nvidia-smi) before, during and after the request.
saturation  (any arm) time per output token at concurrency 1 (--sat-tpot-repeats requests, one at a
            time) and --sat-requests requests at once (--sat-input-len + --sat-output-len): the most
            running at once (/v1/loads of the decode instance and its log), client output tok/s, the
            server log's decode throughput while at least 90 % of that many ran.

pd_evidence() states, from the logs and these phases, whether the KV the prefill sent landed in host
memory of the decode instance without passing through its GPU."""

from __future__ import annotations

import contextlib
import statistics
import subprocess
import threading
import time

from arms import PD_ARMS
from client import finish_type, make_prompt
from common import Run
from logs import file_size, parse_decode_lines, read_from, summarize_log
from phases import run_level, warm_up
from servers import group_pids

LONG_PROMPT_SEED = 800_000


def gpu_memory_mib(servers) -> dict:
    """GPU memory (MiB) of each server's processes (nvidia-smi per process; None where the container
    does not show them) and of the whole GPU."""
    out: dict = {}
    try:
        apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=20).stdout
        used = {int(p): int(m) for p, m in (line.split(",") for line in apps.strip().splitlines() if "," in line)}
        for srv in servers:
            pids = group_pids(srv.proc.pid) if srv.proc else []
            mine = [used[p] for p in pids if p in used]
            out[srv.name] = sum(mine) if mine else None
        total = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                               capture_output=True, text=True, timeout=20).stdout.split()
        out["gpu_total"] = int(total[0]) if total else None
    except (OSError, ValueError, subprocess.SubprocessError) as e:
        out["error"] = f"{type(e).__name__}: {e}"
    return out


class Sampler:
    """Calls `fn` every `period` seconds in a thread until stop(); keeps (seconds since start, result)."""

    def __init__(self, fn, period: float):
        self.fn, self.period, self.samples = fn, period, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._t0 = time.monotonic()
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            with contextlib.suppress(Exception):
                self.samples.append((round(time.monotonic() - self._t0, 2), self.fn()))

    def stop(self) -> list:
        self._stop.set()
        self._thread.join(timeout=30)
        return self.samples


def phase_longprompt(target, run: Run, device_pool: int | None) -> dict:
    args, log = run.args, run.log
    L, O = args.long_len, args.long_out
    res = {"input_len": L, "output_len": O, "decode_device_pool_tokens": device_pool,
           "longer_than_device_pool": (L > device_pool) if device_pool else None}
    if target.arm not in PD_ARMS:
        res["not_applicable"] = "a co-located server prefills into its GPU KV pool; the test is for a PD decode instance"
        return res
    off = file_size(target.log_path)
    before = gpu_memory_mib(target.servers)
    sampler = Sampler(lambda: gpu_memory_mib(target.servers), 1.0)
    t0 = time.perf_counter()
    try:
        out = target.endpoint.generate(make_prompt(LONG_PROMPT_SEED, L, run.vocab), O, rid=f"long-{target.arm}",
                                       timeout=args.long_timeout)
        ids = out.get("output_ids") or []
        fin = out.get("meta_info", {}).get("finish_reason")
        res.update(tokens=len(ids), finish_reason=fin, prefill_error=out.get("prefill_error"),
                   admitted_and_decoded=finish_type(out) == "length" and len(ids) == O)
        if finish_type(out) == "abort":
            res["error"] = str(fin)[:1000]
    except Exception as e:
        res.update(admitted_and_decoded=False, error=f"{type(e).__name__}: {e}"[:1000])
    res["e2e_s"] = round(time.perf_counter() - t0, 2)
    samples = sampler.stop()
    seg = summarize_log(read_from(target.log_path, off))
    res["decode_log"] = {"hisparse": seg["hisparse"], "max_running": seg["max_running"],
                         "retracted_reqs": seg["retracted_reqs"], "input_too_long": seg["input_too_long"]}
    res["gpu_memory_mib"] = {"before": before, "after": gpu_memory_mib(target.servers),
                             "max_during": {k: max((s.get(k) or 0 for _, s in samples), default=None)
                                            for k in before if k != "error"}}
    log(f"  longprompt {L}+{O} on a {device_pool}-token decode GPU pool: admitted and decoded "
        f"{res['admitted_and_decoded']} ({res.get('tokens')} tokens in {res['e2e_s']} s) {res.get('error') or ''}; "
        f"HiSparse {seg['hisparse']}; GPU MiB {res['gpu_memory_mib']}")
    return res


def phase_saturation(target, run: Run, keep) -> dict:
    """keep(partial result) is called after each measurement."""
    args, dl, log = run.args, run.deadline, run.log
    L, O, N = args.sat_input_len, args.sat_output_len, args.sat_requests
    res: dict = {"input_len": L, "output_len": O, "requests": N}
    warm = warm_up(target, run, 96, L)
    if warm is not None:
        res["warmup_s"] = warm
    runs = []
    for i in range(args.sat_tpot_repeats):
        if dl.left() < args.reserve_s + 20:
            res["skipped_rest"] = "deadline"
            return res
        timeout = max(20.0, min(args.sat_timeout, dl.left() - args.reserve_s))
        row = run_level(target, [make_prompt(900_000 + i, L, run.vocab)], O, timeout)
        runs.append({k: row[k] for k in ("ok", "errors", "tpot_ms_median", "ttft_s_median", "output_tok_s",
                                         "log_gen_tput_median", "hisparse_step_host_ms_median")})
        log(f"  saturation: concurrency 1, run {i + 1}: TPOT {row['tpot_ms_median']} ms, TTFT {row['ttft_s_median']} s")
    tpots = [r["tpot_ms_median"] for r in runs if r["ok"] and r["tpot_ms_median"]]
    res["concurrency_1"] = {"runs": runs, "tpot_ms": round(statistics.median(tpots), 3) if tpots else None,
                            "tpot_ms_min": min(tpots, default=None), "tpot_ms_max": max(tpots, default=None)}
    keep(res)
    if dl.left() < args.reserve_s + 30:
        res["skipped_rest"] = "deadline"
        return res
    off = file_size(target.log_path)
    sampler = Sampler(target.endpoint.loads, 0.5)
    timeout = max(30.0, min(args.sat_timeout, dl.left() - args.reserve_s))
    row = run_level(target, [make_prompt(910_000 + i, L, run.vocab) for i in range(N)], O, timeout)
    samples = [(t, int(ld.get("num_running_reqs", 0))) for t, ld in sampler.stop() if ld]
    decode_lines = parse_decode_lines(read_from(target.log_path, off))
    most = max([r for _, r in samples] + [d["running"] for d in decode_lines] + [0])
    full = [d["gen_tput"] for d in decode_lines if d["running"] >= 0.9 * most and d["gen_tput"] > 0]
    res["saturated"] = {k: row[k] for k in ("ok", "errors", "wall_s", "output_tokens", "output_tok_s", "tpot_ms_median",
                                            "tpot_ms_p90", "ttft_s_median", "ttft_s_max", "log_gen_tput_median",
                                            "log_max_running", "retracted_reqs", "hisparse_step_host_ms_median",
                                            "hisparse_offloaded_max")}
    res["saturated"].update(max_running=most, max_running_loads=max((r for _, r in samples), default=None),
                            log_gen_tput_at_max=round(statistics.median(full), 1) if full else None,
                            log_lines_at_max=len(full), loads_samples=samples[-200:])
    log(f"  saturation: {N} x {L}+{O} at once: at most {most} running, {row['output_tok_s']} out tok/s (client), "
        f"{res['saturated']['log_gen_tput_at_max']} tok/s (server log, at >= 90 % of the most running), "
        f"TPOT median {row['tpot_ms_median']} ms, ok {row['ok']}/{N}")
    return res


def pd_evidence(result: dict) -> dict:
    """Where the prefill's KV writes land on the decode instance, from the fixture's registration record
    (the regions SGLang's Mooncake manager registered and their memory kind), the decode GPU pool size
    and the long prompt; `statements` says what follows and what does not."""
    decode_log = (result.get("logs") or {}).get("decode") or {}
    prefill_log = (result.get("logs") or {}).get("prefill") or {}
    reg = decode_log.get("pd_register")
    long = result.get("longprompt") or {}
    out = {"decode_registered": reg, "prefill_registered": prefill_log.get("pd_register"),
           "decode_device_pool_tokens": decode_log.get("max_total_num_tokens")}
    statements = []
    if reg:
        kv = reg.get("kv") or {}
        kinds = kv.get("by_kind") or {}
        out["kv_regions_host_only"] = bool(kinds) and set(kinds) == {"host"}
        item = (reg.get("kv_item_bytes") or [0])[0]
        if kv.get("regions") and item:
            # each KV region is one layer; an item is one page of 64 rows
            out["kv_rows_per_layer"] = kv["bytes"] // kv["regions"] // (item // 64)
        statements.append(
            f"The decode instance registered {kv.get('regions')} KV regions ({kv.get('bytes', 0) / 2**30:.2f} GiB) with "
            f"Mooncake as the destinations of the prefill's writes; the CUDA driver classifies their bytes as "
            f"{kinds} (host = pinned host memory). Mooncake writes only into registered regions.")
        state = reg.get("state") or []
        if state:
            statements.append(f"Index-K (state) regions: {[s.get('by_kind') for s in state]}.")
    else:
        statements.append("No registration record in the decode log (fixture trace missing): no claim about the KV regions.")
    pool = out["decode_device_pool_tokens"]
    if long.get("admitted_and_decoded") and pool and long.get("input_len", 0) > pool:
        hs = (long.get("decode_log") or {}).get("hisparse") or {}
        statements.append(
            f"A {long['input_len']}-token prompt was decoded by a decode instance whose GPU KV pool holds {pool} tokens: "
            f"its KV cannot have been in that pool"
            + (f"; the plugin's log line counted up to {hs.get('host_rows_used_max')} host rows and "
               f"{hs.get('device_rows_used_max')} device rows in use." if hs else "."))
    elif long and not long.get("not_applicable"):
        statements.append(f"The {long.get('input_len')}-token prompt was not decoded: {long.get('error') or long.get('finish_reason')}.")
    mem = long.get("gpu_memory_mib") or {}
    decode_name = next((k for k in (mem.get("before") or {}) if k.endswith("-decode")), None)
    peak = (mem.get("max_during") or {}).get(decode_name) if decode_name else None
    if peak is not None and (mem.get("before") or {}).get(decode_name) is not None:
        grew = peak - mem["before"][decode_name]
        out["decode_gpu_growth_mib"] = grew
        statements.append(f"GPU memory of the decode process grew by {grew} MiB during the long prompt (nvidia-smi, "
                          "sampled every second; SGLang preallocates its pools, so this alone proves little).")
    out["statements"] = statements
    return out
