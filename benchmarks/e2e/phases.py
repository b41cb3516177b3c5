"""The measuring phases of one arm: preflight (no server), correctness, capacity, throughput.

Every phase that needs a server takes a *target*: an object with `arm`, `endpoint` (client.Colocated
or a PD pair: generate, generate_stream, loads, abort_all), `check()` (raises if a server died) and
`log_path` (the log of the server that decodes)."""

from __future__ import annotations

import contextlib
import json
import statistics
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

from client import extract_logprobs, make_prompt, spec_meta, spec_summary
from common import HERE, REPO, Run
from environment import mooncake_env
from logs import file_size, read_from, summarize_log
from servers import ServerDied
from stats import compare_outputs, detect_cycle, pct, steady_window, window_chunks

PREFLIGHT_CODE = r"""
import importlib, importlib.metadata as md, json, platform, sys, time
out = {"python": sys.version.split()[0], "platform": platform.platform(), "glibc": platform.libc_ver()[1]}
vers = {}
for d in ["torch", "triton", "sglang", "sglang-kernel", "flashinfer-python", "sgl-deep-gemm",
          "apache-tvm-ffi", "transformers", "tokenizers", "xgrammar", "numpy", "huggingface-hub"]:
    try: vers[d] = md.version(d)
    except Exception as e: vers[d] = None
out["versions"] = vers
imports = {}
for m in ["torch", "sgl_kernel", "flashinfer", "deep_gemm", "tvm_ffi", "transformers", "xgrammar",
          "sglang.srt.server_args"]:
    t = time.time()
    try:
        mod = importlib.import_module(m); imports[m] = {"ok": True, "s": round(time.time() - t, 1), "file": getattr(mod, "__file__", None)}
    except Exception as e:
        imports[m] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:400]}
out["imports"] = imports
try:
    import torch
    out["cuda"] = {"torch_cuda": torch.version.cuda, "device": torch.cuda.get_device_name(0),
                   "capability": list(torch.cuda.get_device_capability(0)),
                   "mem_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)}
except Exception as e:
    out["cuda"] = {"error": str(e)}
print("PREFLIGHT_JSON=" + json.dumps(out))
"""


def phase_preflight(run: Run, env0: dict, env_info: dict) -> dict:
    args, log = run.args, run.log
    res = {"env": env_info}
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                            "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
        res["gpu"] = [s.strip() for s in q.stdout.strip().splitlines()]
    except Exception as e:
        res["gpu"] = [f"nvidia-smi failed: {e}"]
    env = dict(env0)
    env["PYTHONPATH"] = str(args.site)
    try:
        p = subprocess.run([args.python, "-c", PREFLIGHT_CODE], env=env, capture_output=True, text=True,
                           timeout=args.preflight_timeout, cwd=str(REPO))
        line = next((ln for ln in p.stdout.splitlines() if ln.startswith("PREFLIGHT_JSON=")), None)
        if line:
            res.update(json.loads(line.split("=", 1)[1]))
        else:
            res["error"] = f"rc={p.returncode}: {(p.stderr or p.stdout)[-1500:]}"
    except subprocess.TimeoutExpired:
        res["error"] = f"preflight timed out after {args.preflight_timeout}s"
    if args.preflight_mooncake:
        res["mooncake"] = mooncake_preflight(run, env0)
    bad = [m for m, v in res.get("imports", {}).items() if not v.get("ok")]
    res["ok"] = not bad and "error" not in res and (res.get("mooncake") or {"ok": True})["ok"]
    for m in bad:
        log(f"  preflight: import {m} FAILED: {res['imports'][m].get('error')}")
    log(f"  preflight: gpu={res.get('gpu')} cuda={res.get('cuda')} versions={res.get('versions')}")
    return res


def mooncake_preflight(run: Run, env0: dict) -> dict:
    """mooncake_check.py in the PD servers' environment: the engine imports, initialises over TCP on
    127.0.0.1 and moves bytes host->host and GPU->host; SGLang's connector imports."""
    args, log = run.args, run.log
    env = mooncake_env(env0, args)
    env["PYTHONPATH"] = str(args.site)
    try:
        p = subprocess.run([args.python, str(HERE / "mooncake_check.py"), "--connector"], env=env, capture_output=True,
                           text=True, timeout=args.preflight_timeout, cwd=str(REPO))
        line = next((ln for ln in p.stdout.splitlines() if ln.startswith("MOONCAKE_JSON=")), None)
        res = json.loads(line.split("=", 1)[1]) if line else {"ok": False, "error": f"rc={p.returncode}"}
        if not res.get("ok"):
            res["stderr_tail"] = (p.stderr or "")[-3000:]
    except subprocess.TimeoutExpired:
        res = {"ok": False, "error": f"timed out after {args.preflight_timeout}s"}
    log(f"  preflight mooncake: {'ok' if res.get('ok') else 'FAILED'}: version {res.get('version')}, init rc "
        f"{res.get('initialize_rc')}, host->host {res.get('host_to_host')}, GPU->host {res.get('gpu_to_host')}, "
        f"connector {res.get('connector_import')}, libraries {res.get('loaded')}"
        + ("" if res.get("ok") else f"; {res.get('import_error') or res.get('error') or ''}\n{res.get('stderr_tail', '')}"))
    return res


def correctness_prompts(args, vocab: int) -> list[dict]:
    prompts = []
    for n in args.corr_lens:
        for s in range(args.corr_seeds):
            seed = 1000 + 17 * n + s
            prompts.append({"id": f"len{n}-seed{s}", "len": n, "seed": seed})
    if args.corr_pair_len:
        # two prompts with IDENTICAL last `tail` tokens but different prefixes: identical outputs
        # mean the far context does not matter (then the comparison says little about attention)
        n = args.corr_pair_len
        tail = min(512, n // 4)
        prompts.append({"id": f"pair{n}-A", "len": n, "seed": 7001, "tail_seed": 7777, "tail": tail})
        prompts.append({"id": f"pair{n}-B", "len": n, "seed": 7002, "tail_seed": 7777, "tail": tail})
    for p in prompts:
        ids = make_prompt(p["seed"], p["len"], vocab)
        if "tail" in p:
            ids[-p["tail"]:] = make_prompt(p["tail_seed"], p["tail"], vocab)
        p["ids"] = ids
    return prompts


def phase_correctness(target, run: Run, keep) -> dict:
    """keep(partial result) is called after every prompt, so that a run cut short keeps what it measured."""
    args, dl, log = run.args, run.deadline, run.log
    res = {"max_new_tokens": args.corr_out, "prompts": []}
    for p in correctness_prompts(args, run.vocab):
        if dl.left() < args.reserve_s + 20:
            res["skipped_rest"] = "deadline"
            break
        target.check()
        t0 = time.perf_counter()
        row = {"id": p["id"], "len": p["len"], "seed": p["seed"]}
        try:
            out = target.endpoint.generate(p["ids"], args.corr_out, logprobs=True, rid=f"corr-{target.arm}-{p['id']}",
                                           timeout=max(30.0, dl.left() - args.reserve_s))
            meta = out.get("meta_info", {})
            lps, top = extract_logprobs(meta)
            ids = list(out.get("output_ids") or [])
            margins = [t[0][1] - t[1][1] for t in top if t and len(t) > 1 and None not in (t[0][1], t[1][1])]
            row.update({"output_ids": ids, "logprobs": lps, "top": top,
                        "finish_reason": meta.get("finish_reason"), **spec_meta(meta),
                        "e2e_s": round(time.perf_counter() - t0, 3),
                        "distinct_tokens": len(set(ids)), "cycle_period": detect_cycle(ids),
                        "nan_logprobs": sum(1 for x in lps if x is None or x != x),
                        "min_top1_margin": min(margins) if margins else None,
                        "median_top1_margin": statistics.median(margins) if margins else None,
                        "mean_logprob": statistics.fmean([x for x in lps if x is not None]) if lps else None})
            log(f"  correctness {p['id']}: {len(ids)} tokens in {row['e2e_s']:.2f}s, distinct={row['distinct_tokens']} "
                f"cycle={row['cycle_period']} first={ids[:8]} min_margin={row['min_top1_margin']}")
        except ServerDied:
            raise
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"
            log(f"  correctness {p['id']}: ERROR {row['error']}")
            target.check()
        res["prompts"].append(row)
        keep(res)
    ok = [r for r in res["prompts"] if "output_ids" in r]
    # The stack's own noise: every prompt decoded again on the same server (judge.py compares every
    # pair of one server's decodes and decode k of an arm with decode k of the baseline).
    redecodes, repeats = [], []
    prompts = {p["id"]: p for p in correctness_prompts(args, run.vocab)}
    for k in range(1, args.corr_decodes):
        for first in ok:
            if dl.left() < args.reserve_s + 20:
                res["skipped_rest"] = "deadline"
                break
            again = target.endpoint.generate(prompts[first["id"]]["ids"], args.corr_out, logprobs=True,
                                             rid=f"corr-{target.arm}-{first['id']}-{k}",
                                             timeout=max(30.0, dl.left() - args.reserve_s))
            lps, top = extract_logprobs(again.get("meta_info", {}))
            decode = {"id": first["id"], "decode": k, "output_ids": list(again.get("output_ids") or []),
                      "logprobs": lps, "top": top}
            redecodes.append(decode)
            row = compare_outputs({"prompts": [first]}, {"prompts": [decode]})["per_prompt"][0]
            repeats.append(row | {"decode": k})
            log(f"  correctness decode {k + 1} of {first['id']}: identical={row['identical']} first mismatch="
                f"{row['first_mismatch']} max|dlogprob| before it={row['max_abs_dlogprob']:.3g}")
        keep(res | {"redecodes": redecodes, "repeats": repeats})
    res["redecodes"] = redecodes
    res["repeats"] = repeats
    res["distinct_outputs"] = len({tuple(r["output_ids"]) for r in ok})
    res["speculative"] = spec_summary(ok)
    res["prompts_ok"] = len(ok)
    pair = [r for r in ok if r["id"].startswith("pair")]
    if len(pair) == 2:
        res["context_sensitive"] = pair[0]["output_ids"] != pair[1]["output_ids"]
    log(f"  correctness: {res['prompts_ok']} prompts, {res['distinct_outputs']} distinct outputs, "
        f"context_sensitive={res.get('context_sensitive')}")
    return res


def phase_capacity(target, run: Run) -> dict:
    args, dl, log = run.args, run.deadline, run.log
    n, L, O = args.cap_requests, args.cap_input_len, args.cap_output_len
    budget = min(args.cap_timeout, dl.left() - args.reserve_s - 15)
    res = {"requests": n, "input_len": L, "output_len": O}
    if budget < 20:
        res["skipped"] = "deadline"
        return res
    prompts = [make_prompt(50_000 + i, L, run.vocab) for i in range(n)]
    off = file_size(target.log_path)
    results: list = [None] * n

    def worker(i: int) -> None:
        try:
            out = target.endpoint.generate(prompts[i], O, rid=f"cap-{target.arm}-{i}", timeout=budget + 30)
            results[i] = out.get("meta_info", {}).get("finish_reason")
        except Exception as e:
            results[i] = f"error: {type(e).__name__}"

    samples = []
    t0 = time.monotonic()
    pool = ThreadPoolExecutor(max_workers=n)
    futs = [pool.submit(worker, i) for i in range(n)]
    best, best_t, stop_reason = 0, t0, "timeout"
    try:
        while True:
            time.sleep(args.cap_poll_s)
            target.check()
            now = time.monotonic()
            ld = target.endpoint.loads()
            if ld:
                r, w = int(ld.get("num_running_reqs", 0)), int(ld.get("num_waiting_reqs", 0))
                samples.append((round(now - t0, 2), r, w))
                if r > best:
                    best, best_t = r, now
                if r >= n:
                    stop_reason = "all requests running"
                    break
                if w > 0 and best > 0 and now - best_t > args.cap_plateau_s:
                    stop_reason = f"plateau ({args.cap_plateau_s:.0f}s without a new maximum, {w} waiting)"
                    break
            if all(f.done() for f in futs):
                stop_reason = "all requests finished (raise --cap-output-len)"
                break
            if now - t0 > budget:
                break
    finally:
        with contextlib.suppress(Exception):
            target.endpoint.abort_all()
        pool.shutdown(wait=True, cancel_futures=False)
    seg = summarize_log(read_from(target.log_path, off))
    res.update({
        "duration_s": round(time.monotonic() - t0, 1), "stop_reason": stop_reason,
        # The capacity: the server's load endpoint and its decode lines (the batch that ran). A prefill line's
        # running count is taken before SGLang filters the requests the step before finished, so it can count
        # them too (31 against 27 in a run whose requests finished during the phase): recorded, not counted.
        "max_running_loads": best if samples else None,
        "max_running_decode_log": seg["max_decode_running"],
        "max_running_log": seg["max_running"],
        "max_running": max(x for x in (best if samples else None, seg["max_decode_running"], 0) if x is not None),
        "retracted_reqs": seg["retracted_reqs"], "max_token_usage_log": seg["max_token_usage"],
        "loads_samples": samples[-400:],
        "finish_reasons": {k: sum(1 for x in results if str(x) == k) for k in sorted({str(x) for x in results})},
    })
    log(f"  capacity: max running {res['max_running']} of {n} x {L}+{O} tokens "
        f"(loads {res['max_running_loads']}, decode lines {res['max_running_decode_log']}, prefill and decode lines "
        f"{res['max_running_log']}), {stop_reason}, "
        f"{res['duration_s']}s, retracted {res['retracted_reqs']}")
    return res


def warm_up(target, run: Run, seed: int, input_len: int) -> float | None:
    """One short request at `input_len` (kernels specialised on sequence length compile here, not in a
    measurement); its duration, or None if it failed."""
    with contextlib.suppress(Exception):
        t = time.perf_counter()
        target.endpoint.generate(make_prompt(seed, input_len, run.vocab), 8,
                                 timeout=max(30.0, min(300.0, run.deadline.left() - run.args.reserve_s)))
        return round(time.perf_counter() - t, 2)
    return None


def run_level(target, prompts: list[list[int]], out_len: int, timeout: float, *, steady: bool = False) -> dict:
    """All `prompts` sent at once (streaming): client and server-log figures of the level.

    steady=True adds each request's time per output token while every request of the level decodes
    (stats.steady_window: prefills of the level no longer interleave)."""
    off = file_size(target.log_path)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        outs = list(pool.map(lambda ids: target.endpoint.generate_stream(ids, out_len, timeout=timeout, trace=steady),
                             prompts))
    wall = time.perf_counter() - t0
    seg = summarize_log(read_from(target.log_path, off))
    ok = [o for o in outs if "error" not in o]
    tpots = [o["tpot_s"] for o in ok if o.get("tpot_s")]
    ttfts = [o["ttft_s"] for o in ok if o.get("ttft_s") is not None]
    toks = sum(o["tokens"] for o in ok)
    hs = seg.get("hisparse") or {}
    row = {"concurrency": len(prompts), "ok": len(ok),
            "errors": sorted({o["error"] for o in outs if "error" in o})[:3],
            "wall_s": round(wall, 2), "output_tokens": toks,
            "output_tok_s": round(toks / wall, 1) if wall > 0 else None,
            "tpot_ms_median": round(1000 * statistics.median(tpots), 3) if tpots else None,
            "tpot_ms_p90": round(1000 * pct(tpots, 0.9), 3) if tpots else None,
            "per_request_decode_tok_s_median": round(1 / statistics.median(tpots), 1) if tpots else None,
            "ttft_s_median": round(statistics.median(ttfts), 3) if ttfts else None,
            "ttft_s_max": round(max(ttfts), 3) if ttfts else None,
            "log_gen_tput_median": seg["gen_tput_median"], "log_gen_tput_max": seg["gen_tput_max"],
            "log_max_running": seg["max_running"], "cuda_graph_fraction": seg["cuda_graph_fraction"],
            "retracted_reqs": seg["retracted_reqs"],
            "hisparse_step_host_ms_median": hs.get("step_host_ms_median"),
            "hisparse_resident_max": hs.get("resident_max"), "hisparse_offloaded_max": hs.get("offloaded_max"),
            "hisparse_all_resident": hs.get("all_resident"),
            "speculative": spec_summary([o.get("spec") or {} for o in ok]),
            "tpot_ms_per_request": [round(1000 * t, 3) for t in tpots],
            # per request, in send order: [TTFT s, end-to-end s, output tokens] (the tail of a level)
            "requests": [[round(o["ttft_s"], 3) if o.get("ttft_s") is not None else None,
                          round(o["e2e_s"], 3), o["tokens"]] for o in ok]}
    if steady:
        window = steady_window([o.get("arrivals") or [] for o in outs]) if len(ok) == len(outs) else None
        chunks = [c for c in (window_chunks(o["arrivals"], window) for o in ok) if c] if window else []
        per_request = [seconds / tokens for seconds, tokens in chunks]  # stats.window_tpot of each
        row.update({"steady_window_s": round(window[1] - window[0], 3) if window else None,
                    "steady_tpot_ms_median": round(1000 * statistics.median(per_request), 3) if per_request else None,
                    "steady_tpot_ms_per_request": [round(1000 * t, 3) for t in per_request],
                    "steady_chunk_ms_per_request": [round(1000 * c[0], 4) for c in chunks],
                    "steady_tokens_per_chunk_per_request": [round(c[1], 4) for c in chunks],
                    # per request, in send order: [seconds since the level started, cumulative tokens] per chunk,
                    # the window's bounds on the same clock: where in a request its steps slowed
                    "arrivals": [[[round(t - t0, 5), n] for t, n in o.get("arrivals") or []] for o in outs],
                    "steady_window": [round(w - t0, 5) for w in window] if window else None})
    return row


def phase_throughput(target, run: Run, cap: int | None, keep) -> dict:
    """keep(partial result) is called after every level."""
    args, dl, log = run.args, run.deadline, run.log
    L, O = args.tp_input_len, args.tp_output_len
    res = {"input_len": L, "output_len": O, "levels": []}
    levels = []
    for lv in args.tp_levels:
        c = lv if lv != "max" else (cap or args.tp_max_fallback)
        if lv == "max" and not cap:
            res["max_level_note"] = f"no capacity measured; 'max' = --tp-max-fallback {args.tp_max_fallback}"
        if c not in [x for _, x in levels]:
            levels.append((lv, c))
    warm = warm_up(target, run, 99, L)
    if warm is not None:
        res["warmup_s"] = warm
    runs = [(lv, c, rep) for lv, c in levels for rep in range(args.tp_repeats)]
    for lv, c, rep in runs:
        if dl.left() < args.reserve_s + 20:
            res["skipped_rest"] = "deadline"
            break
        target.check()
        prompts = [make_prompt(200_000 + 1000 * c + 100_000 * rep + i, L, run.vocab) for i in range(c)]
        timeout = max(20.0, min(args.tp_level_timeout, dl.left() - args.reserve_s))
        row = {"level": lv, "repeat": rep} | run_level(target, prompts, O, timeout)
        res["levels"].append(row)
        log(f"  throughput c={c:3d} ({lv}, run {rep + 1}/{args.tp_repeats}): {row['output_tok_s']} out tok/s, "
            f"TPOT median {row['tpot_ms_median']} ms, TTFT median {row['ttft_s_median']} s, "
            f"log decode {row['log_gen_tput_median']} tok/s, max running {row['log_max_running']}, "
            f"HiSparse step host {row['hisparse_step_host_ms_median']} ms, wall {row['wall_s']}s, ok {row['ok']}/{c}")
        keep(res)
    return res
