#!/usr/bin/env python3
"""End-to-end benchmark of HiSparse on SGLang 0.5.17 with a tiny DeepSeek-V3.2 (DSA) model: the CLI.

`--help` (options.HELP) describes the arms and phases; docs/gpu-e2e.md the device runs.  The modules:
common (paths, log, deadline), options (flags), arms (server argv/env per arm), environment (CUDA,
JIT shim), servers (process control), client (HTTP), logs (server-log parsing), stats, phases
(preflight, correctness, capacity, throughput), lowload, storm, report (results.json/.md, $OUT).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import shlex
import signal
import sys
import time
from pathlib import Path

from arms import ALL_ARMS, ARM_LABELS, PLUGIN_ARMS, arm_port, arm_spec, parse_env_assignments, prepare_pyext
from client import make_prompt
from common import Deadline, Log, Run, atomic_write
from environment import base_env
from logs import file_size, log_tail, read_from, summarize_log
from lowload import phase_lowload
from options import ARM_PHASES, parse_args
from phases import phase_capacity, phase_correctness, phase_preflight, phase_throughput
from report import Outputs, load_state, render_markdown
from servers import Server, ServerDied, kill_stale_servers
from storm import phase_storm


def fresh_state(state: Path) -> None:
    """--fresh: earlier results of the state dir are deleted (caches and the JIT shim stay)."""
    for p in list(state.glob("arm-*.json")) + list(state.glob("server-*.log")) + \
            [state / "meta.json", state / "results.json", state / "results.md"]:
        with contextlib.suppress(OSError):
            p.unlink()


def check_started(srv: Server, run: Run, result: dict, log_off: int, plugin_ep: tuple[str, str]) -> None:
    """After /health: warm up, record the server's view of itself, and fail an arm whose plugin did not load."""
    args, dl, log = run.args, run.deadline, run.log
    t = time.perf_counter()
    srv.endpoint.generate(make_prompt(3, min(4096, args.tp_input_len), run.vocab), 16,
                          timeout=max(30.0, min(300.0, dl.left() - args.reserve_s)))
    result["warmup_s"] = round(time.perf_counter() - t, 2)
    with contextlib.suppress(Exception):
        info = srv.endpoint.server_info()
        ist = (info.get("internal_states") or [{}])[0]
        result["server_internal"] = {k: ist.get(k) for k in (
            "effective_max_running_requests_per_dp", "memory_usage", "last_gen_throughput")}
        result["server_info"] = {k: info.get(k) for k in (
            "max_total_num_tokens", "max_req_input_len", "page_size", "chunked_prefill_size",
            "cuda_graph_max_bs", "max_running_requests", "version", "enable_hisparse",
            "hisparse_config", "attention_backend", "dsa_prefill_backend", "dsa_decode_backend")}
    seg = summarize_log(read_from(srv.log_path, log_off))
    result["log"] = seg
    result["weight_fingerprints"] = seg["weight_fingerprints"]
    log(f"  warm-up {result['warmup_s']}s; weights {seg['weight_init']} fingerprint {seg['weight_fingerprints']}; "
        f"max_total_num_tokens={seg['max_total_num_tokens']}; plugins visible {seg['visible_plugins']}; "
        f"dense threshold {seg['dense_attn_threshold']}")
    if seg["plugin_failures"]:
        log(f"  WARNING plugin failures in the server log: {seg['plugin_failures']}")
    if not seg["weight_fingerprints"]:
        log("  WARNING: no weight fingerprint in the server log (fixture plugin not loaded?)")
    if srv.arm in PLUGIN_ARMS:
        visible = any(f"{plugin_ep[0]}=" in v for v in seg["visible_plugins"])
        failed = [f for f in seg["plugin_failures"] if plugin_ep[0] in f]
        result["plugin_check"] = {"entry_point": f"{plugin_ep[0]} = {plugin_ep[1]}",
                                  "visible": visible, "failures": failed}
        if (failed or not visible) and not args.allow_plugin_failure:
            raise RuntimeError(f"arm {srv.arm}: plugin entry point {plugin_ep[0]} "
                               f"{'failed: ' + str(failed) if failed else 'not visible to sglang'}; "
                               f"arm {srv.arm} would just repeat arm b (--allow-plugin-failure runs it anyway)")


def measure(srv: Server, run: Run, result: dict, arm_phases: list[str], save) -> None:
    """The selected phases of one arm; a phase's partial result is saved while it runs, the whole when done."""
    log = run.log

    def keeper(phase: str):
        def keep(partial: dict) -> None:
            result[phase] = partial
            save()
        return keep

    if "correctness" in arm_phases:
        log(f"arm {srv.arm}: correctness")
        result["correctness"] = phase_correctness(srv, run, keeper("correctness"))
        save()
    if "capacity" in arm_phases:
        log(f"arm {srv.arm}: capacity")
        result["capacity"] = phase_capacity(srv, run)
        save()
    if "throughput" in arm_phases:
        log(f"arm {srv.arm}: throughput")
        cap = (result.get("capacity") or {}).get("max_running") or None
        result["throughput"] = phase_throughput(srv, run, cap, keeper("throughput"))
        save()
    if "lowload" in arm_phases:
        log(f"arm {srv.arm}: lowload")
        result["lowload"] = phase_lowload(srv, run, keeper("lowload"))
        save()
    if "storm" in arm_phases:
        log(f"arm {srv.arm}: storm")
        result["storm"] = phase_storm(srv, run)
        save()


def run_arm(arm: str, spec: tuple[list, dict], run: Run, outputs: Outputs, plugin_ep: tuple[str, str],
            arm_phases: list[str], current: dict) -> int:
    """Start the arm's server, measure, stop it; the arm's JSON is written after every step.  The
    return code: 0 ok, 2 failed, 3 skipped for time.  `current["server"]` is the running server
    (the signal handler stops it)."""
    args, dl, log = run.args, run.deadline, run.log
    state = args.state_dir
    cmd, env = spec
    port = arm_port(args, arm)
    rpath = state / f"arm-{arm}.json"
    result = {"arm": arm, "label": ARM_LABELS[arm], "status": "starting", "cmd": shlex.join(cmd),
              "pythonpath": env["PYTHONPATH"],
              "env": {k: env[k] for k in sorted(env) if k.startswith(("SGLANG_", "HISPARSE_", "CUDA_HOME"))}
              | parse_env_assignments(args.plugin_env if arm in PLUGIN_ARMS else [])}
    old = json.loads(rpath.read_text()) if rpath.exists() else {}
    for p in ARM_PHASES:  # keep earlier phases not rerun now
        if p not in arm_phases and p in old:
            result[p] = old[p]

    def save():
        atomic_write(rpath, json.dumps(result, indent=1, default=str))
        outputs.publish()

    if dl.left() < args.arm_min_s:
        result.update(status="skipped", error=f"not started: {dl.left():.0f}s left < --arm-min-s {args.arm_min_s:.0f}")
        log(f"arm {arm}: SKIPPED ({result['error']}); rerun with --arms {arm}")
        if not old:
            save()
        return 3
    log_path = state / f"server-{arm}.log"
    srv = Server(arm, cmd, env, log_path, port, state, log)
    current["server"] = srv
    log(f"arm {arm} ({ARM_LABELS[arm]}): starting server on port {port}")
    log(f"  PYTHONPATH={env['PYTHONPATH']}")
    log(f"  $ {shlex.join(cmd)}")
    log_off = file_size(log_path)
    rc = 0
    try:
        srv.start()
        result["startup_s"] = round(srv.wait_healthy(min(args.health_timeout, dl.left() - args.reserve_s)), 1)
        log(f"  healthy after {result['startup_s']}s")
        check_started(srv, run, result, log_off, plugin_ep)
        result["status"] = "running"
        save()
        measure(srv, run, result, arm_phases, save)
        result["status"] = "ok"
        cut = [p for p in arm_phases if (result.get(p) or {}).get("skipped") or (result.get(p) or {}).get("skipped_rest")]
        if cut:
            log(f"arm {arm}: phases cut short by the deadline: {cut}; rerun with --arms {arm} --phases {','.join(cut)}")
            rc = 3
    except (ServerDied, TimeoutError) as e:
        result.update(status="failed", error=str(e))
        log(f"arm {arm}: FAILED: {e}")
        rc = 2
    except Exception as e:
        result.update(status="failed", error=f"{type(e).__name__}: {e}\nlast log lines:\n{log_tail(log_path, 40)}")
        log(f"arm {arm}: FAILED: {type(e).__name__}: {e}")
        rc = 2
    finally:
        srv.stop()
        current["server"] = None
        full = summarize_log(read_from(log_path, log_off))
        result["log"] = full
        result["weight_fingerprints"] = full["weight_fingerprints"] or result.get("weight_fingerprints")
        result["elapsed_s"] = round(dl.elapsed(), 1)
        save()
    return rc


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dl = Deadline(args.deadline_s)
    state = args.state_dir
    if args.fresh and state.exists():
        fresh_state(state)
    state.mkdir(parents=True, exist_ok=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    log = Log([state / "harness.log"] + ([args.out / "harness.log"] if args.out else []))
    log(f"run_e2e.py {' '.join(argv if argv is not None else sys.argv[1:])}")
    log(f"arms={args.arms} phases={args.phases} deadline={args.deadline_s:.0f}s state={state} out={args.out}")
    outputs = Outputs(state, args.out, args.import_results)
    vocab = json.loads((args.model_dir / "config.json").read_text())["vocab_size"]
    meta = load_state(state)["meta"]
    meta.update({"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                 "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}})
    meta.setdefault("runs", []).append({"argv": sys.argv[1:] if argv is None else argv,
                                        "started": meta["date"]})
    run = Run(args, vocab, dl, log, started=meta["date"])

    env0, env_info = base_env(args, state, log)
    common, plugin_dir, plugin_ep = prepare_pyext(state, args)
    meta["plugin_entry_point"] = f"{plugin_ep[0]} = {plugin_ep[1]}"

    specs = {arm: arm_spec(arm, args, env0, common, plugin_dir, arm_port(args, arm)) for arm in ALL_ARMS}
    if args.dry_run:
        for arm in args.arms:
            cmd, env = specs[arm]
            diff = {k: v for k, v in env.items() if os.environ.get(k) != v}
            print(f"# arm {arm}: {ARM_LABELS[arm]}")
            print("env " + " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(diff.items())))
            print(shlex.join(cmd) + "\n")
        return 0

    current = {"server": None}

    def on_signal(signum, frame):
        log(f"signal {signum}: stopping")
        srv = current["server"]
        if srv is not None:
            srv.stop(grace=5)
        outputs.publish()
        sys.exit(128 + signum)

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, on_signal)
    kill_stale_servers(state, log)

    def save_meta():
        atomic_write(state / "meta.json", json.dumps(meta, indent=1, default=str))

    if "preflight" in args.phases:
        log("phase preflight")
        meta["preflight"] = phase_preflight(run, env0, env_info)
    else:
        meta.setdefault("preflight", {"env": env_info})
    save_meta()
    outputs.publish()

    rc = 0
    arm_phases = [p for p in ARM_PHASES if p in args.phases]
    for arm in args.arms if arm_phases else []:
        rc = max(rc, run_arm(arm, specs[arm], run, outputs, plugin_ep, arm_phases, current))
    meta["runs"][-1]["finished"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    save_meta()
    data = outputs.publish()
    log("report:\n" + render_markdown(data))
    log(f"done in {dl.elapsed():.0f}s (rc={rc}); results: {state / 'results.json'}"
        + (f" and {args.out}" if args.out else ""))
    return rc


if __name__ == "__main__":
    sys.exit(main())
