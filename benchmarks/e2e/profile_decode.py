#!/usr/bin/env python3
"""Where the decode step's time goes at a low concurrency (1 unless ``--concurrency``), per arm: host waits, host
work and GPU kernels.

For each variant (an arm of run_e2e.py, optionally with extra server flags, e.g.
``c+--disable-overlap-schedule``) this starts the server, warms it up and then

1. decodes one long request (``--trace-out`` tokens; ``--concurrency N``: N of them at once) during which
   * the fixture plugin records every synchronizing CUDA call of the scheduler process, with its
     Python stack, over decode batches ``--sync-window`` (``HISPARSE_E2E_SYNC_TRACE``), and
   * py-spy samples the scheduler process (``--idle``: waits count) for ``--spy-seconds``;
   * with ``--kernel-steps N``, SGLang's own profiler (``/start_profile``, torch profiler, GPU activity) records N
     forward steps, and the trace is summed per kernel name: GPU time per step and the kernels that take it;
   * with ``--host-steps N``, the same profiler with CPU activity and Python stacks records N steps of the
     scheduler's host work: every Python call, aten op and CUDA runtime call per step (``host_trace.py``), and
     each variant's calls are compared with the first variant's (``host_compare.json``, ``profile.md``);
2. decodes ``--repeats`` more requests without any instrumentation: time per output token;
3. with ``--placement-sweep``, pins every thread of the scheduler process to one CPU at a time (each CPU it may
   run on) and decodes ``--sweep-repeats`` requests of ``--sweep-output-len`` tokens per CPU, then restores its
   affinity and decodes once more: whether the time per token depends on where the scheduler runs (the CPU's
   SMT siblings and the other busy threads of the machine, sampled from /proc during the traced request, are
   recorded beside it).

With ``--pin-cpu CPU`` every thread of each server's scheduler process is pinned to that CPU once the server is
healthy (``paired_decode.py``'s setting), so the trace, py-spy's samples and the timed repeats see the host the
side-by-side runs see; the arms still run one after the other.
Over the timed repeats the scheduler's scheduling counters are recorded per output token (``/proc``: time on a
CPU and waiting on a run queue, context switches; main thread and all threads), and with ``--pin-cpu`` what the
pinned CPU did meanwhile (``/proc/stat`` ticks): whether a slower host step is more work or less CPU.

A variant is an arm (``c``, ``c+mtp``: run_e2e.py's arms, its flags from ``--harness-args``) optionally followed by
``+--flag+value`` server flags.

Everything goes to ``--out`` (``profile.json`` and ``profile.md``); py-spy is taken from
``--py-spy`` (a wheel carried to the GPU machine, unpacked by this script) and skipped if absent.

    python3 benchmarks/e2e/profile_decode.py --variants a,c,b,c+--disable-overlap-schedule --out $OUT
    python3 benchmarks/e2e/profile_decode.py --variants a+mtp,c+mtp --kernel-steps 30 \
        --harness-args "--mtp-steps 3 --mtp-accept-len 3 --plugin-hisparse-config '{\"device_buffer_size\": 8192}'"
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import client
import host_trace
import logs
import options
from arms import MTP_ARMS, arm_spec, prepare_layered_model, prepare_mtp_model, prepare_pyext
from common import REPO, Log
from environment import base_env
from servers import Server

SYNC_LINE = "[hisparse-e2e-fixture] pid="


def find_scheduler_pid(root_pid: int) -> int | None:
    """The descendant of ``root_pid`` whose command line is SGLang's scheduler process title."""
    children = collections.defaultdict(list)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children[ppid].append(int(entry.name))
    stack, found = [root_pid], []
    while stack:
        pid = stack.pop()
        for child in children.get(pid, []):
            stack.append(child)
            try:
                cmdline = Path(f"/proc/{child}/cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if "scheduler" in cmdline:
                found.append(child)
    return min(found) if found else None


def cpu_topology() -> dict:
    """CPU -> its SMT siblings (``thread_siblings_list``) and the machine's model name."""
    siblings = {}
    for cpu in sorted(os.sched_getaffinity(0)):
        path = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        siblings[cpu] = path.read_text().strip() if path.exists() else "?"
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), "?")
    return {"model": model, "siblings": siblings}


# Fields of a /proc/<pid>[/task/<tid>]/stat after the name: user and system clock ticks, the CPU last run on.
_UTIME, _STIME, _LAST_CPU = 11, 12, 36


def proc_stat(path: Path | str) -> tuple[str, list[str]]:
    """(name, the fields after it) of a /proc stat file (the name may hold spaces and parentheses)."""
    head, tail = Path(path).read_text().rsplit(")", 1)
    return head.split("(", 1)[1], tail.split()


def thread_times() -> dict[tuple[int, int], tuple[str, int, int]]:
    """(pid, tid) -> (name, user+system clock ticks, CPU last run on) of every thread on the machine."""
    out = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            tasks = list((proc / "task").iterdir())
        except OSError:
            continue
        for task in tasks:
            try:
                name, fields = proc_stat(task / "stat")
            except OSError:
                continue
            out[(int(proc.name), int(task.name))] = (name, int(fields[_UTIME]) + int(fields[_STIME]),
                                                     int(fields[_LAST_CPU]))
    return out


def busy_threads(seconds: float, top: int = 12) -> list[dict]:
    """The threads that used the most CPU time over ``seconds`` (share of one CPU, and the CPU each ran on)."""
    before = thread_times()
    time.sleep(seconds)
    after = thread_times()
    hz = os.sysconf("SC_CLK_TCK")
    rows = []
    for key, (name, ticks, cpu) in after.items():
        used = ticks - before.get(key, (name, ticks, cpu))[1]
        if used > 0:
            rows.append({"pid": key[0], "tid": key[1], "name": name, "cpu": cpu,
                         "busy": round(used / hz / seconds, 2)})
    return sorted(rows, key=lambda r: -r["busy"])[:top]


def sched_totals(pid: int) -> dict | None:
    """The kernel's scheduling counters of process ``pid``, its main thread apart and all its threads summed:
    time on a CPU and waiting on a run queue (ns, ``/proc/<pid>/task/<tid>/schedstat``), voluntary and
    involuntary context switches (``status``); None once the process is gone."""
    fields = ("cpu_ns", "runqueue_ns", "voluntary", "involuntary")
    main, every = dict.fromkeys(fields, 0), dict.fromkeys(fields, 0)
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return None
    for task in tasks:
        try:
            cpu_ns, wait_ns = (int(v) for v in (task / "schedstat").read_text().split()[:2])
            status = dict(line.split(":", 1) for line in (task / "status").read_text().splitlines() if ":" in line)
        except (OSError, ValueError):  # the thread ended
            continue
        values = (cpu_ns, wait_ns, int(status["voluntary_ctxt_switches"]), int(status["nonvoluntary_ctxt_switches"]))
        for key, value in zip(fields, values):
            every[key] += value
            if int(task.name) == pid:
                main[key] += value
    return {"main": main, "all": every}


def cpu_ticks(cpu: int) -> dict:
    """Clock ticks of one CPU by kind (``/proc/stat``): user, nice, system, idle, iowait, irq, softirq."""
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith(f"cpu{cpu} "):
            values = [int(v) for v in line.split()[1:8]]
            return dict(zip(("user", "nice", "system", "idle", "iowait", "irq", "softirq"), values))
    return {}


def sched_per_token(before: dict | None, after: dict | None, tokens: int) -> dict | None:
    """The counters' growth between two :func:`sched_totals` per output token (ms for times, switches per 1,000
    tokens); None if either is missing (the process ended)."""
    if before is None or after is None:
        return None
    out = {}
    for scope in ("main", "all"):
        delta = {k: after[scope][k] - before[scope][k] for k in after[scope]}
        out[scope] = {"cpu_ms": round(delta["cpu_ns"] / 1e6 / tokens, 4),
                      "runqueue_ms": round(delta["runqueue_ns"] / 1e6 / tokens, 4),
                      "voluntary_per_1k": round(1e3 * delta["voluntary"] / tokens, 1),
                      "involuntary_per_1k": round(1e3 * delta["involuntary"] / tokens, 1)}
    return out


def pin_process(pid: int, cpus: set[int]) -> dict[int, set[int]]:
    """Set the affinity of every thread of ``pid``; returns each thread's previous affinity."""
    previous = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        tid = int(task.name)
        try:
            previous[tid] = os.sched_getaffinity(tid)
            os.sched_setaffinity(tid, cpus)
        except OSError:  # the thread ended
            pass
    return previous


def start_streams(port: int, prompts: list[list[int]], output_len: int) -> tuple[list[threading.Thread], list[dict]]:
    """Every prompt streamed at once, each from a thread started here: the threads (to join) and the outputs they
    fill (``client.generate_stream``'s, in prompt order)."""
    outs: list[dict] = [{} for _ in prompts]
    threads = [threading.Thread(target=lambda i=i, prompt=prompt: outs[i].update(
        client.generate_stream(port, prompt, output_len, timeout=600))) for i, prompt in enumerate(prompts)]
    for thread in threads:
        thread.start()
    return threads, outs


def timed_requests(port: int, prompts: list[list[int]], output_len: int,
                   concurrency: int = 1) -> tuple[list[float], list]:
    """The prompts decoded ``concurrency`` at a time (consecutive ones together), one group after the other: per
    group the median time per output token of its requests (ms, rounded to microseconds), and the errors of the
    requests that gave none."""
    tpots, errors = [], []
    for start in range(0, len(prompts), concurrency):
        threads, outs = start_streams(port, prompts[start:start + concurrency], output_len)
        for thread in threads:
            thread.join()
        group_tpots = [out["tpot_s"] for out in outs if out.get("tpot_s")]
        errors += [out.get("error") for out in outs if not out.get("tpot_s")]
        if group_tpots:
            tpots.append(round(1e3 * statistics.median(group_tpots), 3))
    return tpots, errors


def placement_sweep(port: int, pid: int, args, vocab: int, log) -> dict:
    """Time per output token with the scheduler process pinned to each CPU in turn, then unpinned again."""
    cpus = sorted(os.sched_getaffinity(pid))
    prompts = [client.make_prompt(200, args.input_len, vocab)] * args.sweep_repeats

    def tpot() -> list[float]:
        return timed_requests(port, prompts, args.sweep_output_len)[0]

    per_cpu = {}
    original = None
    for cpu in cpus:
        previous = pin_process(pid, {cpu})
        original = original or previous
        per_cpu[cpu] = tpot()
    for tid, mask in (original or {}).items():
        try:
            os.sched_setaffinity(tid, mask)
        except OSError:
            pass
    unpinned = tpot()
    log(f"placement sweep: per CPU {per_cpu}; unpinned again {unpinned}")
    return {"per_cpu_tpot_ms": per_cpu, "unpinned_tpot_ms": unpinned, "cpus": cpus}


def unpack_py_spy(wheel: Path, dest: Path) -> Path | None:
    if not wheel.exists():
        return None
    with zipfile.ZipFile(wheel) as archive:
        name = next((n for n in archive.namelist() if n.endswith("/scripts/py-spy")), None)
        if name is None:
            return None
        target = dest / "py-spy"
        target.write_bytes(archive.read(name))
    target.chmod(0o755)
    return target


def summarize_spy(raw: str, top: int = 60, within: str = "Scheduler.event_loop") -> dict:
    """Inclusive and self sample shares per frame from py-spy's collapsed ``--format raw`` output,
    over the stacks that pass through a frame containing ``within`` (the scheduler's event loop:
    its thread's time, idle waits included)."""
    inclusive: collections.Counter = collections.Counter()
    self_time: collections.Counter = collections.Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit() or within not in stack:
            continue
        n = int(count)
        total += n
        frames = [f.strip() for f in stack.split(";") if f.strip()]
        for frame in set(frames):
            inclusive[frame] += n
        if frames:
            self_time[frames[-1]] += n
    def share(c):
        return [{"frame": f, "pct": round(100 * n / max(total, 1), 1)} for f, n in c.most_common(top)]

    return {"samples": total, "inclusive": share(inclusive), "self": share(self_time)}


def wait_for_trace(trace_dir: Path, timeout: float = 90.0) -> None:
    """Until the trace SGLang writes once the profiled steps are done has appeared and its size held for 2 s (a
    large trace is still being compressed when it first shows: reading it then ended in EOFError on an H200)."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        sizes = sorted((str(path), path.stat().st_size) for path in trace_dir.rglob("*.json*"))
        if sizes and sizes == last:
            return
        last = sizes
        time.sleep(2)


def summarize_kernels(trace_dir: Path, steps: int, top: int = 25) -> dict:
    """GPU kernel time of a torch-profiler trace SGLang wrote under ``trace_dir``: total and per step, the ``top``
    kernels by total time (name, calls, microseconds per step), and the GPU's idle time: the span from the first
    kernel's start to the last one's end less the time some kernel ran, per step, with the ``top`` kinds of gap
    (the kernel before and the kernel after) by their total."""
    try:
        trace, events = host_trace.read_trace(trace_dir)
    except FileNotFoundError as exc:
        return {"error": str(exc)}
    total: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    spans = []
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            name = e["name"][:120]
            total[name] += float(e.get("dur", 0.0))
            calls[name] += 1
            spans.append((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)), name))
    us = sum(total.values())
    out = {"trace": trace, "steps": steps, "gpu_us": round(us, 1), "gpu_us_per_step": round(us / steps, 1),
           "kernels": [{"name": n, "calls": calls[n], "us_per_step": round(t / steps, 1)}
                       for n, t in total.most_common(top)]}
    if spans:
        out |= gpu_idle(spans, steps, top)
    return out


def gpu_idle(spans: list[tuple[float, float, str]], steps: int, top: int) -> dict:
    """Span, busy time (the union of the kernels' intervals) and idle time per step of ``(start, end, name)``
    kernel intervals (microseconds), and the gaps summed by ``(kernel before, kernel after)``."""
    spans = sorted(spans)
    busy = 0.0
    gaps: collections.Counter = collections.Counter()
    gap_calls: collections.Counter = collections.Counter()
    start, end, before = spans[0]
    for s, e, name in spans[1:]:
        if s > end:
            busy += end - start
            gaps[(before[:60], name[:60])] += s - end
            gap_calls[(before[:60], name[:60])] += 1
            start = s
        if e >= end:
            end, before = e, name
    busy += end - start
    span = max(e for _, e, _ in spans) - spans[0][0]
    return {"span_us_per_step": round(span / steps, 1), "busy_us_per_step": round(busy / steps, 1),
            "idle_us_per_step": round((span - busy) / steps, 1),
            "gaps": [{"before": b, "after": a, "count": gap_calls[(b, a)], "us_per_step": round(t / steps, 1)}
                     for (b, a), t in gaps.most_common(top)]}


def profile_steps(port: int, trace_dir: Path, steps: int, **request) -> None:
    """SGLang's profiler (``/start_profile`` with ``request``'s activities and options) over ``steps`` forward
    steps, into ``trace_dir`` (emptied first), until the trace is written."""
    shutil.rmtree(trace_dir, ignore_errors=True)  # an earlier call's trace is not this one's
    try:
        client.http_json("POST", port, "/start_profile", {"output_dir": str(trace_dir), "num_steps": steps, **request},
                         timeout=120)
    except ValueError:  # a reply that is not JSON: the profile still runs
        pass
    wait_for_trace(trace_dir)


def record_host(port: int, trace_dir: Path, steps: int) -> dict:
    """``steps`` forward steps of the scheduler's host work (SGLang's profiler, CPU activity, Python stacks),
    summarized by host_trace.summarize."""
    profile_steps(port, trace_dir, steps, activities=["CPU"], with_stack=True)
    try:
        name, events = host_trace.load_events(trace_dir)
        return {"trace": name} | host_trace.summarize(events, steps)
    except (FileNotFoundError, ValueError) as exc:  # no trace, or one without Python events: the variant goes on
        return {"error": str(exc)}


def sync_traces(log_text: str) -> list[dict]:
    traces = []
    for line in log_text.splitlines():
        if SYNC_LINE in line and " sync-trace " in line:
            traces.append(json.loads(line.split(" sync-trace ", 1)[1]))
    return traces


def run_variant(variant: str, args, env0, common, plugin_dir, vocab: int, spy: Path | None, log) -> dict:
    arm, sep, extra = variant.partition("+--")
    port = args.port_base
    cmd, env = arm_spec(arm, args, env0, common, plugin_dir, port)
    cmd += shlex.split((sep[1:] + extra).replace("+", " "))
    env["HISPARSE_E2E_SYNC_TRACE"] = args.sync_window
    name = variant.replace("+--", "-").replace("+", "-")
    log_path = args.state_dir / f"server-profile-{name}.log"
    server = Server(f"profile-{name}", cmd, env, log_path, port, args.state_dir, log)
    result = {"variant": variant, "cmd": shlex.join(cmd)}
    try:
        server.start()
        result["startup_s"] = round(server.wait_healthy(args.health_timeout), 1)
        client.generate(port, client.make_prompt(3, 4096, vocab), 16, timeout=300)
        log(f"{variant}: healthy after {result['startup_s']} s")
        scheduler = find_scheduler_pid(server.proc.pid)  # one process for the server's life
        if args.pin_cpu is not None:  # as paired_decode.py measures: every thread of the scheduler on one CPU
            if scheduler is None:
                raise RuntimeError("--pin-cpu: no scheduler process found")
            pin_process(scheduler, {args.pin_cpu})
            result["pinned_cpu"] = args.pin_cpu
        threads, traced = start_streams(
            port, [client.make_prompt(11 + i, args.input_len, vocab) for i in range(args.concurrency)], args.trace_out)
        scheduler_pid = scheduler if args.placement_sweep else None
        if scheduler_pid is not None:  # where the scheduler runs and what else is busy, beside the sweep
            result["scheduler_cpu"] = int(proc_stat(f"/proc/{scheduler_pid}/stat")[1][_LAST_CPU])
            result["busy_threads"] = busy_threads(1.0)
        if args.kernel_steps:
            time.sleep(args.spy_delay)
            trace_dir = args.state_dir / f"torch-{name}"
            profile_steps(port, trace_dir, args.kernel_steps, activities=["GPU"])
            result["kernels"] = summarize_kernels(trace_dir, args.kernel_steps)
        if args.host_steps:
            time.sleep(args.spy_delay)
            result["host"] = record_host(port, args.state_dir / f"torch-host-{name}", args.host_steps)
        if spy is not None:
            time.sleep(args.spy_delay)
            pid = scheduler
            if pid is None:
                result["spy_error"] = "no scheduler process found"
            else:
                raw_path = args.state_dir / f"spy-{name}.txt"
                proc = subprocess.run(
                    [str(spy), "record", "--pid", str(pid), "--duration", str(args.spy_seconds), "--rate",
                     str(args.spy_rate), "--format", "raw", "--idle", *([] if args.spy_blocking else ["--nonblocking"]),
                     "--output", str(raw_path)],
                    capture_output=True, text=True, timeout=args.spy_seconds + 60,
                )
                if raw_path.exists():
                    result["spy"] = summarize_spy(raw_path.read_text(), top=args.spy_top)
                else:
                    result["spy_error"] = (proc.stderr or proc.stdout)[-800:]
        for thread in threads:
            thread.join()
        result["traced_requests"] = [{k: t.get(k) for k in ("tokens", "tpot_s", "error")} for t in traced]
        sched_before = sched_totals(scheduler) if scheduler else None
        ticks_before = cpu_ticks(args.pin_cpu) if args.pin_cpu is not None else None
        tpots, errors = timed_requests(
            port, [client.make_prompt(100 + i, args.input_len, vocab) for i in range(args.repeats * args.concurrency)],
            args.output_len, args.concurrency)
        if scheduler:  # the scheduler's share of the CPU over the timed repeats, per output token
            tokens = max(args.repeats * args.concurrency * args.output_len, 1)
            result["scheduler_sched"] = sched_per_token(sched_before, sched_totals(scheduler), tokens)
        if ticks_before is not None:  # what else ran on the pinned CPU meanwhile
            ticks_after = cpu_ticks(args.pin_cpu)
            result["pinned_cpu_ticks"] = {k: ticks_after[k] - ticks_before.get(k, 0) for k in ticks_after}
        if errors:
            result["errors"] = errors
        result["tpot_ms"] = tpots
        if tpots:
            result["tpot_ms_median"] = round(statistics.median(tpots), 3)
        log(f"{variant}: TPOT ms {result['tpot_ms']}")
        if scheduler_pid is not None:
            result["placement"] = placement_sweep(port, scheduler_pid, args, vocab, log)
    except Exception as exc:  # the other variants still run
        result["error"] = f"{type(exc).__name__}: {exc}"
        log(f"{variant}: FAILED {result['error']}")
    finally:
        server.stop()
        text = logs.log_since_start(log_path)  # a warm machine's state dir keeps earlier servers' lives
        result["sync_traces"] = sync_traces(text)
        result["hisparse_log"] = logs.summarize_hisparse(text)
    return result


def render(results: list[dict]) -> str:
    lines = ["| variant | TPOT ms (median of repeats) | repeats | syncs per decode batch |", "|---|---|---|---|"]
    for r in results:
        trace = (r.get("sync_traces") or [{}])[-1]
        per_batch = trace.get("syncs", 0) / max(trace.get("decode_batches", 1), 1) if trace else None
        lines.append(f"| {r['variant']} | {r.get('tpot_ms_median')} | {r.get('tpot_ms')} | "
                     f"{per_batch if per_batch is None else round(per_batch, 2)} |")
    for r in results:
        lines.append(f"\n### {r['variant']}\n")
        if "pinned_cpu" in r:
            lines.append(f"scheduler process pinned to CPU {r['pinned_cpu']} (every thread)\n")
        sched = r.get("scheduler_sched")
        if sched:
            lines.append("scheduler over the timed repeats, per output token (ms on a CPU, ms waiting on a run queue, "
                         "voluntary / involuntary context switches per 1,000 tokens): main thread "
                         + ", ".join(str(v) for v in sched["main"].values()) + "; all threads "
                         + ", ".join(str(v) for v in sched["all"].values())
                         + (f"; the pinned CPU's clock ticks meanwhile {r['pinned_cpu_ticks']}"
                            if "pinned_cpu_ticks" in r else "") + "\n")
        if "scheduler_cpu" in r:
            lines.append(f"scheduler process on CPU {r['scheduler_cpu']}; busiest threads during the traced request "
                         "(share of one CPU, CPU): " + ", ".join(
                             f"{t['name']} {t['busy']} @{t['cpu']}" for t in r.get("busy_threads", [])))
        placement = r.get("placement")
        if placement:
            lines.append("\nscheduler pinned to one CPU, TPOT ms per CPU: " + "; ".join(
                f"{cpu}: {v}" for cpu, v in placement["per_cpu_tpot_ms"].items())
                + f"; unpinned again: {placement['unpinned_tpot_ms']}\n")
        for trace in r.get("sync_traces", []):
            for s in trace.get("stacks", [])[:8]:
                lines.append(f"- {s['count']}x `{s['stack'][:600]}`")
        kernels = r.get("kernels") or {}
        if kernels.get("kernels"):
            lines.append(f"\nGPU time per forward step {kernels['gpu_us_per_step']} us ({kernels['steps']} steps):\n")
            lines += [f"- {k['us_per_step']} us/step, {k['calls']} calls: `{k['name']}`" for k in kernels["kernels"]]
            if "span_us_per_step" in kernels:
                lines.append(f"\nGPU timeline per step: span {kernels['span_us_per_step']} us, busy "
                             f"{kernels['busy_us_per_step']} us, idle {kernels['idle_us_per_step']} us; the gaps "
                             "by the kernels around them:\n")
                lines += [f"- {g['us_per_step']} us/step, {g['count']} gaps: `{g['before']}` -> `{g['after']}`"
                          for g in kernels["gaps"]]
        elif kernels:
            lines.append(f"\nkernel profile: {kernels.get('error')}")
        spy = r.get("spy") or {}
        if spy:
            lines.append(f"\npy-spy ({spy['samples']} samples), inclusive:\n")
            lines += [f"- {e['pct']} % {e['frame']}" for e in spy["inclusive"][:40]]
            lines.append("\nself:\n")
            lines += [f"- {e['pct']} % {e['frame']}" for e in spy["self"][:25]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="a,c")
    parser.add_argument("--input-len", type=int, default=16384)
    parser.add_argument("--output-len", type=int, default=1024)
    parser.add_argument("--trace-out", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=1,
                        help="requests decoded at once while traced and per timed repeat")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--sync-window", default="100:300", help="first decode batch : number of batches")
    parser.add_argument("--spy-delay", type=float, default=2.5, help="seconds after the traced request starts")
    parser.add_argument("--spy-seconds", type=int, default=2)
    parser.add_argument("--spy-rate", type=int, default=1000)
    parser.add_argument("--spy-blocking", action="store_true",
                        help="py-spy pauses the scheduler for each sample: whole stacks (without it a sample may mix "
                             "frames of two moments), at the cost of slowing it")
    parser.add_argument("--spy-top", type=int, default=60, help="frames kept per py-spy summary (inclusive and self)")
    parser.add_argument("--py-spy", type=Path, default=REPO / ".whl" / "py_spy-0.4.3-py2.py3-none-manylinux1_x86_64.manylinux_2_5_x86_64.whl")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/hisparse_profile")))
    parser.add_argument("--port-base", type=int, default=31100)
    parser.add_argument("--health-timeout", type=float, default=420)
    parser.add_argument("--kernel-steps", type=int, default=0,
                        help="record this many forward steps with SGLang's profiler and sum GPU time per kernel")
    parser.add_argument("--host-steps", type=int, default=0,
                        help="record this many forward steps of the scheduler's host work (CPU activity, Python "
                             "stacks) and compare every variant's calls per step with the first's (host_trace.py)")
    parser.add_argument("--pin-cpu", type=int, default=None,
                        help="pin every thread of each server's scheduler process to this CPU once it is healthy "
                             "(paired_decode.py's setting), for the trace, py-spy and the timed repeats")
    parser.add_argument("--placement-sweep", action="store_true",
                        help="time per token with the scheduler process pinned to each CPU in turn")
    parser.add_argument("--sweep-repeats", type=int, default=2)
    parser.add_argument("--sweep-output-len", type=int, default=256)
    parser.add_argument("--harness-args", default="", help="run_e2e.py flags of the servers (shell-quoted string)")
    args = parser.parse_args(argv)
    # the server flags of run_e2e.py, with its defaults
    harness_args = options.parse_args(shlex.split(args.harness_args))
    for key, value in vars(harness_args).items():
        if not hasattr(args, key):
            setattr(args, key, value)
    args.state_dir.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    log = Log([args.out / "profile.log"])
    env0, _ = base_env(args, args.state_dir, log)
    prepare_layered_model(args)
    common, plugin_dir, _ = prepare_pyext(args.state_dir, args)
    if any(v.partition("+--")[0] in MTP_ARMS for v in args.variants.split(",")):
        prepare_mtp_model(args)
    vocab = json.loads((args.model_dir / "config.json").read_text())["vocab_size"]
    spy = unpack_py_spy(args.py_spy, args.state_dir)
    log(f"py-spy: {spy}")
    results = []
    if args.placement_sweep:
        topology = cpu_topology()
        log(f"CPUs: {topology}")
        (args.out / "cpu_topology.json").write_text(json.dumps(topology, indent=1))
    for variant in args.variants.split(","):
        results.append(run_variant(variant, args, env0, common, plugin_dir, vocab, spy, log))
        (args.out / "profile.json").write_text(json.dumps(results, indent=1))
        (args.out / "profile.md").write_text(render(results))
    hosts = [r for r in results if "functions" in (r.get("host") or {})]
    if len(hosts) > 1:
        comparisons = {r["variant"]: host_trace.compare(hosts[0]["host"], r["host"]) for r in hosts[1:]}
        (args.out / "host_compare.json").write_text(json.dumps(comparisons, indent=1))
        text = "".join(f"\n### Host work: {variant} against {hosts[0]['variant']}\n\n"
                       + host_trace.render_comparison((hosts[0]["variant"], variant), diff)
                       for variant, diff in comparisons.items())
        with (args.out / "profile.md").open("a") as f:
            f.write(text)
        log(text)
    log(render(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
