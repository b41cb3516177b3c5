#!/usr/bin/env python3
"""End-to-end benchmark of HiSparse on SGLang 0.5.17 with a tiny DeepSeek-V3.2 (DSA) model: the CLI.

`--help` (options.HELP) describes the arms and phases; docs/gpu-e2e.md the device runs.  The modules:
common (paths, log, deadline), options (flags), arms (server argv/env per arm), environment (CUDA,
JIT shim, Mooncake), servers (process control), client (HTTP, PD routing), logs (server-log parsing),
stats, judge (verdicts), phases (preflight, correctness, capacity, throughput), lowload, pd
(longprompt, saturation, evidence), storm, chaos (faults under load), hostpool (a large host pool's
start-up and teardown), report (results.json/.md, $OUT).
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

import bench_serving_phase
from arms import (
    ALL_ARMS,
    ARM_LABELS,
    MTP_ARMS,
    PD_ARMS,
    PLUGIN_ARMS,
    ServerSpec,
    arm_servers,
    parse_env_assignments,
    pd_ports,
    prepare_layered_model,
    prepare_mtp_model,
    prepare_pyext,
    speculative_args,
    speculative_env,
)
from chaos import phase_chaos
from client import Colocated, PDPair, make_prompt
from common import Deadline, Log, Run, atomic_write
from environment import base_env, mooncake_env
from hostpool import run_hostpool
from logs import file_size, fingerprints_by_model, log_tail, read_from, summarize_log
from lowload import phase_lowload
from options import ARM_PHASES, parse_args
from pd import pd_evidence, phase_longprompt, phase_saturation
from phases import phase_capacity, phase_correctness, phase_preflight, phase_throughput
from report import Outputs, load_state, render_markdown
from servers import Server, ServerDied, ServerGroup, kill_stale_servers
from storm import phase_storm


def fresh_state(state: Path) -> None:
    """--fresh: earlier results of the state dir are deleted (caches and the JIT shim stay)."""
    for p in list(state.glob("arm-*.json")) + list(state.glob("server-*.log")) + list(state.glob("chaos-*.json")) + \
            [state / "meta.json", state / "results.json", state / "results.md"]:
        with contextlib.suppress(OSError):
            p.unlink()


def summarize_logs(group: ServerGroup, offsets: dict[str, int], result: dict) -> dict:
    """The log summary of the server that decodes (`log`), of every server of a PD arm (`logs`, by role),
    and the weight fingerprints all of them logged."""
    summaries = {srv.name: summarize_log(read_from(srv.log_path, offsets[srv.name])) for srv in group.servers}
    result["log"] = summaries[group.decoder.name]
    if len(group.servers) > 1:
        result["logs"] = {srv.name.rsplit("-", 1)[1]: summaries[srv.name] for srv in group.servers}
    fingerprints = sorted({fp for seg in summaries.values() for fp in seg["weight_fingerprints"]})
    result["weight_fingerprints"] = fingerprints or result.get("weight_fingerprints")
    return summaries


def check_started(group: ServerGroup, run: Run, result: dict, offsets: dict[str, int], plugin_ep: tuple[str, str]) -> None:
    """After /health: warm up, record the server's view of itself, and fail an arm whose plugin did not load."""
    args, dl, log = run.args, run.deadline, run.log
    t = time.perf_counter()
    group.endpoint.generate(make_prompt(3, min(4096, args.tp_input_len), run.vocab), 16,
                            timeout=max(30.0, min(300.0, dl.left() - args.reserve_s)))
    result["warmup_s"] = round(time.perf_counter() - t, 2)
    with contextlib.suppress(Exception):
        info = group.endpoint.server_info()
        ist = (info.get("internal_states") or [{}])[0]
        result["server_internal"] = {k: ist.get(k) for k in (
            "effective_max_running_requests_per_dp", "memory_usage", "last_gen_throughput")}
        result["server_info"] = {k: info.get(k) for k in (
            "max_total_num_tokens", "max_req_input_len", "page_size", "chunked_prefill_size",
            "cuda_graph_max_bs", "max_running_requests", "version", "enable_hisparse",
            "hisparse_config", "attention_backend", "dsa_prefill_backend", "dsa_decode_backend",
            "disaggregation_mode")}
    summaries = summarize_logs(group, offsets, result)
    for name, seg in summaries.items():
        log(f"  {name}: warm-up {result['warmup_s']}s; weights {seg['weight_init']} fingerprint "
            f"{seg['weight_fingerprints']}; max_total_num_tokens={seg['max_total_num_tokens']}; plugins visible "
            f"{seg['visible_plugins']}; dense threshold {seg['dense_attn_threshold']}")
        if seg["plugin_failures"]:
            log(f"  WARNING plugin failures in the log of {name}: {seg['plugin_failures']}")
        if not seg["weight_fingerprints"]:
            log(f"  WARNING: no weight fingerprint in the log of {name} (fixture plugin not loaded?)")
    per_model = fingerprints_by_model(result["weight_fingerprints"] or [])
    if any(len(fps) > 1 for fps in per_model.values()):
        raise RuntimeError(f"arm {group.arm}: its servers loaded different weights: {result['weight_fingerprints']}")
    if group.arm in PLUGIN_ARMS:
        seg = result["log"]  # the server that decodes loads the plugin
        visible = any(f"{plugin_ep[0]}=" in v for v in seg["visible_plugins"])
        failed = [f for f in seg["plugin_failures"] if plugin_ep[0] in f]
        result["plugin_check"] = {"entry_point": f"{plugin_ep[0]} = {plugin_ep[1]}",
                                  "visible": visible, "failures": failed}
        if (failed or not visible) and not args.allow_plugin_failure:
            raise RuntimeError(f"arm {group.arm}: plugin entry point {plugin_ep[0]} "
                               f"{'failed: ' + str(failed) if failed else 'not visible to sglang'}; "
                               f"arm {group.arm} would just repeat arm b (--allow-plugin-failure runs it anyway)")


def measure(group: ServerGroup, run: Run, result: dict, arm_phases: list[str], save) -> None:
    """The selected phases of one arm; a phase's partial result is saved while it runs, the whole when done."""
    log = run.log

    def keeper(phase: str):
        def keep(partial: dict) -> None:
            result[phase] = partial
            save()
        return keep

    calls = {"correctness": lambda: phase_correctness(group, run, keeper("correctness")),
             "capacity": lambda: phase_capacity(group, run),
             "throughput": lambda: phase_throughput(group, run, (result.get("capacity") or {}).get("max_running") or None,
                                                    keeper("throughput")),
             "serving": lambda: bench_serving_phase.phase_serving(group, run, keeper("serving")),
             "lowload": lambda: phase_lowload(group, run, keeper("lowload")),
             "longprompt": lambda: phase_longprompt(group, run, result["log"].get("max_total_num_tokens")),
             "saturation": lambda: phase_saturation(group, run, keeper("saturation")),
             "storm": lambda: phase_storm(group, run),
             "chaos": lambda: phase_chaos(group, run, keeper("chaos"))}
    for phase in arm_phases:
        log(f"arm {group.arm}: {phase}")
        result[phase] = calls[phase]()
        bench_serving_phase.scrape_after_phase(group, run, result, phase)
        save()


def make_group(arm: str, specs: list[ServerSpec], args, log: Log) -> ServerGroup:
    state = args.state_dir
    servers = [Server(spec.name(arm), spec.cmd, spec.env, state / f"server-{spec.name(arm)}.log", spec.port, state, log)
               for spec in specs]
    endpoint = PDPair(*pd_ports(args, arm)) if arm in PD_ARMS else Colocated(specs[0].port)
    return ServerGroup(arm, servers, endpoint, log)


def run_arm(arm: str, specs: list[ServerSpec], run: Run, outputs: Outputs, plugin_ep: tuple[str, str],
            arm_phases: list[str], current: dict, blocked: str | None = None) -> int:
    """Start the arm's servers, measure, stop them; the arm's JSON is written after every step.  The
    return code: 0 ok, 2 failed, 3 skipped or cut short for time.  `current["group"]` is the running
    group (the signal handler stops it); `blocked` fails the arm without starting anything."""
    args, dl, log = run.args, run.deadline, run.log
    state = args.state_dir
    rpath = state / f"arm-{arm}.json"
    result = {"arm": arm, "label": ARM_LABELS[arm], "status": "starting",
              "cmd": shlex.join(specs[0].cmd) if len(specs) == 1 else {spec.role: shlex.join(spec.cmd) for spec in specs},
              "pythonpath": specs[-1].env["PYTHONPATH"],
              "env": {k: specs[-1].env[k] for k in sorted(specs[-1].env)
                      if k.startswith(("SGLANG_", "HISPARSE_", "CUDA_HOME", "MC_", "LD_LIBRARY_PATH"))}
              | parse_env_assignments(args.plugin_env if arm in PLUGIN_ARMS else [])}
    old = json.loads(rpath.read_text()) if rpath.exists() else {}
    for p in ARM_PHASES:  # keep earlier phases not rerun now
        if p not in arm_phases and p in old:
            result[p] = old[p]

    def save():
        atomic_write(rpath, json.dumps(result, indent=1, default=str))
        outputs.publish()

    if blocked:
        result.update(status="failed", error=blocked)
        log(f"arm {arm}: FAILED before starting: {blocked}")
        save()
        return 2
    if dl.left() < args.arm_min_s:
        result.update(status="skipped", error=f"not started: {dl.left():.0f}s left < --arm-min-s {args.arm_min_s:.0f}")
        log(f"arm {arm}: SKIPPED ({result['error']}); rerun with --arms {arm}")
        if not old:
            save()
        return 3
    group = make_group(arm, specs, args, log)
    current["group"] = group
    for srv in group.servers:
        log(f"arm {arm} ({ARM_LABELS[arm]}): starting {srv.name} on port {srv.port}")
        log(f"  PYTHONPATH={srv.env['PYTHONPATH']}")
        log(f"  $ {shlex.join(srv.cmd)}")
    offsets = {srv.name: file_size(srv.log_path) for srv in group.servers}
    rc = 0
    try:
        group.start(args.pd_stagger_s)
        startup = group.wait_healthy(min(args.health_timeout, dl.left() - args.reserve_s))
        result["startup_s"] = max(startup.values())
        if len(startup) > 1:
            result["startup_s_per_server"] = startup
        log(f"  healthy after {startup}s")
        check_started(group, run, result, offsets, plugin_ep)
        result["status"] = "running"
        save()
        measure(group, run, result, arm_phases, save)
        result["status"] = "ok"
        cut = [p for p in arm_phases if (result.get(p) or {}).get("skipped") or (result.get(p) or {}).get("skipped_rest")]
        if cut:
            log(f"arm {arm}: phases cut short by the deadline: {cut}; rerun with --arms {arm} --phases {','.join(cut)}")
            rc = 3
        if bench_serving_phase.record_check_failures(result, arm_phases, log):
            rc = 2
    except (ServerDied, TimeoutError) as e:
        result.update(status="failed", error=str(e))
        log(f"arm {arm}: FAILED: {e}")
        rc = 2
    except Exception as e:
        tails = "\n".join(f"last log lines of {srv.name}:\n{log_tail(srv.log_path, 40)}" for srv in group.servers)
        result.update(status="failed", error=f"{type(e).__name__}: {e}\n{tails}")
        log(f"arm {arm}: FAILED: {type(e).__name__}: {e}")
        rc = 2
    finally:
        group.stop()
        current["group"] = None
        summarize_logs(group, offsets, result)
        kv = result["log"].get("kv_check")
        if kv:
            log(f"  in-server KV check: {kv['checks']} checks, {kv['rows']} rows compared, {kv['mismatches']} "
                f"mismatches" + (f"; first {kv['first_mismatch']}" if kv["first_mismatch"] else ""))
        if arm in PD_ARMS:
            result["pd"] = pd_evidence(result)
            for line in result["pd"]["statements"]:
                log(f"  PD evidence: {line}")
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
    prepare_layered_model(args)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    log = Log([state / "harness.log"] + ([args.out / "harness.log"] if args.out else []))
    log(f"run_e2e.py {' '.join(argv if argv is not None else sys.argv[1:])}")
    log(f"arms={args.arms} phases={args.phases} deadline={args.deadline_s:.0f}s state={state} out={args.out}")
    outputs = Outputs(state, args.out, args.import_results, args.arms)
    vocab = json.loads((args.model_dir / "config.json").read_text())["vocab_size"]
    meta = load_state(state)["meta"]
    meta.update({"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                 "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}})
    meta.setdefault("runs", []).append({"argv": sys.argv[1:] if argv is None else argv,
                                        "started": meta["date"]})
    run = Run(args, vocab, dl, log, started=meta["date"])

    env0, env_info = base_env(args, state, log)
    pd_env0 = mooncake_env(env0, args)
    common, plugin_dir, plugin_ep = prepare_pyext(state, args)
    if any(arm in MTP_ARMS for arm in args.arms):
        log(f"MTP arms: model {prepare_mtp_model(args)} (one NextN layer), flags {shlex.join(speculative_args(args))}"
            + (f", env {speculative_env(args)}" if args.mtp_accept_len else ""))
    meta["plugin_entry_point"] = f"{plugin_ep[0]} = {plugin_ep[1]}"

    specs = {arm: bench_serving_phase.server_specs(arm, arm_servers(arm, args, env0, pd_env0, common, plugin_dir), args)
             for arm in ALL_ARMS}
    if args.dry_run:
        for arm in args.arms:
            for spec in specs[arm]:
                diff = {k: v for k, v in spec.env.items() if os.environ.get(k) != v}
                print(f"# arm {arm}{' ' + spec.role if spec.role else ''}: {ARM_LABELS[arm]}")
                print("env " + " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(diff.items())))
                print(shlex.join(spec.cmd) + "\n")
        return 0

    current = {"group": None}

    def on_signal(signum, frame):
        log(f"signal {signum}: stopping")
        group = current["group"]
        if group is not None:
            for srv in group.servers:
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
    mooncake = meta["preflight"].get("mooncake")
    pd_blocked = None if mooncake is None or mooncake.get("ok") or args.allow_mooncake_failure else \
        f"the Mooncake preflight failed (bundle part 2 installed? tools/gpu-bundle/install_part.sh .e2e/parts/part2.tar.xz; "\
        f"--allow-mooncake-failure starts the PD arms anyway): " \
        f"{mooncake.get('import_error') or mooncake.get('error') or mooncake}"
    for arm in args.arms if arm_phases else []:
        rc = max(rc, run_arm(arm, specs[arm], run, outputs, plugin_ep, arm_phases, current,
                             blocked=pd_blocked if arm in PD_ARMS else None))
    if "hostpool" in args.phases:
        rc = max(rc, run_hostpool(run, env0, common, plugin_dir, current, meta, save_meta, outputs))
    meta["runs"][-1]["finished"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    save_meta()
    data = outputs.publish()
    log("report:\n" + render_markdown(data))
    log(f"done in {dl.elapsed():.0f}s (rc={rc}); results: {state / 'results.json'}"
        + (f" and {args.out}" if args.out else ""))
    return rc


if __name__ == "__main__":
    sys.exit(main())
