#!/usr/bin/env python3
"""Time per output token of several arms side by side: every arm's server runs at once and the requests
alternate between them, each on the same CPU.

Why: on the lent GPU machines the scheduler process sets the pace of a small batch (a step of one request is
host-bound), and the same arm's time per token differs by up to 2.1x between server starts while repeating within
a few percent inside one (docs/speculative.md, section 7); a placement sweep (profile_decode.py
``--placement-sweep``) showed 1.2-2.4 ms per token for one server depending on the CPU its scheduler was pinned
to and on when. Timing arms one after the other therefore compares machines, not arms. Here all servers are up
together; round ``r`` pins the scheduler process of the arm being measured to CPU ``cpus[r]`` (the others wait on
the parking CPU, the client runs on its own CPU), and the arms take turns, in an order rotated every round, on the
same CPU within seconds of each other. The ratio of an arm to the first one is taken per round (per CPU), so a
slow CPU or a slow minute slows both sides of a ratio alike.

For each level N of ``--levels`` the arm being measured gets N requests of ``--input-len`` + ``--output-len``
tokens at once (the same prompts for every arm of a round): its time per output token is the mean over those
requests of (last token - first token) / (tokens - 1). With ``--steady`` it also records the time per token while
every request of the level decodes (from the last request's first token to the first request's last), per request
then averaged: the decode step's pace without the other requests' prefills interleaved, reported in a second table;
and the same window per streamed chunk, which a speculative server sends once per verify step, with the tokens per
chunk and SGLang's accept length beside it: whether an arm's time per token differs by its step's pace or by the
tokens its steps accept.
Around each arm's level the measured scheduler's main thread's scheduling counters are read (``/proc``: time on a
CPU, time waiting on a run queue, context switches), reported per output token: whether an arm's slower step is
more work on the CPU or time kept off it.

    python3 benchmarks/e2e/paired_decode.py --variants a+mtp,c+mtp,d+mtp --levels 1,2,4 --rounds 14 \\
        --harness-args "--mtp-steps 3 --mtp-accept-len 3 --plugin-hisparse-config '{\\"device_buffer_size\\": 8192}'"

A variant ``ARM@LABEL`` runs the arm with the plugin source given by ``--source LABEL=DIR`` (a ``src``
directory, e.g. the previous commit's: ``git archive HEAD src csrc | tar -x -C DIR/..``): a change and the code
before it timed side by side, against the same baseline.

With ``--host-steps N`` every round also records N steps of each arm's scheduler host work with Python stacks
(``host_trace.py``), one arm after the other on the round's CPU, and reports whether an arm's process runs the calls
both arms make slower than the first arm's (``host_trace.cost_index``; on the lent H200s it swung 0.87-1.63 between
rounds: the guest CPU's speed changes within seconds).

Under a time limit (a lent GPU's call), ``--max-seconds`` starts no round that would end past it (the longest
round so far as the estimate), so the servers stop and the tables are written in time.

Writes ``paired.json`` and ``paired.md`` (the tables, then every round's figures) to ``--out``; the servers' logs
stay in the state directory. ``--ratios c/a,c/b`` picks the ratios reported (default: every arm against the
first); ``--from-json paired.json --ratios ...`` renders an earlier run's tables with other ratios, and
``--from-json`` repeated pools the rounds of several runs of the same arms.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import client
import host_trace
import logs
import options
from arms import MTP_ARMS, arm_spec, prepare_layered_model, prepare_mtp_model, prepare_pyext
from common import Log
from environment import base_env
from phases import run_level
from profile_decode import find_scheduler_pid, pin_process, record_host, sched_per_token, sched_totals, start_streams
from servers import Server
from stats import window_pace


def decode_level(server: Server, prompts: list[list[int]], output_len: int, steady: bool = False) -> dict:
    """Every prompt at once (phases.run_level): the mean time per output token over the requests (ms) and, under
    speculative decoding, SGLang's accept length of the level (``accept_length``); with ``steady`` also the means
    over the requests, while all of them decode, of their time per token (``steady_ms``), per streamed chunk
    (``chunk_ms``: one verify step) and of their tokens per chunk (``tokens_per_chunk``), and every request's
    chunk arrivals with the window (``arrivals``: where in a request its steps slowed); or the first error when a
    request gave no time per token."""
    row = run_level(server, prompts, output_len, timeout=600, steady=steady)
    tpots = row["tpot_ms_per_request"]
    if len(tpots) < len(prompts):
        return {"error": str(row["errors"][0] if row["errors"] else "a request without a time per token")}
    out = {"tpot_ms": round(statistics.mean(tpots), 4)}
    if row.get("speculative"):
        out["accept_length"] = row["speculative"]["accept_length"]
    if steady:
        window = row.get("steady_tpot_ms_per_request") or []
        out["steady_ms"] = round(statistics.mean(window), 4) if len(window) == len(prompts) else (
            "no window in which every request decoded")
        chunk_ms, per_chunk = row.get("steady_chunk_ms_per_request"), row.get("steady_tokens_per_chunk_per_request")
        if chunk_ms and len(chunk_ms) == len(prompts):
            out["chunk_ms"] = round(statistics.mean(chunk_ms), 4)
            out["tokens_per_chunk"] = round(statistics.mean(per_chunk), 4)
        out["arrivals"] = {"requests": row.get("arrivals"), "steady_window": row.get("steady_window")}
    return out


def file_name(variant: str) -> str:
    """A variant as it names its server's log and trace files ("c+mtp@before" -> "c-mtp-before")."""
    return variant.replace("+", "-").replace("@", "-")


def host_round(servers: dict, schedulers: dict, order: list[str], base: str, cpu: int, park_cpu: int, args,
               vocab: int, round_index: int) -> dict:
    """One round's host traces (``--host-steps``): each variant in ``order``, its scheduler on ``cpu``, decodes one
    request of ``--host-out`` tokens while SGLang's profiler records ``--host-steps`` steps with Python stacks; per
    variant its Python calls per step, self time by origin and host_trace.cost_index against ``base``."""
    summaries, out = {}, {}
    prompt = client.make_prompt(900_000 + round_index, args.input_len, vocab)
    for variant in order:
        for other, pid in schedulers.items():
            pin_process(pid, {cpu} if other == variant else {park_cpu})
        name = file_name(variant)
        threads, _ = start_streams(servers[variant].port, [prompt], args.host_out)
        time.sleep(args.host_delay)
        summary = record_host(servers[variant].port, args.state_dir / f"torch-host-paired-{name}", args.host_steps)
        for thread in threads:
            thread.join()
        if "functions" not in summary:
            out[variant] = {"error": summary.get("error")}
            continue
        summaries[variant] = summary
        out[variant] = {"python_calls_per_step": summary["python_calls_per_step"],
                        "self_us_by_origin": summary["self_us_by_origin"]}
    if base in summaries:
        for variant, summary in summaries.items():
            if variant != base:
                out[variant]["cost_index"] = host_trace.cost_index(summaries[base], summary)
    return out


def host_indices(variants: list[str], rounds: list[dict]) -> dict:
    """Per variant after the first: the spread over the rounds of host_trace.cost_index (ops, python)."""
    out = {}
    for variant in variants[1:]:
        per_kind = {}
        for kind in ("ops", "python"):
            values = [r["host"][variant]["cost_index"][kind]["index"] for r in rounds
                      if r.get("host", {}).get(variant, {}).get("cost_index", {}).get(kind, {}).get("index")]
            if values:
                per_kind[kind] = spread(values)
        out[variant] = per_kind
    return out


def spread(values: list[float]) -> dict:
    ordered = sorted(values)
    q = statistics.quantiles(ordered, n=4) if len(ordered) >= 2 else [ordered[0]] * 3
    return {"median": round(statistics.median(ordered), 4), "min": round(ordered[0], 4),
            "max": round(ordered[-1], 4), "q1": round(q[0], 4), "q3": round(q[2], 4), "n": len(ordered)}


def summarize(variants: list[str], levels: list[int], rounds: list[dict], within: float,
              ratios: list[tuple[str, str]] | None = None, metric: str = "tpot_ms") -> dict:
    """Per level: each arm's time per token (``metric``: ``tpot_ms``, or ``steady_ms`` of a ``--steady`` run)
    over the rounds, and per ``(arm, baseline)`` of ``ratios`` (default: every arm against the first) the arm's
    per-round ratio to the baseline."""
    ratios = ratios or [(v, variants[0]) for v in variants[1:]]
    out = {}
    for level in levels:
        key = str(level)
        per_arm = {v: [r[metric][v][key] for r in rounds if isinstance(r[metric][v].get(key), float)]
                   for v in variants}
        per_pair = {}
        for v, base in ratios:
            pairs = [r[metric][v][key] / r[metric][base][key] for r in rounds
                     if isinstance(r[metric][v].get(key), float) and isinstance(r[metric][base].get(key), float)]
            if pairs:
                per_pair[f"{v} / {base}"] = spread(pairs) | {"within": sum(abs(p - 1) <= within for p in pairs)}
        out[key] = {"tpot_ms": {v: spread(t) for v, t in per_arm.items() if t}, "ratio": per_pair}
    return out


def render(variants: list[str], summary: dict, meta: dict, rounds: list[dict] | None = None,
           hisparse_log: dict | None = None, steady: dict | None = None, chunks: dict | None = None,
           pace: dict | None = None) -> str:
    """The table of every level (arms' time per token, the ratios per round), with ``steady`` (the summary of
    ``steady_ms``) the same table while every request of a level decodes, with ``chunks`` (the summary of
    ``chunk_ms``) the same per streamed chunk with the tokens per chunk and accept lengths, what the plugin's log
    lines say per arm (modes, hit rate, host work), then every round's figures."""
    names = list(next(iter(summary.values()))["ratio"]) if summary else []
    lines = [f"Arms side by side ({meta['rounds']} rounds, scheduler of the measured arm pinned to one CPU per round: "
             f"{meta['cpus']}; parking CPU {meta['park_cpu']}, client CPU {meta['client_cpu']}; "
             f"{meta['input_len']} + {meta['output_len']} tokens per request)\n",
             "| concurrency | " + " | ".join(f"{v} TPOT ms, median [q1-q3] (min-max)" for v in variants)
             + "".join(f" | {name} per round, median [q1-q3] (min-max), rounds within {meta['within']:.0%}"
                       for name in names) + " |",
             "|---" * (1 + len(variants) + len(names)) + "|"]
    header = lines[1:]
    lines += _level_rows(variants, names, summary)
    if steady:
        lines += ["\nWhile every request of the level decodes (from the last request's first token to the first "
                  "request's last; the other requests' prefills not interleaved):\n", *header,
                  *_level_rows(variants, names, steady)]
    if chunks:
        lines += ["\nThe same window per streamed chunk (one chunk per verify step: the step's pace apart from the tokens "
                  "it accepts), ms:\n", *[h.replace("TPOT ms", "ms per chunk") for h in header],
                  *_level_rows(variants, names, chunks)]
        if rounds:
            lines += ["\nTokens per chunk in that window / SGLang's accept length of the level, medians over the "
                      "rounds:\n", "| concurrency | " + " | ".join(variants) + " |", "|---" * (1 + len(variants)) + "|"]
            for level in chunks:
                cells = [" / ".join(_median_of(rounds, key, v, level) for key in ("tokens_per_chunk", "accept_length"))
                         for v in variants]
                lines.append(f"| {level} | " + " | ".join(cells) + " |")
    if pace:
        lines += ["\nThe same window's usual verify step (the median interval between two chunks, which a single "
                  "held-up step does not move), ms:\n", *[h.replace("TPOT ms", "ms per step") for h in header],
                  *_level_rows(variants, names, pace)]
        if rounds:
            lines += ["\nWhat the held-up steps (intervals over twice that median) added per request, ms, medians "
                      "over the rounds:\n", "| concurrency | " + " | ".join(variants) + " |",
                      "|---" * (1 + len(variants)) + "|"]
            lines += [f"| {level} | " + " | ".join(_median_of(rounds, "stall_ms", v, level) for v in variants) + " |"
                      for level in pace]
    for variant, plugin in (hisparse_log or {}).items():
        if plugin:
            hit = plugin["hit_rate_pct_min"]
            lines.append(f"\n{variant}, the plugin's log lines ({plugin['lines']}): at most {plugin['resident_max']} "
                         f"requests resident and {plugin['offloaded_max']} offloaded at once, lowest LRU hit rate "
                         + (f"{hit} %" if hit is not None else "none (no request offloaded)")
                         + f", host work per step {plugin['step_host_ms_median']} ms (median), mode switches up to "
                         f"{plugin['switch_work_max_ms']} ms"
                         + (f", prefills staged by DMA {plugin['staged_by_dma']}, by the copy kernel "
                            f"{plugin['staged_by_kernel']}" if plugin.get("staged_by_dma") is not None else ""))
    if rounds and any(r.get("sched") for r in rounds):
        lines += ["\nThe measured scheduler's main thread per output token, medians over the rounds (ms on a CPU, ms "
                  "waiting on a run queue, involuntary context switches per 1,000 tokens):\n",
                  "| concurrency | " + " | ".join(variants) + " |", "|---" * (1 + len(variants)) + "|"]
        for level in summary:
            cells = []
            for v in variants:
                got = [r["sched"][v][level] for r in rounds if level in r.get("sched", {}).get(v, {})]
                cells.append(" / ".join(str(round(statistics.median(g[k] for g in got), 4)) if got else "-"
                                        for k in ("cpu_ms", "runqueue_ms", "involuntary_per_1k")))
            lines.append(f"| {level} | " + " | ".join(cells) + " |")
    if rounds:
        levels = list(summary)
        lines += ["\nEvery round (TPOT ms per arm at each concurrency, in the order the arms ran):\n",
                  "| round | CPU | order | " + " | ".join(f"{v} at {'/'.join(levels)}" for v in variants) + " |",
                  "|---" * (3 + len(variants)) + "|"]
        for r in rounds:
            cells = ["/".join(str(r["tpot_ms"][v].get(level, "–")) for level in levels) for v in variants]
            lines.append(f"| {r['round']} | {r['cpu']} | {', '.join(r['order'])} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _median_of(rounds: list[dict], key: str, variant: str, level: str) -> str:
    values = [r[key][variant][level] for r in rounds if isinstance(r.get(key, {}).get(variant, {}).get(level), float)]
    return str(round(statistics.median(values), 3)) if values else "-"


def add_pace(rounds: list[dict]) -> None:
    """Per round, arm and level with recorded arrivals: ``pace_ms``, the median interval between two chunks of
    the window (a verify step's usual time), and ``stall_ms``, what the longer steps added per request
    (stats.window_pace): a steady cost per step and a one-off hold-up apart."""
    for r in rounds:
        if "arrivals" not in r:
            continue
        r["pace_ms"], r["stall_ms"] = {}, {}
        for variant, per_level in r["arrivals"].items():
            r["pace_ms"][variant], r["stall_ms"][variant] = {}, {}
            for level, got in per_level.items():
                window = got.get("steady_window")
                pace = window_pace(got["requests"], window) if window else None
                if pace is not None:
                    r["pace_ms"][variant][level] = round(1000 * pace[0], 4)
                    r["stall_ms"][variant][level] = round(1000 * pace[1], 3)


def _level_rows(variants: list[str], names: list[str], summary: dict) -> list[str]:
    lines = []
    for level, row in summary.items():
        cells = []
        for v in variants:
            s = row["tpot_ms"].get(v)
            cells.append(f"{s['median']} [{s['q1']}-{s['q3']}] ({s['min']}-{s['max']})" if s else "–")
        for name in names:
            s = row["ratio"].get(name)
            cells.append(f"**{s['median']:.3f}** [{s['q1']:.3f}-{s['q3']:.3f}] ({s['min']:.3f}-{s['max']:.3f}), "
                         f"{s['within']} of {s['n']}" if s else "–")
        lines.append(f"| {level} | " + " | ".join(cells) + " |")
    return lines


def parse_ratios(text: str, variants: list[str]) -> list[tuple[str, str]] | None:
    """``"c/a,c/b"`` -> [("c", "a"), ("c", "b")]; every name must be one of the variants."""
    if not text:
        return None
    pairs = [tuple(item.split("/", 1)) for item in text.split(",")]
    bad = [item for item in pairs if len(item) != 2 or not set(item) <= set(variants)]
    if bad:
        raise ValueError(f"--ratios {text!r}: each item is ARM/BASELINE with both among the variants {variants}")
    return pairs


def pool_runs(runs: list[dict]) -> dict:
    """Several runs' ``paired.json`` as one: the first's meta and plugin lines, every run's rounds in order
    (numbered again). Runs of other arms or levels than the first's are refused (ValueError)."""
    first = runs[0]
    for run in runs[1:]:
        if run["variants"] != first["variants"] or run["levels"] != first["levels"]:
            raise ValueError(f"runs of arms {run['variants']} at levels {run['levels']} cannot be pooled with "
                             f"{first['variants']} at {first['levels']}: pool runs of the same arms and levels.")
    rounds = [dict(r, round=i) for i, r in enumerate(r for run in runs for r in run["rounds"])]
    return first | {"rounds": rounds}


def another_round_fits(elapsed_s: float, round_s: list[float], max_seconds: float) -> bool:
    """Whether a round as long as the longest one so far still ends within ``max_seconds`` of the start
    (0: no limit; before the first round: yes)."""
    return not max_seconds or not round_s or elapsed_s + max(round_s) <= max_seconds


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="a,c", help="arms of run_e2e.py; the first is the baseline of the ratios")
    parser.add_argument("--levels", default="1,2,4", help="requests sent at once")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--input-len", type=int, default=16384)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--within", type=float, default=0.05, help="count the rounds whose ratio is within this of 1")
    parser.add_argument("--server-mem-fraction", default="0.25",
                        help="--mem-fraction-static of each server (they share the GPU; SGLang takes it of the memory "
                        "free when that server starts, so a later server may need more): one value, or one per "
                        "variant in order")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/hisparse_paired")))
    parser.add_argument("--port-base", type=int, default=31300)
    parser.add_argument("--health-timeout", type=float, default=420)
    parser.add_argument("--ratios", default="", help="ARM/BASELINE pairs to report, e.g. c/a,c/b "
                        "(default: every arm against the first)")
    parser.add_argument("--from-json", type=Path, action="append", default=[],
                        help="render the tables of an earlier run's paired.json (with --ratios) instead of running "
                             "servers; repeated: the rounds of several runs of the same arms and levels pooled")
    parser.add_argument("--source", action="append", default=[], metavar="LABEL=DIR",
                        help="plugin source (a src directory) of the variants ARM@LABEL; repeatable")
    parser.add_argument("--harness-args", default="", help="run_e2e.py flags of the servers (shell-quoted string)")
    parser.add_argument("--steady", action="store_true",
                        help="also time each level while every one of its requests decodes (a second table)")
    parser.add_argument("--host-steps", type=int, default=0,
                        help="every round, after the levels: each arm decodes one request of --host-out tokens while "
                             "SGLang's profiler records this many steps of its scheduler's host work (Python stacks); "
                             "reported: whether an arm's process runs the calls both arms make slower than the first "
                             "arm's (host_trace.cost_index) within the same seconds")
    parser.add_argument("--host-out", type=int, default=2000)
    parser.add_argument("--host-delay", type=float, default=1.5, help="seconds after the traced request starts")
    parser.add_argument("--max-seconds", type=float, default=0,
                        help="start no round that would end later than this many seconds after the start (servers' "
                        "start included; 0: run every round): under a time limit, leave ~30 s for stopping the "
                        "servers and writing the tables")
    args = parser.parse_args(argv)
    if args.from_json:
        earlier = pool_runs([json.loads(path.read_text()) for path in args.from_json])
        variants = earlier["variants"]
        # a run written before the file kept its "meta": the CPUs from its rounds, the rest from the flags
        meta = earlier.get("meta") or {"cpus": sorted({r["cpu"] for r in earlier["rounds"]}), "park_cpu": "?",
                                       "client_cpu": "?", "input_len": args.input_len,
                                       "output_len": args.output_len, "within": args.within}
        picked = parse_ratios(args.ratios, variants)
        summary = summarize(variants, earlier["levels"], earlier["rounds"], meta["within"], picked)
        add_pace(earlier["rounds"])
        steady, chunks, pace = (
            summarize(variants, earlier["levels"], earlier["rounds"], meta["within"], picked, metric)
            if all(metric in r for r in earlier["rounds"]) else None
            for metric in ("steady_ms", "chunk_ms", "pace_ms"))
        print(render(variants, summary, meta | {"rounds": len(earlier["rounds"])}, earlier["rounds"],
                     earlier.get("hisparse_log"), steady, chunks, pace), end="")
        return 0
    harness_args = options.parse_args(shlex.split(args.harness_args))
    for key, value in vars(harness_args).items():
        if not hasattr(args, key):
            setattr(args, key, value)
    variants = args.variants.split(",")
    sources = dict(entry.split("=", 1) for entry in args.source)
    unknown = sorted({v.partition("@")[2] for v in variants if "@" in v} - set(sources))
    if unknown:
        parser.error(f"variants name sources {unknown} that no --source LABEL=DIR gives")
    for label, directory in sources.items():
        # The plugin compiles its kernels from csrc/ beside src/: without it that server died at its start (H200).
        if not (Path(directory) / "hisparse_sglang").is_dir() or not (Path(directory).parent / "csrc").is_dir():
            parser.error(f"--source {label}={directory}: needs {directory}/hisparse_sglang and "
                         f"{Path(directory).parent / 'csrc'} (git archive REV src csrc | tar -x -C DIR/..)")
    fractions = [float(x) for x in args.server_mem_fraction.split(",")]
    if len(fractions) not in (1, len(variants)):
        parser.error(f"--server-mem-fraction {args.server_mem_fraction}: one value, or one per variant ({len(variants)})")
    fractions *= len(variants) // len(fractions)
    levels = [int(x) for x in args.levels.split(",")]
    ratios = parse_ratios(args.ratios, variants)
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 3:
        parser.error(f"needs at least 3 CPUs (client, parking, measured); this process may use {cpus}")
    client_cpu, park_cpu, sweep = cpus[0], cpus[1], cpus[2:]
    args.state_dir.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    log = Log([args.out / "paired.log"])
    env0, _ = base_env(args, args.state_dir, log)
    prepare_layered_model(args)
    common, plugin_dir, _ = prepare_pyext(args.state_dir, args)
    if any(v.partition("@")[0] in MTP_ARMS for v in variants):
        prepare_mtp_model(args)
    vocab = json.loads((args.model_dir / "config.json").read_text())["vocab_size"]

    servers: dict[str, Server] = {}
    schedulers: dict[str, int] = {}
    meta = {"cpus": sweep, "park_cpu": park_cpu, "client_cpu": client_cpu, "input_len": args.input_len,
            "output_len": args.output_len, "within": args.within}
    result: dict = {"variants": variants, "levels": levels, "meta": meta, "rounds": []}
    try:
        for i, variant in enumerate(variants):
            port = args.port_base + 10 * i
            arm, _, label = variant.partition("@")
            arm_args = argparse.Namespace(**{**vars(args), "plugin_src": Path(sources[label])}) if label else args
            cmd, env = arm_spec(arm, arm_args, env0, common, plugin_dir, port,
                                mem_fraction_static=fractions[i])
            name = file_name(variant)
            server = Server(f"paired-{name}", cmd, env, args.state_dir / f"server-paired-{name}.log", port,
                            args.state_dir, log)
            server.start()
            startup = server.wait_healthy(args.health_timeout)
            client.generate(port, client.make_prompt(3, 4096, vocab), 16, timeout=300)
            pid = find_scheduler_pid(server.proc.pid)
            if pid is None:
                raise RuntimeError(f"{variant}: no scheduler process found under pid {server.proc.pid}")
            servers[variant], schedulers[variant] = server, pid
            pin_process(pid, {park_cpu})
            log(f"{variant}: healthy after {startup:.1f} s on port {port}, scheduler pid {pid}")
        pin_process(os.getpid(), {client_cpu})
        round_s: list[float] = []
        for r in range(args.rounds):
            if not another_round_fits(time.monotonic() - started, round_s, args.max_seconds):
                meta["stopped_after_rounds"] = r
                log(f"stopping after {r} rounds: another would end past --max-seconds {args.max_seconds:.0f}")
                break
            round_started = time.monotonic()
            cpu = sweep[r % len(sweep)]
            order = variants[r % len(variants):] + variants[:r % len(variants)]
            entry = {"round": r, "cpu": cpu, "order": order, "tpot_ms": {v: {} for v in variants},
                     "sched": {v: {} for v in variants}}
            recorded = ("accept_length", "steady_ms", "chunk_ms", "tokens_per_chunk", "arrivals") if args.steady \
                else ("accept_length",)
            for key in recorded:
                entry[key] = {v: {} for v in variants}
            for level in levels:
                prompts = [client.make_prompt(10_000 * r + 100 * level + j, args.input_len, vocab) for j in range(level)]
                for variant in order:
                    for other, pid in schedulers.items():
                        pin_process(pid, {cpu} if other == variant else {park_cpu})
                    before = sched_totals(schedulers[variant])
                    out = decode_level(servers[variant], prompts, args.output_len, args.steady)
                    # the measured scheduler's main thread, per output token: was it slower, or kept off its CPU?
                    counters = sched_per_token(before, sched_totals(schedulers[variant]), level * args.output_len)
                    if counters is not None:
                        entry["sched"][variant][str(level)] = counters["main"]
                    entry["tpot_ms"][variant][str(level)] = out.get("tpot_ms", out.get("error"))
                    if args.steady:
                        entry["steady_ms"][variant][str(level)] = out.get("steady_ms", out.get("error"))
                    for key in ("accept_length", "chunk_ms", "tokens_per_chunk", "arrivals"):
                        if key in out:
                            entry[key][variant][str(level)] = out[key]
                    servers[variant].check()
            if args.host_steps:
                entry["host"] = host_round(servers, schedulers, order, variants[0], cpu, park_cpu, args, vocab, r)
            result["rounds"].append(entry)
            round_s.append(time.monotonic() - round_started)
            log(f"round {r} (CPU {cpu}, {round_s[-1]:.0f} s): {entry['tpot_ms']}")
            result["summary"] = summarize(variants, levels, result["rounds"], args.within, ratios)
            if args.steady:
                result["summary_steady"] = summarize(variants, levels, result["rounds"], args.within, ratios,
                                                     "steady_ms")
                result["summary_chunk"] = summarize(variants, levels, result["rounds"], args.within, ratios,
                                                    "chunk_ms")
                add_pace([entry])  # the rounds before have theirs
                result["summary_pace"] = summarize(variants, levels, result["rounds"], args.within, ratios, "pace_ms")
            if args.host_steps:
                result["host_indices"] = host_indices(variants, result["rounds"])
            (args.out / "paired.json").write_text(json.dumps(result, indent=1))
    finally:
        for variant, server in servers.items():
            server.stop()
            text = logs.log_since_start(server.log_path)
            result.setdefault("hisparse_log", {})[variant] = logs.summarize_hisparse(text)
        (args.out / "paired.json").write_text(json.dumps(result, indent=1))
    text = render(variants, result.get("summary", {}), meta | {"rounds": len(result["rounds"])}, result["rounds"],
                  result.get("hisparse_log"), result.get("summary_steady"), result.get("summary_chunk"),
                  result.get("summary_pace"))
    if result.get("host_indices"):
        text += "".join(
            f"\nHost cost index of {variant} against {variants[0]} (the calls both make, time per call; per round, "
            f"median [q1-q3] (n)): " + "; ".join(f"{kind} {v['median']} [{v['q1']}-{v['q3']}] ({v['n']})"
                                                for kind, v in kinds.items()) + "\n"
            for variant, kinds in result["host_indices"].items())
    (args.out / "paired.md").write_text(text)
    log(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
