"""The hostpool phase (issue #27, item 3): a server with the plugin and a large host pool, how fast the pool is
pinned, and how long the node stays busy after the server is stopped.

The plugin's host pool holds `host_to_device_ratio` times the GPU KV pool's tokens in every layer
(hisparse_sglang.integration.sglang.runtime.host_pages_for: (device tokens x ratio // 64 + 1) pages of 64
rows; a row is one token of one layer: 1152 B in bf16, 656 B in fp8). The phase picks the smallest ratio whose
pool reaches `--hostpool-gib` (or, with `max`, the largest that fits), says so, and refuses cleanly
(`refused`, exit code 2) where the host cannot hold it: the plugin itself refuses pools above 90 % of the
memory it finds available (MemAvailable, or the memory cgroup's headroom), and the server needs
`--hostpool-margin-gib` beside its pool.

Then, once per signal of `--hostpool-signals` (default SIGTERM, then SIGKILL), the server of arm
`--hostpool-arm` (c: co-located, resident-first) starts with that ratio; from its log: the pool's size and its
`ready in ... s (... GiB/s; touched in ... s, pinned in ... s, N threads)` line. The signal goes to the server's
main process (as an orchestrator sends it; SGLang's scheduler and detokenizer die with it through
PR_SET_PDEATHSIG), and the phase polls every 50 ms: the main process exited, its process group gone, the host
memory back (MemAvailable regained `--hostpool-release-fraction` of what the server held), the GPU memory back
(nvidia-smi, where present) and the port free. After `--hostpool-teardown-max-s` the group is SIGKILLed.
A start passes when the pinning rate is at least `--hostpool-min-rate` GiB/s (the issue's target 10) and the
group is gone with its memory back within `--hostpool-teardown-ok-s`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

from arms import arm_spec, port_offsets
from client import Colocated
from common import REPO, Run
from logs import file_size, read_from
from servers import Server, ServerDied, ServerGroup, group_pids, port_free

if str(REPO / "src") not in sys.path:
    sys.path.insert(0, str(REPO / "src"))
from hisparse_sglang.integration.sglang.limits import HOST_MEMORY_USABLE_FRACTION, host_memory_available  # noqa: E402

GIB = 2**30
PAGE = 64
MAX_RATIO = 1024  # hisparse_sglang.config: host_to_device_ratio in [1, 1024]
INDEX_K_BYTES = 132  # the indexer's key per token and layer (GPU, over the whole logical space)
SIGNALS = {"SIGTERM": signal.SIGTERM, "SIGKILL": signal.SIGKILL}
MEM_KEYS = ("MemAvailable", "MemFree")
HOSTPOOL_PORT_OFFSET = 95  # the phase's own server, beside every arm's port (arms.port_offsets)
POOL_RE = re.compile(r"HiSparse host pool: (?P<layers>\d+) layers x (?P<rows>\d+) rows x (?P<row_bytes>\d+) B = "
                     r"(?P<gib>[0-9.]+) GiB")
READY_RE = re.compile(r"HiSparse host pool: (?P<gib>[0-9.]+) GiB ready in (?P<ready_s>[0-9.]+) s \((?P<rate>[0-9.]+) GiB/s; "
                      r"touched in (?P<touch_s>[0-9.]+) s(?:, pinned in (?P<pin_s>[0-9.]+) s)?, (?P<threads>\d+) threads\)")


# ---------------------------------------------------------------------------------------------- options
def add_hostpool_args(ap) -> None:
    g = ap.add_argument_group("hostpool (opt-in phase, issue #27: a large host pool's pinning and teardown)")
    g.add_argument("--hostpool-gib", default="100",
                   help="host pool to start, GiB, or 'max' (the largest this host allows); default %(default)s")
    g.add_argument("--hostpool-arm", choices=("c", "d"), default="c", help="whose server flags (default %(default)s)")
    g.add_argument("--hostpool-device-tokens", type=int, default=0,
                   help="the server's --max-total-tokens, the GPU pool the ratio multiplies (0: --max-total-tokens)")
    g.add_argument("--hostpool-signals", default="SIGTERM,SIGKILL",
                   help="one start per signal, in this order (default %(default)s)")
    g.add_argument("--hostpool-margin-gib", type=float, default=6.0,
                   help="host memory the server needs beside its pool (refuse below pool + this)")
    g.add_argument("--hostpool-teardown-max-s", type=float, default=180,
                   help="stop watching the teardown after this long and SIGKILL what is left")
    g.add_argument("--hostpool-teardown-ok-s", type=float, default=60,
                   help="a teardown passes when the processes are gone and the memory is back within this long")
    g.add_argument("--hostpool-min-rate", type=float, default=10.0, help="pinning rate a start needs, GiB/s")
    g.add_argument("--hostpool-release-fraction", type=float, default=0.9,
                   help="share of the memory the server held that must be back for 'released'")
    g.add_argument("--hostpool-min-held-gib", type=float, default=1.0,
                   help="judge the host memory's release only where the server held at least this much")


def check_hostpool_args(ap, args) -> None:
    try:
        args.hostpool_gib = parse_gib(args.hostpool_gib)
        args.hostpool_signals = parse_signals(args.hostpool_signals)
    except ValueError as e:
        ap.error(str(e))
    if not 0 < args.hostpool_release_fraction <= 1:
        ap.error("--hostpool-release-fraction must be in (0, 1]")
    if args.hostpool_device_tokens < 0 or args.hostpool_margin_gib < 0:
        ap.error("--hostpool-device-tokens and --hostpool-margin-gib must be >= 0")
    if args.hostpool_teardown_max_s <= 0 or args.hostpool_teardown_ok_s <= 0:
        ap.error("--hostpool-teardown-max-s and --hostpool-teardown-ok-s must be > 0")


def parse_gib(spec):
    if isinstance(spec, (int, float)) or spec == "max":
        return spec
    if str(spec).strip().lower() == "max":
        return "max"
    v = float(spec)
    if not v > 0 or math.isinf(v):
        raise ValueError(f"--hostpool-gib must be a positive number of GiB or 'max', got {spec!r}")
    return v


def parse_signals(spec) -> list[str]:
    if isinstance(spec, list):
        return spec
    items = [s.strip().upper() for s in str(spec).split(",") if s.strip()]
    items = [s if s.startswith("SIG") else "SIG" + s for s in items]
    bad = [s for s in items if s not in SIGNALS]
    if bad or not items:
        raise ValueError(f"--hostpool-signals takes SIGTERM and/or SIGKILL, got {spec!r}")
    return items


# ---------------------------------------------------------------------------------------------- sizing
def model_rows(model_dir, kv_cache_dtype: str) -> tuple[int, int]:
    """(layers, bytes of one row) of the model's MLA KV cache."""
    cfg = json.loads((model_dir / "config.json").read_text())
    kv, rope = int(cfg["kv_lora_rank"]), int(cfg["qk_rope_head_dim"])
    row = (kv + rope) * 2 if kv_cache_dtype == "bfloat16" else kv + kv // 128 * 4 + rope * 2
    return int(cfg["num_hidden_layers"]), row


def pool_bytes(device_tokens: int, ratio: int, layers: int, row: int) -> int:
    """The plugin's host pool for a ratio: (device tokens x ratio // 64 + 1) pages of 64 rows, every layer."""
    return (device_tokens * ratio // PAGE + 1) * PAGE * layers * row


def plan_pool(target, device_tokens: int, layers: int, row: int, usable: int) -> dict:
    """The ratio that gives the requested pool (the smallest reaching it; with 'max' the largest that fits
    `usable` bytes), its size and the sentence that says so; `refused` where the host cannot hold it."""
    size = lambda r: pool_bytes(device_tokens, r, layers, row)  # noqa: E731
    fitting = [r for r in range(1, MAX_RATIO + 1) if size(r) <= usable]
    largest = max(fitting) if fitting else None
    out = {"device_tokens": device_tokens, "layers": layers, "row_bytes": row, "usable_gib": round(usable / GIB, 2),
           "largest_ratio_that_fits": largest,
           "largest_gib_that_fits": round(size(largest) / GIB, 2) if largest else None}
    if target == "max":
        if largest is None:
            out["refused"] = {"type": "InsufficientHostMemory",
                              "message": f"even host_to_device_ratio 1 ({size(1) / GIB:.2f} GiB) exceeds the "
                                         f"{usable / GIB:.2f} GiB this host can give a host pool"}
            return out
        ratio = largest
    else:
        want = int(target * GIB)
        ratio = next((r for r in range(1, MAX_RATIO + 1) if size(r) >= want), MAX_RATIO)
        if want > usable and size(ratio) < want:
            out["refused"] = {"type": "InsufficientHostMemory",
                              "message": f"a {target:g} GiB host pool is more than the {usable / GIB:.2f} GiB this host "
                                         f"can give a host pool; the largest it allows is "
                                         f"{size(largest) / GIB if largest else 0:.2f} GiB: rerun with --hostpool-gib max"}
            return out
        if size(ratio) < want:
            out["refused"] = {"type": "SizeBeyondRatioLimit",
                              "message": f"with a GPU KV pool of {device_tokens} tokens even host_to_device_ratio "
                                         f"{MAX_RATIO} gives only {size(ratio) / GIB:.2f} GiB, less than {target:g} GiB: "
                                         f"raise --hostpool-device-tokens (the server's --max-total-tokens)"}
            return out
        if size(ratio) > usable:
            fix = (f"the largest pool it allows is {size(largest) / GIB:.2f} GiB (ratio {largest}): rerun with "
                   f"--hostpool-gib max or --hostpool-gib {math.floor(size(largest) / GIB * 100) / 100}" if largest
                   else "not even ratio 1 fits")
            out["refused"] = {"type": "InsufficientHostMemory",
                              "message": f"a {target:g} GiB host pool needs host_to_device_ratio {ratio} "
                                         f"({size(ratio) / GIB:.2f} GiB), more than the {usable / GIB:.2f} GiB this host "
                                         f"can give it; {fix}"}
            out["ratio"] = ratio
            return out
    out.update(ratio=ratio, host_rows=(device_tokens * ratio // PAGE + 1) * PAGE,
               predicted_gib=round(size(ratio) / GIB, 3),
               gpu_index_k_gib=round((device_tokens * ratio // PAGE + 1) * PAGE * layers * INDEX_K_BYTES / GIB, 2))
    out["sentence"] = (f"host_to_device_ratio {ratio}: a GPU KV pool of {device_tokens} tokens x {ratio} = "
                       f"{out['host_rows']} host rows (page 0 included) x {layers} layers x {row} B = "
                       f"{out['predicted_gib']} GiB of pinned host memory (and {out['gpu_index_k_gib']} GiB of indexer "
                       f"keys on the GPU, which cover the same logical space)")
    return out


# ---------------------------------------------------------------------------------------------- probes
def meminfo(*keys: str) -> dict:
    """Fields of /proc/meminfo, bytes (absent where unreadable)."""
    out = {}
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/meminfo") as f:
        for line in f:
            name = line.split(":", 1)[0]
            if name in keys:
                out[name] = int(line.split()[1]) * 1024
    return out


def live_pids(pgid: int) -> list[int]:
    """The processes of a process group that have not exited (a zombie has freed its memory already and waits
    only for its parent, or for init once reparented, to reap it)."""
    out = []
    for pid in group_pids(pgid):
        with contextlib.suppress(OSError, IndexError), open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
                out.append(pid)
    return out


def group_rss(pgid: int) -> int:
    total = 0
    for pid in live_pids(pgid):
        with contextlib.suppress(OSError, ValueError, IndexError), open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
    return total


def gpu_used_mib() -> float | None:
    """GPU memory in use (MiB, summed over the GPUs nvidia-smi lists); None without nvidia-smi."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    with contextlib.suppress(Exception):
        p = subprocess.run([exe, "--query-gpu=memory.used", "--format=csv,noheader,nounits"], capture_output=True,
                           text=True, timeout=10, check=False)
        if p.returncode == 0:
            return float(sum(float(x) for x in p.stdout.split()))
    return None


class GpuSampler:
    """nvidia-smi every 0.25 s on a thread (a call takes tens of ms): the latest reading."""

    def __init__(self):
        self.latest, self.stop = gpu_used_mib(), threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True) if self.latest is not None else None
        if self.thread:
            self.thread.start()

    def _loop(self):
        while not self.stop.wait(0.25):
            v = gpu_used_mib()
            if v is not None:
                self.latest = v

    def close(self):
        self.stop.set()


def parse_pool_log(text: str) -> dict:
    """The plugin's host-pool lines of a server log."""
    out = {}
    m = POOL_RE.search(text)
    if m:
        out.update(layers=int(m["layers"]), rows=int(m["rows"]), row_bytes=int(m["row_bytes"]), gib=float(m["gib"]))
    m = READY_RE.search(text)
    if m:
        out.update(ready_gib=float(m["gib"]), ready_s=float(m["ready_s"]), rate_gib_s=float(m["rate"]),
                   touched_s=float(m["touch_s"]), pinned_s=float(m["pin_s"]) if m["pin_s"] else None,
                   threads=int(m["threads"]))
    return out


# ---------------------------------------------------------------------------------------------- teardown
def teardown(srv: Server, sig: str, mem_before_start: dict, gpu_before_start: float | None, gpu: GpuSampler,
             args, log) -> dict:
    """Send `sig` to the server's main process and time the way back: main process exited, process group gone
    (no process of it left but zombies), host memory back (MemFree or MemAvailable regained the release fraction
    of what it lost while the server ran), GPU memory back, port free.  What is still alive after
    --hostpool-teardown-max-s is SIGKILLed."""
    pid = srv.proc.pid
    frac = args.hostpool_release_fraction
    m_sig, g_sig, rss = meminfo(*MEM_KEYS), gpu.latest, group_rss(pid)
    held = {k: mem_before_start[k] - m_sig[k] for k in MEM_KEYS if k in mem_before_start and k in m_sig}
    host_target = {k: m_sig[k] + frac * v for k, v in held.items() if v >= args.hostpool_min_held_gib * GIB}
    gpu_held = (g_sig - gpu_before_start) if g_sig is not None and gpu_before_start is not None else None
    gpu_target = g_sig - frac * gpu_held if gpu_held is not None and gpu_held > 256 else None
    row = {"signal": sig, "sent_to": f"main process {pid}", "rss_gib": round(rss / GIB, 2),
           "meminfo_gib": {"before_start": {k: _gib(v) for k, v in mem_before_start.items()},
                           "at_signal": {k: _gib(v) for k, v in m_sig.items()}},
           "held_gib": _gib(max(held.values())) if held else None,
           "gpu_used_mib": {"before_start": gpu_before_start, "at_signal": g_sig}}
    if not host_target:
        row["host_note"] = (f"the server took under --hostpool-min-held-gib {args.hostpool_min_held_gib:g} GiB by MemFree "
                            f"and MemAvailable: their release is not judged (page-cache noise)")
        host_target = None
    marks: dict = {}
    samples = []
    t0 = time.monotonic()
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, SIGNALS[sig])
    escalated = None
    while True:
        t = time.monotonic() - t0
        exited = srv.proc.poll() is not None
        if "main_exit_s" not in marks and exited:
            marks["main_exit_s"] = round(t, 3)
        pids = live_pids(pid)
        if "group_gone_s" not in marks and not pids and exited:
            marks["group_gone_s"] = round(t, 3)
        mi = meminfo(*MEM_KEYS)
        m = mi.get("MemAvailable")
        back = [k for k, target in (host_target or {}).items() if mi.get(k, 0) >= target]
        if back and "host_released_s" not in marks:
            marks["host_released_s"], marks["host_released_by"] = round(t, 3), back[0]
        g = gpu.latest
        if gpu_target is not None and "gpu_released_s" not in marks and g is not None and g <= gpu_target:
            marks["gpu_released_s"] = round(t, 3)
        if "port_free_s" not in marks and port_free(srv.port):
            marks["port_free_s"] = round(t, 3)
        if not samples or t - samples[-1][0] >= 0.5:
            samples.append([round(t, 2), _gib(m), _gib(mi.get("MemFree")), len(pids), g])
        wanted = ["main_exit_s", "group_gone_s", "port_free_s"] + (["host_released_s"] if host_target is not None else []) \
            + (["gpu_released_s"] if gpu_target is not None else [])
        if all(k in marks for k in wanted):
            break
        if t > args.hostpool_teardown_max_s and escalated is None:
            escalated = round(t, 2)
            log(f"  hostpool: {sig} teardown not done after {t:.0f} s ({sorted(marks)}); SIGKILL of the group")
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        if escalated is not None and ((not pids and "port_free_s" in marks) or t > escalated + 30):
            break
        time.sleep(0.05)
    with contextlib.suppress(Exception):
        srv.proc.wait(timeout=10)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    with contextlib.suppress(Exception):
        srv.logf.close()
    with contextlib.suppress(OSError):
        srv.pidfile.unlink()
    srv.proc = None
    row.update(marks)
    row["meminfo_gib"]["end"] = {k: _gib(v) for k, v in meminfo(*MEM_KEYS).items()}
    row["gpu_used_mib"]["end"] = gpu.latest
    row["escalated_to_sigkill_at_s"] = escalated
    row["samples"] = samples[:240]  # [s since the signal, MemAvailable GiB, MemFree GiB, live processes, GPU MiB]
    keys = ["group_gone_s"] + (["host_released_s"] if host_target is not None else [])
    row["teardown_s"] = max(row[k] for k in keys) if all(k in row for k in keys) else None
    return row


def _gib(v):
    return None if v is None else round(v / GIB, 3)


# ---------------------------------------------------------------------------------------------- the phase
def harness_port_offsets() -> tuple[int, ...]:
    """Every port offset from --port-base a harness run may listen on: the arms' and this phase's server."""
    return port_offsets() + (HOSTPOOL_PORT_OFFSET,)


def hostpool_server(args, env0: dict, common, plugin_dir, ratio: int, device_tokens: int) -> tuple[list, dict, int]:
    """The server of --hostpool-arm with the ratio (and GPU pool) of the requested host pool."""
    a = argparse.Namespace(**vars(args))
    cfg = json.loads(args.hisparse_config)
    cfg["host_to_device_ratio"] = ratio
    a.hisparse_config = json.dumps(cfg, separators=(",", ":"))
    a.max_total_tokens = device_tokens
    port = args.port_base + HOSTPOOL_PORT_OFFSET
    cmd, env = arm_spec(args.hostpool_arm, a, env0, common, plugin_dir, port)
    return cmd, env, port


def measure_start(run: Run, sig: str, cmd: list, env: dict, port: int, current: dict) -> dict:
    args, dl, log = run.args, run.deadline, run.log
    name = f"hostpool-{sig.lower()}"
    srv = Server(name, cmd, env, args.state_dir / f"server-{name}.log", port, args.state_dir, log)
    off = file_size(srv.log_path)
    gpu = GpuSampler()
    m0, g0 = meminfo(*MEM_KEYS), gpu.latest
    row = {"signal": sig, "server": name}
    log(f"  hostpool: starting {name} on port {port}")
    t0 = time.monotonic()
    try:
        srv.start()
        current["group"] = ServerGroup(name, [srv], Colocated(port), log)
        row["healthy_s"] = round(srv.wait_healthy(max(30.0, min(args.health_timeout, dl.left() - args.reserve_s - 30))), 1)
    except (ServerDied, TimeoutError, RuntimeError) as e:
        row["error"] = f"{type(e).__name__}: {e}"[:2000]
        text = read_from(srv.log_path, off)
        memerr = re.search(r"HiSparseMemoryError[^\n]*", text)
        if memerr:
            row["refused_by_plugin"] = memerr.group(0)[:600]
        srv.stop(grace=10)
        current["group"] = None
        gpu.close()
        log(f"  hostpool: {name} did not start: {row['error'][:300]}")
        return row
    time.sleep(1.0)  # the log line of the ready pool is written before /health answers; let the memory settle
    row["pool"] = parse_pool_log(read_from(srv.log_path, off))
    row["started_s"] = round(time.monotonic() - t0, 1)
    log(f"  hostpool: {name} healthy after {row['healthy_s']} s; pool {row['pool']}")
    try:
        row["teardown"] = teardown(srv, sig, m0, g0, gpu, args, log)
    finally:
        gpu.close()
        current["group"] = None
    td = row["teardown"]
    log(f"  hostpool: {sig}: main exited {td.get('main_exit_s')} s, group gone {td.get('group_gone_s')} s, host memory "
        f"back {td.get('host_released_s')} s ({td.get('held_gib')} GiB held), GPU back {td.get('gpu_released_s')} s, "
        f"port free {td.get('port_free_s')} s" + (f", SIGKILL at {td['escalated_to_sigkill_at_s']} s"
                                                  if td.get("escalated_to_sigkill_at_s") else ""))
    return row


def judge_start(row: dict, args) -> list[str]:
    """Why a start fails (empty: it passes)."""
    if row.get("error"):
        return [f"did not start: {row['error'][:200]}"]
    bad = []
    pool = row.get("pool") or {}
    if pool.get("rate_gib_s") is None:
        bad.append("no 'HiSparse host pool: ... ready in' line in the log")
    elif pool["rate_gib_s"] < args.hostpool_min_rate:
        bad.append(f"pinned at {pool['rate_gib_s']} GiB/s < {args.hostpool_min_rate} GiB/s")
    td = row.get("teardown") or {}
    if td.get("escalated_to_sigkill_at_s") is not None:
        bad.append(f"{row['signal']}: processes or memory not back after {td['escalated_to_sigkill_at_s']} s (SIGKILL sent)")
    if td.get("group_gone_s") is None:
        bad.append(f"{row['signal']}: the process group never went away")
    elif td["group_gone_s"] > args.hostpool_teardown_ok_s:
        bad.append(f"{row['signal']}: the processes took {td['group_gone_s']} s to go (> {args.hostpool_teardown_ok_s} s)")
    if "host_note" not in td and td.get("host_released_s") is None:
        bad.append(f"{row['signal']}: host memory not back")
    elif (td.get("host_released_s") or 0) > args.hostpool_teardown_ok_s:
        bad.append(f"{row['signal']}: host memory back after {td['host_released_s']} s (> {args.hostpool_teardown_ok_s} s)")
    return bad


def run_hostpool(run: Run, env0: dict, common, plugin_dir, current: dict, meta: dict, save_meta, outputs) -> int:
    """The phase; its result is meta["hostpool"] (saved after every step).  Exit code: 0 measured (the verdict
    is in the report), 2 refused or a server that did not start, 3 a start skipped for time."""
    args, dl, log = run.args, run.deadline, run.log
    log("phase hostpool")
    device_tokens = args.hostpool_device_tokens or args.max_total_tokens
    layers, row = model_rows(args.model_dir, args.kv_cache_dtype)
    mem = host_memory_available()
    usable = int((mem.available if mem else 0) * HOST_MEMORY_USABLE_FRACTION - args.hostpool_margin_gib * GIB)
    res = {"date": run.started, "requested_gib": args.hostpool_gib, "arm": args.hostpool_arm,
           "host_memory": {"available_gib": _gib(mem.available) if mem else None, "source": mem.source if mem else None,
                           "usable_fraction": HOST_MEMORY_USABLE_FRACTION, "margin_gib": args.hostpool_margin_gib},
           "starts": []}

    def keep():
        meta["hostpool"] = res
        save_meta()
        outputs.publish()

    if mem is None:
        res["refused"] = {"type": "HostMemoryUnknown", "message": "neither /proc/meminfo nor a memory cgroup could be read"}
    else:
        res["plan"] = plan = plan_pool(args.hostpool_gib, device_tokens, layers, row, usable)
        if "refused" in plan:
            res["refused"] = plan["refused"]
    if "refused" in res:
        res["verdict"] = "refused"
        log(f"  hostpool: REFUSED ({res['refused']['type']}): {res['refused']['message']}")
        keep()
        return 2
    log(f"  hostpool: {plan['sentence']}; host memory {res['host_memory']}")
    cmd, env, port = hostpool_server(args, env0, common, plugin_dir, plan["ratio"], device_tokens)
    res["cmd"] = " ".join(cmd)
    keep()
    rc = 0
    for sig in args.hostpool_signals:
        if dl.left() - args.reserve_s < args.arm_min_s:
            res["starts"].append({"signal": sig, "skipped": f"deadline: {dl.left():.0f} s left"})
            log(f"  hostpool: {sig} start SKIPPED (deadline)")
            rc = 3
            keep()
            continue
        start = measure_start(run, sig, cmd, env, port, current)
        start["failures"] = judge_start(start, args)
        start["ok"] = not start["failures"]
        if start.get("error"):
            rc = max(rc, 2)
        res["starts"].append(start)
        keep()
    measured = [s for s in res["starts"] if "skipped" not in s]
    res["verdict"] = ("fail" if any(not s["ok"] for s in measured) else
                      "incomplete" if len(measured) < len(res["starts"]) or not measured else "pass")
    log(f"  hostpool: verdict {res['verdict']}")
    keep()
    return rc


# ---------------------------------------------------------------------------------------------- report
def render_hostpool(meta: dict) -> list[str]:
    hp = meta.get("hostpool")
    if not hp:
        return []
    out = ["", "## Host pool: start-up and teardown (issue #27)", ""]
    hm = hp.get("host_memory") or {}
    out.append(f"Requested {hp.get('requested_gib')} GiB with arm {hp.get('arm')}'s server flags ({hp.get('date')}); host "
               f"memory available {hm.get('available_gib')} GiB ({hm.get('source')}), a pool may take "
               f"{hm.get('usable_fraction')} of it less {hm.get('margin_gib')} GiB for the server.")
    if hp.get("refused"):
        out.append(f"\n**Refused ({hp['refused']['type']})**: {hp['refused']['message']}")
        return out + [""]
    plan = hp.get("plan") or {}
    out.append(f"Sizing: {plan.get('sentence')}." + (f" Note: {plan['note']}." if plan.get("note") else ""))
    out.append(f"Verdict: **{str(hp.get('verdict')).upper()}** (pinning at least the target rate, processes gone and "
               f"memory back within the teardown limit).")
    out += ["", ("| signal | pool in the log (GiB) | ready in (s): touched / pinned | rate (GiB/s) | threads | /health after (s) "
                 "| held at the signal: RSS / memory drop (GiB) | main exited (s) | group gone (s) | host memory back (s) "
                 "| GPU memory back (s) | port free (s) | verdict |"),
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in hp.get("starts", []):
        if s.get("skipped"):
            out.append(f"| {s['signal']} | skipped: {s['skipped']} |" + " |" * 11)
            continue
        p, td = s.get("pool") or {}, s.get("teardown") or {}
        verdict = "pass" if s.get("ok") else "FAIL: " + "; ".join(s.get("failures") or [])
        out.append(f"| {s['signal']} | {p.get('gib')} ({p.get('rows')} rows x {p.get('layers')} layers) | "
                   f"{p.get('ready_s')}: {p.get('touched_s')} / {p.get('pinned_s')} | {p.get('rate_gib_s')} | "
                   f"{p.get('threads')} | {s.get('healthy_s')} | {td.get('rss_gib')} / {td.get('held_gib')} | "
                   f"{td.get('main_exit_s')} | {td.get('group_gone_s')} | {td.get('host_released_s')} | "
                   f"{td.get('gpu_released_s')} | {td.get('port_free_s')} | {verdict} |")
    out.append("\nThe signal goes to the server's main process; SGLang's scheduler and detokenizer follow it "
               "(PR_SET_PDEATHSIG); group gone: no process of it left but zombies. Host memory back: MemFree or "
               "MemAvailable of /proc/meminfo regained the release fraction of what it lost between before the start "
               "and the signal (– where the server took less than --hostpool-min-held-gib); GPU memory from nvidia-smi (– without it).")
    return out + [""]
