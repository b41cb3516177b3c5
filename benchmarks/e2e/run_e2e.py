#!/usr/bin/env python3
"""End-to-end benchmark of HiSparse on SGLang 0.5.17 with a tiny DeepSeek-V3.2 (DSA) model.

Runs on the offline GPU machine after benchmarks/e2e/install_part.sh has put the bundle into
/tmp/site.  Arms (served one after the other on 127.0.0.1, identical flags except):

  a  baseline         no HiSparse
  b  sglang-hisparse  SGLang's in-tree HiSparse: --enable-hisparse --hisparse-config <JSON>
  c  plugin           as b, plus our plugin: <repo>/src on PYTHONPATH and a generated
                      hisparse_sglang-0.0.0.dist-info whose entry_points.txt registers the
                      `sglang.srt.plugins` entry point of pyproject.toml (the package is not
                      pip-installed on the GPU machine); --plugin-env/--plugin-args add more
  d  plugin-offload   as c, with "resident_first": false added to the --hisparse-config JSON: every
                      request is offloaded, like the in-tree HiSparse (opt-in: --arms ...,d)

Per arm: start the server, wait for /health, warm up, then the selected phases:
  correctness  greedy decode (temperature 0, ignore_eos) of 8K-32K-token random prompts with
               return_logprob/top_logprobs_num=5, sequentially (bs 1, identical batches in all arms)
  capacity     N concurrent long requests; the most requests running at once (/v1/loads polling
               + `#running-req` of the server log), then abort_all
  throughput   concurrency levels (1,8,32,max) with fixed input/output lengths, streaming client:
               TTFT, time per output token, output tok/s, server-log decode tok/s
  storm        (opt-in) one streaming request decodes; after --storm-after-tokens tokens a burst of
               --storm-requests long requests arrives at once; how long the decoding request stalls
               (token gaps in the burst window against its TPOT before), prefill batches and the
               plugin's `HiSparse:` log line (switch work, demotions) in that window
Then `report`: cross-arm comparison (token mismatches, max |dlogprob|) -> results.json + results.md.

Everything is written incrementally: per-arm JSON in --state-dir (default /tmp/hisparse_e2e, which
survives between back-to-back device runs), and results.json, results.md, harness.log and
server-<arm>.log in $OUT (at most 8 files) after every phase, so a timeout still returns data.
A later run with other --arms merges into the same state dir, e.g.
    python3 benchmarks/e2e/run_e2e.py --arms a        # run 1
    python3 benchmarks/e2e/run_e2e.py --arms b,c      # run 2: report covers a, b and c

Weights: --load-format dummy plus a fixture plugin (hisparse_e2e_fixture.py) in every arm that, by
default (--weight-init scaled), replaces SGLang's degenerate U(-1e-3,1e-3) dummy init by a seeded
N(0, 1/fan_in) init so that outputs depend on the long context; it logs a weight fingerprint that
the report compares across arms.  --weight-init sglang keeps SGLang's init.

See docs/gpu-e2e.md for the device-run recipe.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import glob
import http.client
import json
import math
import os
import random
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
DEFAULT_MODEL = REPO / "benchmarks" / "models" / "tiny-dsv32"
DEFAULT_HISPARSE_CONFIG = '{"top_k":2048,"device_buffer_size":4096,"host_to_device_ratio":8}'
DEFAULT_PLUGIN_EP = ("hisparse", "hisparse_sglang.integration.sglang.plugin:register")
FIXTURE_EP = ("hisparse_e2e_weight_init", "hisparse_e2e_fixture:register")
ALL_ARMS = ("a", "b", "c", "d")
ARM_LABELS = {"a": "baseline (no HiSparse)", "b": "SGLang in-tree HiSparse", "c": "hisparse-sglang plugin",
              "d": "hisparse-sglang plugin, always offload"}
PLUGIN_ARMS = ("c", "d")  # arms that load our plugin (its dist-info + src on PYTHONPATH)
ARM_HISPARSE_OVERRIDES = {"d": {"resident_first": False}}  # merged into --hisparse-config
ALL_PHASES = ("preflight", "correctness", "capacity", "throughput", "storm", "report")
ARM_PHASES = ("correctness", "capacity", "throughput", "storm")  # phases that need the arm's server
DEFAULT_PHASES = "preflight,correctness,capacity,throughput,report"
COMPARE_PAIRS = (("b", "a"), ("c", "a"), ("c", "b"), ("d", "a"), ("c", "d"))
STORM_TPOT_FROM = 20  # the storm's TPOT before the burst: gaps of tokens STORM_TPOT_FROM+1 .. --storm-after-tokens
HOST = "127.0.0.1"

# ------------------------------------------------------------------------------------------------
# log parsing (pure functions; unit-tested by selftest.py on synthetic lines)
# ------------------------------------------------------------------------------------------------
DECODE_RE = re.compile(
    r"Decode batch(?: \[\d+\])?, #running-req: (?P<running>\d+), (?P<mid>.*?)"
    r"gen throughput \(token/s\): (?P<gen>[0-9.]+), #queue-req: (?P<queue>\d+)")
PREFILL_RE = re.compile(
    r"Prefill batch(?: \[\d+\])?, #new-seq: (?P<new_seq>\d+), #new-token: (?P<new_token>\d+), "
    r"#cached-token: (?P<cached>\d+), (?P<mid>.*?)#running-req: (?P<running>\d+), "
    r"#queue-req: (?P<queue>\d+)")
TOKEN_USAGE_RE = re.compile(r"(?:^|, )token usage: ([0-9.]+)")
GPU_USAGE_RE = re.compile(r"gpu token usage: ([0-9.]+)")
CPU_USAGE_RE = re.compile(r"cpu token usage: ([0-9.]+)")
GRAPH_RE = re.compile(r"cuda graph: (True|False)")
FINGERPRINT_RE = re.compile(r"\[hisparse-e2e-fixture\] pid=\d+ weights (?P<desc>.*?) fingerprint=(?P<fp>\S+)")
FIXTURE_EPS_RE = re.compile(r"\[hisparse-e2e-fixture\] pid=\d+ visible sglang\.srt\.plugins entry points: (?P<eps>\[.*\])")
MAX_TOTAL_RE = re.compile(r"max_total_num_tokens=(\d+)")
RETRACT_RE = re.compile(r"KV cache pool is full\. Retract requests\. #retracted_reqs: (\d+)")
PLUGIN_FAIL_RE = re.compile(r"Failed to (load plugin|execute general plugin:?) (\S+)")
DENSE_THRESHOLD_RE = re.compile(r"Dense attention kv len threshold is manually set to (\d+)")
# our plugin's periodic line (hisparse_sglang/integration/sglang/metrics.py), e.g.
#   HiSparse: hit rate 24.8%, moved 35.2 MiB, resident 3, offloaded 33 (promoting 0), demotions 12.0/min,
#   promotions 0.0/min, device rows 130944/131136, host rows 820352/1048640, switch work max 0.41 ms/step
# Each field is matched on its own, so that a field added or missing (older plugins have no
# "switch work max") does not hide the others.  The in-tree HiSparse logs other "HiSparse: ..." lines.
HISPARSE_LINE_RE = re.compile(r"HiSparse: hit rate [^\n]*")
HISPARSE_FIELDS = (
    ("hit_rate_pct", re.compile(r"hit rate ([0-9.]+)%"), float),
    ("moved_mib", re.compile(r"moved ([0-9.]+) MiB"), float),
    ("resident", re.compile(r"resident (\d+)"), int),
    ("offloaded", re.compile(r"offloaded (\d+)"), int),
    ("promoting", re.compile(r"\(promoting (\d+)\)"), int),
    ("demotions_per_min", re.compile(r"demotions ([0-9.]+)/min"), float),
    ("promotions_per_min", re.compile(r"promotions ([0-9.]+)/min"), float),
    ("switch_work_max_ms", re.compile(r"switch work max ([0-9.]+) ms/step"), float),
    ("step_host_ms", re.compile(r"step host work ([0-9.]+) ms"), float),
)


def parse_decode_lines(text: str) -> list[dict]:
    out = []
    for m in DECODE_RE.finditer(text):
        mid = m.group("mid")
        d = {"running": int(m.group("running")), "gen_tput": float(m.group("gen")),
             "queue": int(m.group("queue"))}
        for key, rx in (("token_usage", TOKEN_USAGE_RE), ("gpu_token_usage", GPU_USAGE_RE),
                        ("cpu_token_usage", CPU_USAGE_RE)):
            mm = rx.search(mid)
            if mm:
                d[key] = float(mm.group(1))
        g = GRAPH_RE.search(mid)
        if g:
            d["cuda_graph"] = g.group(1) == "True"
        out.append(d)
    return out


def parse_prefill_lines(text: str) -> list[dict]:
    return [{"new_seq": int(m.group("new_seq")), "new_token": int(m.group("new_token")),
             "running": int(m.group("running")), "queue": int(m.group("queue"))}
            for m in PREFILL_RE.finditer(text)]


def parse_hisparse_lines(text: str) -> list[dict]:
    """The plugin's `HiSparse: hit rate ...` lines; a field absent from a line is absent from its dict."""
    out = []
    for m in HISPARSE_LINE_RE.finditer(text):
        line, d = m.group(0), {}
        for key, rx, conv in HISPARSE_FIELDS:
            mm = rx.search(line)
            if mm:
                d[key] = conv(mm.group(1))
        out.append(d)
    return out


def summarize_hisparse(text: str) -> dict | None:
    """Maxima over the plugin's `HiSparse:` lines of a log segment; None if there are none."""
    rows = parse_hisparse_lines(text)
    if not rows:
        return None

    def top(key: str, fn=max):
        vals = [r[key] for r in rows if key in r]
        return fn(vals) if vals else None

    return {"lines": len(rows), "switch_work_max_ms": top("switch_work_max_ms"),
            "demotions_per_min_max": top("demotions_per_min"), "promotions_per_min_max": top("promotions_per_min"),
            "offloaded_max": top("offloaded"), "resident_max": top("resident"),
            "hit_rate_pct_min": top("hit_rate_pct", min),
            "step_host_ms_median": top("step_host_ms", statistics.median)}


def summarize_log(text: str) -> dict:
    """Everything run_e2e.py reads from a (segment of a) server log."""
    dec = parse_decode_lines(text)
    pre = parse_prefill_lines(text)
    gens = [d["gen_tput"] for d in dec if d["gen_tput"] > 0]
    running = [d["running"] for d in dec] + [p["running"] for p in pre]
    graph = [d["cuda_graph"] for d in dec if "cuda_graph" in d]
    fps = [(m.group("desc"), m.group("fp")) for m in FINGERPRINT_RE.finditer(text)]
    mt = MAX_TOTAL_RE.findall(text)
    eps = [m.group("eps") for m in FIXTURE_EPS_RE.finditer(text)]
    dense = DENSE_THRESHOLD_RE.findall(text)
    return {
        "decode_lines": len(dec),
        "prefill_lines": len(pre),
        "max_running": max(running) if running else None,
        "max_decode_running": max((d["running"] for d in dec), default=None),
        "gen_tput_median": statistics.median(gens) if gens else None,
        "gen_tput_max": max(gens) if gens else None,
        "max_queue": max((d["queue"] for d in dec), default=None),
        "max_token_usage": max((d.get("token_usage", d.get("gpu_token_usage", 0.0)) for d in dec), default=None),
        "cuda_graph_fraction": (sum(graph) / len(graph)) if graph else None,
        "retracted_reqs": sum(int(x) for x in RETRACT_RE.findall(text)),
        "weight_fingerprints": sorted({fp for _, fp in fps}),
        "weight_init": sorted({desc for desc, _ in fps}),
        "max_total_num_tokens": int(mt[-1]) if mt else None,
        "plugin_failures": sorted({f"{a}: {b}" for a, b in PLUGIN_FAIL_RE.findall(text)}),
        "visible_plugins": sorted(set(eps)),
        "dense_attn_threshold": int(dense[-1]) if dense else None,
        "hisparse": summarize_hisparse(text),
    }


def detect_cycle(ids: list[int], min_repeats: int = 2) -> int | None:
    """Smallest period p such that the tail of `ids` repeats with period p at least min_repeats
    times and covers at least half of the sequence; None if there is no such period."""
    n = len(ids)
    for p in range(1, n // min_repeats + 1):
        k = 0
        while k + p < n and ids[n - 1 - k] == ids[n - 1 - k - p]:
            k += 1
        if k + p >= max(p * min_repeats, n // 2):
            return p
    return None


def compare_outputs(ref: dict, other: dict) -> dict:
    """Compare two correctness results (dicts with "prompts": [{id, output_ids, logprobs, top}...])."""
    by_id = {p["id"]: p for p in other.get("prompts", [])}
    rows, max_dlp, max_dtop, identical, mismatched_tokens, compared = [], 0.0, 0.0, 0, 0, 0
    for rp in ref.get("prompts", []):
        op = by_id.get(rp["id"])
        if op is None or rp.get("error") or op.get("error"):
            rows.append({"id": rp["id"], "status": "missing"})
            continue
        a, b = rp["output_ids"], op["output_ids"]
        n = min(len(a), len(b))
        first = next((i for i in range(n) if a[i] != b[i]), None)
        if first is None and len(a) != len(b):
            first = n
        upto = n if first is None else first
        dlp = [abs(x - y) for x, y in zip(rp["logprobs"][:upto], op["logprobs"][:upto])
               if x is not None and y is not None]
        dtop = []
        for ta, tb in zip(rp.get("top", [])[:upto], op.get("top", [])[:upto]):
            if not ta or not tb:
                continue
            mb = {tid: lp for tid, lp in tb}
            dtop += [abs(lp - mb[tid]) for tid, lp in ta if tid in mb and lp is not None and mb[tid] is not None]
        mism = sum(1 for i in range(n) if a[i] != b[i]) + abs(len(a) - len(b))
        row = {"id": rp["id"], "tokens": n, "identical": first is None, "first_mismatch": first,
               "mismatched_tokens": mism, "max_abs_dlogprob": max(dlp) if dlp else 0.0,
               "max_abs_dtop5": max(dtop) if dtop else 0.0}
        rows.append(row)
        compared += 1
        identical += row["identical"]
        mismatched_tokens += mism
        max_dlp = max(max_dlp, row["max_abs_dlogprob"])
        max_dtop = max(max_dtop, row["max_abs_dtop5"])
    return {"prompts_compared": compared, "prompts_identical": identical,
            "mismatched_tokens": mismatched_tokens,
            "max_abs_dlogprob_before_divergence": max_dlp,
            "max_abs_dtop5_before_divergence": max_dtop, "per_prompt": rows}


def extract_logprobs(meta: dict) -> tuple[list, list]:
    """(chosen-token logprobs, top-k [[id, logprob], ...] per position) from a /generate meta_info.

    SGLang 0.5.17 returns output_token_logprobs as [[logprob, token_id, text|None], ...] and
    output_top_logprobs as [[[logprob, token_id, text|None] * k] | None, ...]."""
    lps = [(float(x[0]) if x[0] is not None else None) for x in meta.get("output_token_logprobs") or []]
    top = []
    for pos in meta.get("output_top_logprobs") or []:
        top.append([[int(e[1]), (float(e[0]) if e[0] is not None else None)] for e in pos] if pos else None)
    return lps, top


def parse_levels(spec: str) -> list:
    out = []
    for tok in spec.split(","):
        tok = tok.strip().lower()
        if not tok:
            continue
        if tok == "max":
            out.append("max")
        else:
            v = int(tok)
            if v < 1:
                raise ValueError(f"concurrency level must be >= 1: {tok}")
            out.append(v)
    if not out:
        raise ValueError("no concurrency levels")
    return out


def parse_csv(spec: str, allowed: tuple[str, ...], what: str) -> list[str]:
    items = [s.strip().lower() for s in spec.split(",") if s.strip()]
    bad = [s for s in items if s not in allowed]
    if bad:
        raise ValueError(f"unknown {what}: {bad} (choose from {','.join(allowed)})")
    return [s for s in allowed if s in items]  # canonical order, deduplicated


def parse_env_assignments(items: list[str]) -> dict[str, str]:
    env = {}
    for it in items:
        if "=" not in it or it.startswith("="):
            raise ValueError(f"expected KEY=VALUE, got {it!r}")
        k, v = it.split("=", 1)
        env[k] = v
    return env


def read_plugin_entry_point(pyproject: Path) -> tuple[str, str]:
    """The `sglang.srt.plugins` entry point declared in pyproject.toml (name, "module:attr")."""
    try:
        import tomllib
        data = tomllib.loads(pyproject.read_text())
        eps = data["project"]["entry-points"]["sglang.srt.plugins"]
        name, value = sorted(eps.items())[0]
        return name, value
    except Exception:
        return DEFAULT_PLUGIN_EP


def write_dist_info(root: Path, dist: str, eps: list[tuple[str, str]], group: str = "sglang.srt.plugins") -> Path:
    """Create <root>/<dist>-0.0.0.dist-info with METADATA + entry_points.txt, so that
    importlib.metadata.entry_points(group=...) finds `eps` when <root> is on sys.path."""
    d = root / f"{dist}-0.0.0.dist-info"
    d.mkdir(parents=True, exist_ok=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist.replace('_', '-')}\nVersion: 0.0.0\n")
    (d / "entry_points.txt").write_text(f"[{group}]\n" + "".join(f"{n} = {v}\n" for n, v in eps))
    (d / "INSTALLER").write_text("run_e2e.py\n")
    return d


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


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


# ------------------------------------------------------------------------------------------------
# harness plumbing
# ------------------------------------------------------------------------------------------------
class Deadline:
    def __init__(self, seconds: float):
        self.t0 = time.monotonic()
        self.seconds = seconds

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.t0)

    def elapsed(self) -> float:
        return time.monotonic() - self.t0


class Log:
    def __init__(self, paths: list[Path]):
        self.files = []
        for p in paths:
            p.parent.mkdir(parents=True, exist_ok=True)
            self.files.append(open(p, "a", buffering=1))
        self.t0 = time.monotonic()
        self.lock = threading.Lock()

    def __call__(self, msg: str) -> None:
        line = f"[e2e {time.monotonic() - self.t0:7.1f}s] {msg}"
        with self.lock:
            print(line, flush=True)
            for f in self.files:
                f.write(line + "\n")


LOG: Log = Log([])


class ServerDied(RuntimeError):
    pass


def atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def log_tail(path: Path, n: int = 60) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            lines = f.read().decode("utf-8", "replace").splitlines()
        return "\n".join(lines[-n:])
    except OSError:
        return "(no log)"


def read_from(path: Path, offset: int, end: int | None = None) -> str:
    """The log from byte `offset` to byte `end` (default: its current end)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            raw = f.read() if end is None else f.read(max(0, end - offset))
            return raw.decode("utf-8", "replace")
    except OSError:
        return ""


def file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def port_free(port: int) -> bool:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.settimeout(0.5)
        return s.connect_ex((HOST, port)) != 0


def http_json(method: str, port: int, path: str, body: dict | None = None, timeout: float = 600):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://{HOST}:{port}{path}", data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        raw = r.read()
    return json.loads(raw) if raw else None


def http_status(port: int, path: str, timeout: float = 5) -> int:
    try:
        with urllib.request.urlopen(f"http://{HOST}:{port}{path}", timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except Exception:
        return 0


def make_prompt(seed: int, n: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, vocab) for _ in range(n)]  # 0/1 are bos/eos


# ------------------------------------------------------------------------------------------------
# environment of the servers
# ------------------------------------------------------------------------------------------------
def find_cuda_home(python: str) -> tuple[str | None, list[str]]:
    notes = []
    env_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    cands = [env_home] if env_home else []
    nvcc = shutil.which("nvcc")
    if nvcc:
        cands.append(str(Path(os.path.realpath(nvcc)).parent.parent))
        with contextlib.suppress(Exception):  # `exec /x/bin/nvcc "$@"` wrapper scripts
            head = Path(nvcc).read_bytes()[:4096]
            if head.startswith(b"#!"):
                for m in re.finditer(rb"(/[^\s\"']+)/bin/nvcc", head):
                    cands.append(m.group(1).decode())
    cands += sorted(glob.glob("/usr/local/cuda*"), reverse=True)
    purelib = subprocess.run([python, "-c", "import sysconfig;print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True).stdout.strip()
    if purelib:
        cands.append(f"{purelib}/nvidia/cu13")
    for c in cands:
        if c and os.path.isfile(f"{c}/bin/nvcc") and os.path.isfile(f"{c}/include/cuda_runtime.h"):
            return c, notes
        if c:
            notes.append(f"not a CUDA home: {c}")
    return None, notes


def build_jit_shim(shim: Path, cuda_home: str, python: str) -> dict:
    """Headers the toolkit lacks (flashinfer's JIT norm needs cublasLt.h, curand_kernel.h) are
    symlinked from the pip CUDA packages; unversioned libcudart.so/libcuda.so are provided for
    `-lcudart`/`-lcuda` if the toolkit has none."""
    inc, lib = shim / "include", shim / "lib"
    inc.mkdir(parents=True, exist_ok=True)
    lib.mkdir(parents=True, exist_ok=True)
    purelib = subprocess.run([python, "-c", "import sysconfig;print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True).stdout.strip()
    linked = []
    for d in sorted(glob.glob(f"{purelib}/nvidia/cu13/include")) + sorted(glob.glob(f"{purelib}/nvidia/*/include")):
        if os.path.realpath(d) == os.path.realpath(f"{cuda_home}/include"):
            continue
        for h in sorted(os.listdir(d)):
            if os.path.exists(f"{cuda_home}/include/{h}") or os.path.lexists(inc / h):
                continue
            os.symlink(f"{d}/{h}", inc / h)
            linked.append(h)

    def have(name: str) -> bool:
        for d in ("lib64", "lib", "lib64/stubs", "lib/stubs", "targets/x86_64-linux/lib",
                  "targets/x86_64-linux/lib/stubs"):
            if os.path.exists(f"{cuda_home}/{d}/{name}"):
                return True
        out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout if shutil.which("ldconfig") else ""
        return f" {name} " in out

    libs = []
    if not have("libcudart.so"):
        for c in sorted(glob.glob(f"{cuda_home}/lib*/libcudart.so.1*")) + sorted(glob.glob(f"{purelib}/nvidia/cu13/lib/libcudart.so.1*")):
            if not os.path.lexists(lib / "libcudart.so"):
                os.symlink(c, lib / "libcudart.so")
                libs.append(f"libcudart.so -> {c}")
            break
    if not have("libcuda.so"):
        for c in ["/usr/lib/x86_64-linux-gnu/libcuda.so.1", "/usr/lib64/libcuda.so.1",
                  "/usr/local/nvidia/lib64/libcuda.so.1", *sorted(glob.glob("/usr/local/nvidia/lib*/libcuda.so.1"))]:
            if os.path.exists(c):
                if not os.path.lexists(lib / "libcuda.so"):
                    os.symlink(c, lib / "libcuda.so")
                    libs.append(f"libcuda.so -> {c}")
                break
    return {"headers_linked": len(linked), "some_headers": linked[:12], "libs": libs}


def base_env(args, state: Path) -> tuple[dict, dict]:
    """Environment shared by all arms (+ a description for the results)."""
    env = dict(os.environ)
    info = {}
    venv_bin = os.path.dirname(args.python) if os.path.isabs(args.python) else \
        subprocess.run([args.python, "-c", "import sysconfig;print(sysconfig.get_path('scripts'))"],
                       capture_output=True, text=True).stdout.strip()
    path = [venv_bin] if venv_bin else []
    cuda_home, notes = find_cuda_home(args.python)
    info["cuda_home"] = cuda_home
    if notes:
        info["cuda_home_notes"] = notes
    if cuda_home:
        env["CUDA_HOME"] = cuda_home
        path.append(f"{cuda_home}/bin")
        if not args.no_jit_shim:
            shim = state / "jit_shim"
            info["jit_shim"] = build_jit_shim(shim, cuda_home, args.python)
            env["CPATH"] = os.pathsep.join([str(shim / "include")] + ([env["CPATH"]] if env.get("CPATH") else []))
            env["LIBRARY_PATH"] = os.pathsep.join([str(shim / "lib")] + ([env["LIBRARY_PATH"]] if env.get("LIBRARY_PATH") else []))
    else:
        LOG("WARNING: no CUDA toolkit (nvcc + include/cuda_runtime.h) found; the runtime JIT "
            "(sglang.kernels.jit, flashinfer norm, DeepGEMM) will fail")
    env["PATH"] = os.pathsep.join(path + [env.get("PATH", "")])
    for tool in ("ninja", "c++", "nvcc"):
        found = shutil.which(tool, path=env["PATH"])
        info[f"which_{tool}"] = found
        if not found:
            LOG(f"WARNING: '{tool}' not on PATH (needed by the runtime JIT builds)")
    env.update({
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
        # Prefill with kv_len <= this would take the dense MHA path = FA3 from
        # sgl_kernel/flash_ops.abi3.so, which the bundle does not ship (1.1 GB).  0 keeps every
        # prefill on flashmla_sparse (what --enable-hisparse forces anyway).
        "SGLANG_DSA_PREFILL_DENSE_ATTN_KV_LEN_THRESHOLD": str(args.dense_attn_threshold),
        # if FA3 is reached anyway: fail at once instead of trying a hub download
        "SGLANG_USE_SGL_FA3_KERNEL": "1",
        "HISPARSE_E2E_WEIGHT_INIT": args.weight_init,
        "HISPARSE_E2E_WEIGHT_SEED": str(args.weight_seed),
    })
    env.pop("SGLANG_PLUGINS", None)  # a whitelist would silently drop the fixture or the plugin
    env.pop("PYTHONPATH", None)
    return env, info


def prepare_pyext(state: Path, args) -> tuple[Path, Path, tuple[str, str]]:
    """<state>/pyext-common: fixture module + its dist-info (all arms);
    <state>/pyext-plugin: hisparse_sglang dist-info with the plugin entry point (arms c and d)."""
    common = state / "pyext-common"
    shutil.rmtree(common, ignore_errors=True)
    common.mkdir(parents=True)
    shutil.copy2(HERE / "hisparse_e2e_fixture.py", common / "hisparse_e2e_fixture.py")
    write_dist_info(common, "hisparse_e2e_fixture", [FIXTURE_EP])
    plugin = state / "pyext-plugin"
    shutil.rmtree(plugin, ignore_errors=True)
    plugin.mkdir(parents=True)
    ep = (args.plugin_ep.split("=", 1)[0].strip(), args.plugin_ep.split("=", 1)[1].strip()) \
        if args.plugin_ep else read_plugin_entry_point(REPO / "pyproject.toml")
    write_dist_info(plugin, "hisparse_sglang", [ep])
    return common, plugin, ep


# The DSA backend of each KV cache dtype whose decode path calls the HiSparse swap-in (SGLang 0.5.17).
DSA_BACKEND_OF_KV_DTYPE = {"bfloat16": "flashmla_sparse", "fp8_e4m3": "flashmla_kv"}


def hisparse_config_json(config: str, arm: str) -> str:
    """--hisparse-config of an arm: the common JSON plus the arm's overrides, compact (one argv element)."""
    merged = json.loads(config)
    if not isinstance(merged, dict):
        raise ValueError(f"--hisparse-config must be a JSON object, got {config!r}")
    merged.update(ARM_HISPARSE_OVERRIDES.get(arm, {}))
    return json.dumps(merged, separators=(",", ":"))


def arm_spec(arm: str, args, env0: dict, common: Path, plugin_dir: Path, port: int) -> tuple[list, dict]:
    """Server argv and environment of one arm."""
    cmd = [args.python, "-m", "sglang.launch_server",
           "--model-path", str(args.model_dir), "--load-format", "dummy", "--skip-tokenizer-init",
           "--host", HOST, "--port", str(port),
           "--mem-fraction-static", str(args.mem_fraction_static),
           "--max-total-tokens", str(args.max_total_tokens),
           "--context-length", str(args.context_length),
           "--disable-radix-cache",
           "--attention-backend", "dsa",
           "--dsa-prefill-backend", DSA_BACKEND_OF_KV_DTYPE[args.kv_cache_dtype],
           "--dsa-decode-backend", DSA_BACKEND_OF_KV_DTYPE[args.kv_cache_dtype],
           "--kv-cache-dtype", args.kv_cache_dtype,
           "--random-seed", str(args.random_seed)]
    if args.disable_cuda_graph:
        cmd.append("--disable-cuda-graph")
    hisparse = ["--enable-hisparse", "--hisparse-config", hisparse_config_json(args.hisparse_config, arm)]
    env = dict(env0)
    pp = [str(common), str(args.site)]
    if arm == "b":
        cmd += hisparse
    elif arm in PLUGIN_ARMS:
        if not args.plugin_no_enable_hisparse:
            cmd += hisparse
        cmd += shlex.split(args.plugin_args)
        # the generated dist-info goes first: it must win over any *.egg-info / dist-info of an
        # editable install lying in src/ (importlib.metadata keeps the first distribution per name)
        pp = [str(plugin_dir), str(args.plugin_src)] + pp
        env.update(parse_env_assignments(args.plugin_env))
    cmd += shlex.split(args.extra_server_args)
    env["PYTHONPATH"] = os.pathsep.join(pp)
    return cmd, env


# ------------------------------------------------------------------------------------------------
# the server
# ------------------------------------------------------------------------------------------------
class Server:
    def __init__(self, arm: str, cmd: list, env: dict, log_path: Path, port: int, state: Path):
        self.arm, self.cmd, self.env, self.log_path, self.port, self.state = arm, cmd, env, log_path, port, state
        self.proc: subprocess.Popen | None = None
        self.pidfile = state / f"server-{arm}.pid"

    def start(self) -> None:
        if not port_free(self.port):
            raise RuntimeError(f"port {self.port} is busy before starting arm {self.arm}")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.logf = open(self.log_path, "ab")
        self.logf.write(f"\n===== run_e2e.py arm {self.arm} start {_dt.datetime.now().isoformat()} =====\n"
                        f"$ {shlex.join(self.cmd)}\n".encode())
        self.logf.flush()
        # own process group (killpg kills scheduler + detokenizer too), but the same session, so
        # that the device tool still reaps everything if this harness is killed hard
        self.proc = subprocess.Popen(self.cmd, env=self.env, stdout=self.logf, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, cwd=str(REPO), process_group=0)
        self.pidfile.write_text(str(self.proc.pid))

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def check(self) -> None:
        if not self.alive():
            rc = self.proc.returncode if self.proc else None
            raise ServerDied(f"server of arm {self.arm} exited (rc={rc}); last log lines:\n{log_tail(self.log_path)}")

    def wait_healthy(self, timeout: float) -> float:
        t0 = time.monotonic()
        last_note = t0
        while True:
            self.check()
            code = http_status(self.port, "/health")
            if code == 200:
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"arm {self.arm}: /health not 200 after {timeout:.0f}s; last log lines:\n"
                                   f"{log_tail(self.log_path, 30)}")
            if time.monotonic() - last_note > 30:
                last = log_tail(self.log_path, 1).strip()[-160:]
                LOG(f"  ... waiting for /health ({time.monotonic() - t0:.0f}s, code {code}); log: {last}")
                last_note = time.monotonic()
            time.sleep(2)

    def stop(self, grace: float = 30) -> None:
        if self.proc is None:
            return
        pgid = self.proc.pid
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        t0 = time.monotonic()
        while time.monotonic() - t0 < grace:
            if self.proc.poll() is not None and not group_alive(pgid):
                break
            time.sleep(0.5)
        if group_alive(pgid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            self.proc.wait(timeout=10)
        t1 = time.monotonic()
        while group_alive(pgid) and time.monotonic() - t1 < 15:
            time.sleep(0.5)
        t2 = time.monotonic()
        while not port_free(self.port) and time.monotonic() - t2 < 30:
            time.sleep(0.5)
        with contextlib.suppress(OSError):
            self.pidfile.unlink()
        with contextlib.suppress(Exception):
            self.logf.close()
        LOG(f"  server {self.arm} stopped in {time.monotonic() - t0:.1f}s "
            f"(group gone: {not group_alive(pgid)}, port free: {port_free(self.port)})")
        self.proc = None


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def kill_stale_servers(state: Path) -> None:
    """Servers of an earlier run of this harness that was killed hard (pidfiles in the state dir)."""
    for pf in state.glob("server-*.pid"):
        with contextlib.suppress(Exception):
            pid = int(pf.read_text().strip())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if "sglang.launch_server" in cmdline:
                LOG(f"killing stale server group {pid} from an earlier run ({pf.name})")
                os.killpg(pid, signal.SIGKILL)
                time.sleep(2)
        with contextlib.suppress(OSError):
            pf.unlink()


# ------------------------------------------------------------------------------------------------
# clients
# ------------------------------------------------------------------------------------------------
def generate(port: int, ids: list[int], max_new: int, *, logprobs: bool = False, rid: str | None = None,
             timeout: float = 900) -> dict:
    body = {"input_ids": ids,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new, "ignore_eos": True}}
    if logprobs:
        body.update({"return_logprob": True, "top_logprobs_num": 5, "logprob_start_len": -1})
    if rid:
        body["rid"] = rid
    return http_json("POST", port, "/generate", body, timeout=timeout)


def generate_stream(port: int, ids: list[int], max_new: int, timeout: float, *, trace: bool = False,
                    on_tokens: Callable[[int], None] | None = None) -> dict:
    """Streaming /generate: returns per-request timings (TTFT, TPOT) and the token count.

    The token count of a chunk is the cumulative `completion_tokens` of its meta_info (else the
    length of its cumulative `output_ids`, which --skip-tokenizer-init streams).  trace=True adds
    "t0" and "arrivals": [(time.perf_counter(), cumulative tokens)] for every chunk that brought
    tokens; on_tokens(cumulative tokens) is called for each such chunk, on the calling thread."""
    body = json.dumps({"input_ids": ids, "stream": True,
                       "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new,
                                           "ignore_eos": True}}).encode()
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    t0 = time.perf_counter()
    t_first = t_last = None
    n_first = n_last = 0
    finish = None
    arrivals: list[tuple[float, int]] = []
    try:
        conn.request("POST", "/generate", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            return {"error": f"HTTP {resp.status}: {resp.read()[:300]!r}"}
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                break
            obj = json.loads(payload)
            if "error" in obj:
                return {"error": str(obj["error"])[:300]}
            meta = obj.get("meta_info", {})
            n = int(meta.get("completion_tokens") or len(obj.get("output_ids") or []))
            now = time.perf_counter()
            if n > 0 and t_first is None:
                t_first, n_first = now, n
            if n > n_last:
                t_last, n_last = now, n
                if trace:
                    arrivals.append((now, n))
                if on_tokens is not None:
                    on_tokens(n)
            if meta.get("finish_reason"):
                finish = meta["finish_reason"]
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"} | ({"t0": t0, "arrivals": arrivals} if trace else {})
    finally:
        conn.close()
    out = {"tokens": n_last, "e2e_s": time.perf_counter() - t0,
           "ttft_s": (t_first - t0) if t_first else None, "finish": finish}
    if trace:
        out.update(t0=t0, arrivals=arrivals)
    if t_first is not None and t_last is not None and n_last > n_first:
        out["tpot_s"] = (t_last - t_first) / (n_last - n_first)
    return out


def loads(port: int) -> dict | None:
    try:
        data = http_json("GET", port, "/v1/loads?include=core", timeout=5)
        lst = data.get("loads") if isinstance(data, dict) else data
        return lst[0] if lst else None
    except Exception:
        return None


# ------------------------------------------------------------------------------------------------
# phases
# ------------------------------------------------------------------------------------------------
def phase_preflight(args, env0: dict, env_info: dict) -> dict:
    res = {"env": env_info}
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                            "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
        res["gpu"] = [s.strip() for s in q.stdout.strip().splitlines()]
    except Exception as e:
        res["gpu"] = [f"nvidia-smi failed: {e}"]
    code = r"""
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
    env = dict(env0)
    env["PYTHONPATH"] = str(args.site)
    try:
        p = subprocess.run([args.python, "-c", code], env=env, capture_output=True, text=True,
                           timeout=args.preflight_timeout, cwd=str(REPO))
        line = next((ln for ln in p.stdout.splitlines() if ln.startswith("PREFLIGHT_JSON=")), None)
        if line:
            res.update(json.loads(line.split("=", 1)[1]))
        else:
            res["error"] = f"rc={p.returncode}: {(p.stderr or p.stdout)[-1500:]}"
    except subprocess.TimeoutExpired:
        res["error"] = f"preflight timed out after {args.preflight_timeout}s"
    bad = [m for m, v in res.get("imports", {}).items() if not v.get("ok")]
    res["ok"] = not bad and "error" not in res
    for m in bad:
        LOG(f"  preflight: import {m} FAILED: {res['imports'][m].get('error')}")
    LOG(f"  preflight: gpu={res.get('gpu')} cuda={res.get('cuda')} versions={res.get('versions')}")
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


def phase_correctness(srv: Server, args, vocab: int, dl: Deadline, save) -> dict:
    res = {"max_new_tokens": args.corr_out, "prompts": []}
    for p in correctness_prompts(args, vocab):
        if dl.left() < args.reserve_s + 20:
            res["skipped_rest"] = "deadline"
            break
        srv.check()
        t0 = time.perf_counter()
        row = {"id": p["id"], "len": p["len"], "seed": p["seed"]}
        try:
            out = generate(srv.port, p["ids"], args.corr_out, logprobs=True, rid=f"corr-{srv.arm}-{p['id']}",
                           timeout=max(30.0, dl.left() - args.reserve_s))
            meta = out.get("meta_info", {})
            lps, top = extract_logprobs(meta)
            ids = list(out.get("output_ids") or [])
            margins = [t[0][1] - t[1][1] for t in top if t and len(t) > 1 and None not in (t[0][1], t[1][1])]
            row.update({"output_ids": ids, "logprobs": lps, "top": top,
                        "finish_reason": meta.get("finish_reason"),
                        "e2e_s": round(time.perf_counter() - t0, 3),
                        "distinct_tokens": len(set(ids)), "cycle_period": detect_cycle(ids),
                        "nan_logprobs": sum(1 for x in lps if x is None or x != x),
                        "min_top1_margin": min(margins) if margins else None,
                        "median_top1_margin": statistics.median(margins) if margins else None,
                        "mean_logprob": statistics.fmean([x for x in lps if x is not None]) if lps else None})
            LOG(f"  correctness {p['id']}: {len(ids)} tokens in {row['e2e_s']:.2f}s, distinct={row['distinct_tokens']} "
                f"cycle={row['cycle_period']} first={ids[:8]} min_margin={row['min_top1_margin']}")
        except ServerDied:
            raise
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"
            LOG(f"  correctness {p['id']}: ERROR {row['error']}")
            srv.check()
        res["prompts"].append(row)
        save()
    ok = [r for r in res["prompts"] if "output_ids" in r]
    # Determinism of the server itself: the first prompts again, same server.
    repeats = []
    for p, first in zip(correctness_prompts(args, vocab)[: args.corr_repeat], ok):
        if dl.left() < args.reserve_s + 20:
            break
        again = generate(srv.port, p["ids"], args.corr_out, logprobs=True, rid=f"corr-{srv.arm}-{p['id']}-again",
                         timeout=max(30.0, dl.left() - args.reserve_s))
        lps, top = extract_logprobs(again.get("meta_info", {}))
        second = {"id": p["id"], "output_ids": list(again.get("output_ids") or []), "logprobs": lps, "top": top}
        row = compare_outputs({"prompts": [first]}, {"prompts": [second]})["per_prompt"][0]
        repeats.append(row)
        LOG(f"  correctness repeat {p['id']}: identical={row['identical']} first mismatch={row['first_mismatch']} "
            f"max|dlogprob| before it={row['max_abs_dlogprob']:.3g}")
    res["repeats"] = repeats
    res["distinct_outputs"] = len({tuple(r["output_ids"]) for r in ok})
    res["prompts_ok"] = len(ok)
    pair = [r for r in ok if r["id"].startswith("pair")]
    if len(pair) == 2:
        res["context_sensitive"] = pair[0]["output_ids"] != pair[1]["output_ids"]
    LOG(f"  correctness: {res['prompts_ok']} prompts, {res['distinct_outputs']} distinct outputs, "
        f"context_sensitive={res.get('context_sensitive')}")
    return res


def phase_capacity(srv: Server, args, vocab: int, dl: Deadline) -> dict:
    n, L, O = args.cap_requests, args.cap_input_len, args.cap_output_len
    budget = min(args.cap_timeout, dl.left() - args.reserve_s - 15)
    res = {"requests": n, "input_len": L, "output_len": O}
    if budget < 20:
        res["skipped"] = "deadline"
        return res
    prompts = [make_prompt(50_000 + i, L, vocab) for i in range(n)]
    off = file_size(srv.log_path)
    results: list = [None] * n

    def worker(i: int) -> None:
        try:
            out = generate(srv.port, prompts[i], O, rid=f"cap-{srv.arm}-{i}", timeout=budget + 30)
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
            srv.check()
            now = time.monotonic()
            ld = loads(srv.port)
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
            http_json("POST", srv.port, "/abort_request", {"abort_all": True}, timeout=30)
        pool.shutdown(wait=True, cancel_futures=False)
    seg = summarize_log(read_from(srv.log_path, off))
    res.update({
        "duration_s": round(time.monotonic() - t0, 1), "stop_reason": stop_reason,
        "max_running_loads": best if samples else None,
        "max_running_log": seg["max_running"],
        "max_running": max(x for x in (best if samples else None, seg["max_running"], 0) if x is not None),
        "retracted_reqs": seg["retracted_reqs"], "max_token_usage_log": seg["max_token_usage"],
        "loads_samples": samples[-400:],
        "finish_reasons": {k: sum(1 for x in results if str(x) == k) for k in sorted({str(x) for x in results})},
    })
    LOG(f"  capacity: max running {res['max_running']} of {n} x {L}+{O} tokens "
        f"(loads {res['max_running_loads']}, log {res['max_running_log']}), {stop_reason}, "
        f"{res['duration_s']}s, retracted {res['retracted_reqs']}")
    return res


def phase_throughput(srv: Server, args, vocab: int, dl: Deadline, cap: int | None, save) -> dict:
    L, O = args.tp_input_len, args.tp_output_len
    res = {"input_len": L, "output_len": O, "levels": []}
    levels = []
    for lv in args.tp_levels:
        c = lv if lv != "max" else (cap or args.tp_max_fallback)
        if lv == "max" and not cap:
            res["max_level_note"] = f"no capacity measured; 'max' = --tp-max-fallback {args.tp_max_fallback}"
        if c not in [x for _, x in levels]:
            levels.append((lv, c))
    # warm-up at this input length (kernels specialised on sequence length get compiled here)
    with contextlib.suppress(Exception):
        t = time.perf_counter()
        generate(srv.port, make_prompt(99, L, vocab), 8, timeout=max(30.0, min(300.0, dl.left() - args.reserve_s)))
        res["warmup_s"] = round(time.perf_counter() - t, 2)
    runs = [(lv, c, rep) for lv, c in levels for rep in range(args.tp_repeats)]
    for lv, c, rep in runs:
        if dl.left() < args.reserve_s + 20:
            res["skipped_rest"] = "deadline"
            break
        srv.check()
        prompts = [make_prompt(200_000 + 1000 * c + 100_000 * rep + i, L, vocab) for i in range(c)]
        off = file_size(srv.log_path)
        timeout = max(20.0, min(args.tp_level_timeout, dl.left() - args.reserve_s))
        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=c) as pool:
            outs = list(pool.map(lambda ids: generate_stream(srv.port, ids, O, timeout=timeout), prompts))
        wall = time.perf_counter() - t0
        seg = summarize_log(read_from(srv.log_path, off))
        ok = [o for o in outs if "error" not in o]
        tpots = [o["tpot_s"] for o in ok if o.get("tpot_s")]
        ttfts = [o["ttft_s"] for o in ok if o.get("ttft_s") is not None]
        toks = sum(o["tokens"] for o in ok)
        hs = seg.get("hisparse") or {}
        row = {"level": lv, "repeat": rep, "concurrency": c, "ok": len(ok),
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
               # per request, in send order: [TTFT s, end-to-end s, output tokens] (the tail of a level)
               "requests": [[round(o["ttft_s"], 3) if o.get("ttft_s") is not None else None,
                             round(o["e2e_s"], 3), o["tokens"]] for o in ok]}
        res["levels"].append(row)
        LOG(f"  throughput c={c:3d} ({lv}, run {rep + 1}/{args.tp_repeats}): {row['output_tok_s']} out tok/s, "
            f"TPOT median {row['tpot_ms_median']} ms, TTFT median {row['ttft_s_median']} s, "
            f"log decode {row['log_gen_tput_median']} tok/s, max running {row['log_max_running']}, "
            f"HiSparse step host {row['hisparse_step_host_ms_median']} ms, wall {row['wall_s']}s, ok {row['ok']}/{c}")
        save()
    return res


def storm_burst(srv: Server, prompts: list[list[int]], out_len: int, timeout: float) -> tuple[ThreadPoolExecutor, list, list]:
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
            out = generate(srv.port, prompts[i], out_len, rid=f"storm-{srv.arm}-{i}", timeout=timeout)
            fin = out.get("meta_info", {}).get("finish_reason")
            row.update(finish=fin.get("type") if isinstance(fin, dict) else fin, tokens=len(out.get("output_ids") or []))
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"[:200]
        row["end"] = time.perf_counter()
        row["log_end"] = file_size(srv.log_path)

    pool = ThreadPoolExecutor(max_workers=n)
    futs = [pool.submit(worker, i) for i in range(n)]
    return pool, futs, rows


def phase_storm(srv: Server, args, vocab: int, dl: Deadline) -> dict:
    """R0 streams; once it has --storm-after-tokens tokens, --storm-requests long requests arrive at once.
    The window is [first burst request sent, last burst request done]; R0's token gaps in it are
    compared with its pace before (storm_gap_stats), the server log of the window is parsed."""
    L, O, K = args.storm_input_len, args.storm_output_len, args.storm_after_tokens
    B, OB = args.storm_requests, args.storm_burst_output_len
    res: dict = {"input_len": L, "output_len": O, "after_tokens": K, "requests": B, "burst_output_len": OB,
                 "tpot_from_token": STORM_TPOT_FROM, "timed_out": False}
    budget = min(args.storm_timeout, dl.left() - args.reserve_s - 15)
    if budget < 20:
        res["skipped"] = "deadline"
        return res
    with contextlib.suppress(Exception):  # kernels specialised on sequence length compile here, not in R0
        t = time.perf_counter()
        generate(srv.port, make_prompt(98, L, vocab), 8, timeout=max(30.0, min(300.0, dl.left() - args.reserve_s)))
        res["warmup_s"] = round(time.perf_counter() - t, 2)
    t_end = time.monotonic() + budget
    r0_ids = make_prompt(400_000, L, vocab)
    burst_prompts = [make_prompt(400_001 + i, L, vocab) for i in range(B)]
    fired, r0_done = threading.Event(), threading.Event()
    r0: dict = {}

    def on_tokens(n: int) -> None:
        if n >= K:
            fired.set()

    def run_r0() -> None:
        try:
            r0.update(generate_stream(srv.port, r0_ids, O, timeout=budget + 30, trace=True, on_tokens=on_tokens))
        finally:
            r0_done.set()

    r0_thread = threading.Thread(target=run_r0, name="storm-r0", daemon=True)
    r0_thread.start()
    while not fired.is_set() and not r0_done.is_set() and time.monotonic() < t_end:
        fired.wait(0.05)
        srv.check()
    pool, futs, rows = None, [], []
    log_start = file_size(srv.log_path)
    try:
        if fired.is_set():
            pool, futs, rows = storm_burst(srv, burst_prompts, OB, timeout=max(10.0, t_end - time.monotonic() + 30))
            while not (r0_done.is_set() and all(f.done() for f in futs)) and time.monotonic() < t_end:
                time.sleep(0.05)
                srv.check()
        else:
            r0_done.wait(max(0.0, t_end - time.monotonic()))
            res["error"] = (f"R0 ended after {r0.get('tokens')} tokens, before {K} ({r0.get('error')})"
                            if r0_done.is_set() else f"R0 did not reach {K} tokens in {budget:.0f}s")
        if not (r0_done.is_set() and all(f.done() for f in futs)):
            res["timed_out"] = True
            LOG(f"  storm: not done after {budget:.0f}s: aborting all requests")
            with contextlib.suppress(Exception):
                http_json("POST", srv.port, "/abort_request", {"abort_all": True}, timeout=30)
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=False)
        r0_thread.join(timeout=60)
    res.update(storm_summary(r0, rows, K, srv.log_path, log_start))
    LOG(f"  storm: TPOT before {res.get('tpot_before_ms')} ms, in the {res.get('window_s')}s window max gap "
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


# ------------------------------------------------------------------------------------------------
# results
# ------------------------------------------------------------------------------------------------
def load_state(state: Path) -> dict:
    arms = {}
    for arm in ALL_ARMS:
        p = state / f"arm-{arm}.json"
        if p.exists():
            with contextlib.suppress(Exception):
                arms[arm] = json.loads(p.read_text())
    meta = {}
    if (state / "meta.json").exists():
        with contextlib.suppress(Exception):
            meta = json.loads((state / "meta.json").read_text())
    return {"meta": meta, "arms": arms}


def build_report(state: Path, imported: list[Path]) -> dict:
    data = load_state(state)
    for f in imported:
        with contextlib.suppress(Exception):
            other = json.loads(Path(f).read_text())
            for arm, r in other.get("arms", {}).items():
                data["arms"].setdefault(arm, r | {"imported_from": str(f)})
            for k, v in other.get("meta", {}).items():
                data["meta"].setdefault(k, v)
    arms = data["arms"]
    comp = {}
    for x, y in COMPARE_PAIRS:
        cx, cy = arms.get(x, {}).get("correctness"), arms.get(y, {}).get("correctness")
        if cx and cy:
            c = compare_outputs(cy, cx)
            fx, fy = arms[x].get("weight_fingerprints"), arms[y].get("weight_fingerprints")
            c["same_weights"] = (fx == fy) if fx and fy else None
            comp[f"{x}_vs_{y}"] = c
    data["compare"] = comp
    return data


def fmt(v, nd=1):
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def render_markdown(data: dict) -> str:
    meta, arms, comp = data.get("meta", {}), data.get("arms", {}), data.get("compare", {})
    pf = meta.get("preflight", {})
    lines = ["# HiSparse end-to-end benchmark (SGLang 0.5.17, tiny DeepSeek-V3.2 DSA model)", ""]
    lines.append(f"- date: {meta.get('date', '?')}; GPU: {', '.join(pf.get('gpu') or ['?'])}")
    v = pf.get("versions") or {}
    lines.append("- versions: " + ", ".join(f"{k} {v[k]}" for k in sorted(v) if v[k]) + f"; python {pf.get('python', '?')}")
    a = meta.get("args", {})
    kv_dtype = a.get("kv_cache_dtype", "bfloat16")
    lines.append(f"- server: dsa + {DSA_BACKEND_OF_KV_DTYPE.get(kv_dtype, '?')} prefill/decode, {kv_dtype} KV, CUDA graph "
                 f"{'off' if a.get('disable_cuda_graph') else 'on'}, radix cache off, --max-total-tokens "
                 f"{a.get('max_total_tokens')}, --mem-fraction-static {a.get('mem_fraction_static')}, context "
                 f"{a.get('context_length')}; HiSparse config `{a.get('hisparse_config')}`; weights: dummy, "
                 f"init `{a.get('weight_init')}`")
    lines.append("")
    present = [x for x in ALL_ARMS if x in arms]
    if not present:
        return "\n".join(lines + ["(no arm results yet)", ""])
    hdr = "| | " + " | ".join(f"{x}: {ARM_LABELS[x]}" for x in present) + " |"
    lines += [hdr, "|---|" + "---|" * len(present)]

    def row(title, fn):
        vals = []
        for x in present:
            try:
                vals.append(fn(arms[x]))
            except Exception:
                vals.append("–")
        lines.append(f"| {title} | " + " | ".join(vals) + " |")

    row("status", lambda r: r.get("status", "?"))
    row("server start (s)", lambda r: fmt(r.get("startup_s")))
    row("device KV pool (max_total_num_tokens)", lambda r: fmt(r.get("log", {}).get("max_total_num_tokens")))
    row("weight fingerprint", lambda r: ", ".join(r.get("weight_fingerprints") or ["–"])[:40])
    row("correctness prompts ok / distinct outputs", lambda r: f"{r['correctness']['prompts_ok']} / {r['correctness']['distinct_outputs']}")
    row("outputs depend on far context", lambda r: fmt(r["correctness"].get("context_sensitive")))
    cap_len = next((arms[x]["capacity"].get("input_len") for x in present if arms[x].get("capacity")), None)
    row(f"max concurrent {cap_len}-token requests running", lambda r: f"{r['capacity']['max_running']} of {r['capacity']['requests']}")
    levels = []
    for x in present:
        for lv in (arms[x].get("throughput") or {}).get("levels", []):
            key = (lv["level"], lv.get("repeat", 0))
            if key not in levels:
                levels.append(key)

    def lvl(r, key):
        return next((v for v in r["throughput"]["levels"] if (v["level"], v.get("repeat", 0)) == key), None)

    for key in levels:
        name = f"c={key[0]}" + (f" (run {key[1] + 1})" if any(k[1] for k in levels) else "")
        row(f"{name}: output tok/s (client)", lambda r, k=key: f"{fmt(lvl(r, k)['output_tok_s'])} (c={lvl(r, k)['concurrency']})")
        row(f"{name}: TPOT median / p90 (ms)", lambda r, k=key: f"{fmt(lvl(r, k)['tpot_ms_median'], 2)} / {fmt(lvl(r, k)['tpot_ms_p90'], 2)}")
        row(f"{name}: decode tok/s (server log, median)", lambda r, k=key: fmt(lvl(r, k)["log_gen_tput_median"]))
        row(f"{name}: TTFT median / max (s)",
            lambda r, k=key: f"{fmt(lvl(r, k)['ttft_s_median'], 2)} / {fmt(lvl(r, k).get('ttft_s_max'), 2)}")
        row(f"{name}: HiSparse host work per decode step (ms, median)",
            lambda r, k=key: fmt(lvl(r, k).get("hisparse_step_host_ms_median"), 3))
    tp = next((arms[x]["throughput"] for x in present if arms[x].get("throughput")), None)
    if tp:
        lines.append(f"\nThroughput: {tp.get('input_len')} input + {tp.get('output_len')} output tokens per request, "
                     "streaming client, all requests sent at once per level.")
    lines += render_storm(arms, present)
    if comp:
        lines += ["", "## Greedy outputs compared (token ids, logprobs before the first divergence)", "",
                  "| pair | prompts identical | mismatched tokens | max abs dlogprob | max abs dtop5 | same weights |",
                  "|---|---|---|---|---|---|"]
        for k, c in comp.items():
            lines.append(f"| {k} | {c['prompts_identical']}/{c['prompts_compared']} | {c['mismatched_tokens']} | "
                         f"{c['max_abs_dlogprob_before_divergence']:.3g} | {c['max_abs_dtop5_before_divergence']:.3g} | "
                         f"{fmt(c.get('same_weights'))} |")
    errs = [(x, arms[x].get("error")) for x in present if arms[x].get("error")]
    if errs:
        lines += ["", "## Errors", ""]
        for x, e in errs:
            lines.append(f"- arm {x}: " + str(e).splitlines()[0][:300])
    return "\n".join(lines) + "\n"


def render_storm(arms: dict, present: list[str]) -> list[str]:
    """The storm table (one row per arm that has a storm result); [] if none has."""
    have = [x for x in present if (arms[x].get("storm") or {}).get("requests")]
    if not have:
        return []
    st = arms[have[0]]["storm"]
    out = ["", f"## Storm: {st['requests']} new {st['input_len']}-token requests (+{st.get('burst_output_len')} output) "
               f"arrive while one request decodes (after its token {st.get('after_tokens')})", "",
           "| arm | TPOT before (ms) | max gap (ms) | p99 gap (ms) | stall (ms) | gaps > 2x TPOT | TPOT after (ms) "
           "| window (s) | burst latency median / max (s) | prefill batches in window | HiSparse switch work max (ms/step) "
           "| HiSparse demotions/min max |",
           "|---|" + "---|" * 11]
    for x in have:
        r = arms[x]["storm"]
        # the first HiSparse line after the burst start covers the window (the plugin reports maxima per interval)
        hs = r.get("hisparse_after_burst_start") or r.get("hisparse_window") or {}
        note = " (timed out)" if r.get("timed_out") else (" (skipped)" if r.get("skipped") else "")
        out.append(f"| {x}{note} | {fmt(r.get('tpot_before_ms'), 2)} | {fmt(r.get('max_gap_ms'))} | {fmt(r.get('p99_gap_ms'))} | "
                   f"{fmt(r.get('stall_ms'))} | {fmt(r.get('gaps_over_2x'))} | {fmt(r.get('tpot_after_ms'), 2)} | "
                   f"{fmt(r.get('window_s'), 2)} | {fmt(r.get('burst_latency_s_median'), 2)} / {fmt(r.get('burst_latency_s_max'), 2)} | "
                   f"{fmt(r.get('prefill_batches_window'))} | {fmt(hs.get('switch_work_max_ms'), 2)} | "
                   f"{fmt(hs.get('demotions_per_min_max'))} |")
    out.append("\nGaps: time between streamed tokens of the decoding request; a chunk of k tokens gives each the gap/k. "
               "Window: first burst request sent .. last burst request done. Stall: sum over the window of "
               "max(0, gap - TPOT before). HiSparse columns: the plugin's `HiSparse:` log lines from the burst start to "
               "the end of the decoding request (– where the arm logs none).")
    return out


class Outputs:
    """Writes results to the state dir and mirrors results/logs to $OUT (<= 8 files)."""

    def __init__(self, state: Path, out: Path | None, imported: list[Path]):
        self.state, self.out, self.imported = state, out, imported

    def publish(self) -> dict:
        data = build_report(self.state, self.imported)
        text = json.dumps(data, indent=1, default=str)
        md = render_markdown(data)
        atomic_write(self.state / "results.json", text)
        atomic_write(self.state / "results.md", md)
        if self.out:
            atomic_write(self.out / "results.json", text)
            atomic_write(self.out / "results.md", md)
            for arm in ALL_ARMS:
                self.copy_log(self.state / f"server-{arm}.log", self.out / f"server-{arm}.log")
            self.copy_log(self.state / "harness.log", self.out / "harness-all-runs.log")
        return data

    @staticmethod
    def copy_log(src: Path, dst: Path, limit: int = 15 << 20) -> None:
        if not src.exists():
            return
        size = src.stat().st_size
        with contextlib.suppress(OSError):
            if size <= limit:
                shutil.copyfile(src, dst)
            else:  # keep the head (startup) and the tail
                with open(src, "rb") as f, open(dst, "wb") as g:
                    g.write(f.read(1 << 20))
                    g.write(f"\n\n[... {size - limit} bytes cut by run_e2e.py ...]\n\n".encode())
                    f.seek(size - (limit - (1 << 20)))
                    g.write(f.read())


# ------------------------------------------------------------------------------------------------
# main
# ------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_argument_group("what to run")
    g.add_argument("--arms", default="a,b,c",
                   help="comma list of " + ",".join(ALL_ARMS) + " (default %(default)s; d = plugin with "
                        '"resident_first": false is opt-in)')
    g.add_argument("--phases", default=DEFAULT_PHASES,
                   help="comma list of " + ",".join(ALL_PHASES) + " (default %(default)s; storm is opt-in)")
    g.add_argument("--deadline-s", type=float, default=560,
                   help="wall-clock budget of this invocation; arms/phases that no longer fit are skipped (default %(default)s)")
    g.add_argument("--reserve-s", type=float, default=35, help="time kept for shutdown + writing results")
    g.add_argument("--arm-min-s", type=float, default=150, help="do not start an arm with less time left")
    g.add_argument("--dry-run", action="store_true", help="print the server commands/env and exit")
    g.add_argument("--fresh", action="store_true", help="delete earlier results in the state dir first")
    g.add_argument("--import-results", action="append", default=[], type=Path,
                   help="merge arms from an earlier results.json (arms in the state dir win)")
    g = ap.add_argument_group("paths")
    g.add_argument("--state-dir", type=Path, default=Path(os.environ.get("HISPARSE_E2E_STATE", "/tmp/hisparse_e2e")))
    g.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None,
                   help="mirror results here (default $OUT)")
    g.add_argument("--site", type=Path, default=Path("/tmp/site"), help="where install_part.sh put the bundle")
    g.add_argument("--python", default=sys.executable, help="python of the servers (default: this one)")
    g.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL)
    g.add_argument("--plugin-src", type=Path, default=REPO / "src", help="put on PYTHONPATH for arms c and d")
    g = ap.add_argument_group("server")
    g.add_argument("--port-base", type=int, default=31000, help="arms a/b/c/d use base+0/+10/+20/+30")
    g.add_argument("--max-total-tokens", type=int, default=131072)
    g.add_argument("--mem-fraction-static", type=float, default=0.5)
    g.add_argument("--context-length", type=int, default=65536)
    g.add_argument("--random-seed", type=int, default=1234)
    g.add_argument("--kv-cache-dtype", choices=sorted(DSA_BACKEND_OF_KV_DTYPE), default="bfloat16",
                   help="KV cache dtype of every arm; picks the DSA backend HiSparse supports for it "
                        "(bfloat16: flashmla_sparse, 1152-B rows; fp8_e4m3: flashmla_kv, 656-B rows)")
    g.add_argument("--hisparse-config", default=DEFAULT_HISPARSE_CONFIG)
    g.add_argument("--disable-cuda-graph", action="store_true")
    g.add_argument("--dense-attn-threshold", type=int, default=0,
                   help="SGLANG_DSA_PREFILL_DENSE_ATTN_KV_LEN_THRESHOLD (must stay 0 without FA3)")
    g.add_argument("--extra-server-args", default="", help="appended to every arm (shell-quoted string)")
    g.add_argument("--health-timeout", type=float, default=420)
    g.add_argument("--no-jit-shim", action="store_true")
    g.add_argument("--weight-init", choices=("scaled", "sglang"), default="scaled")
    g.add_argument("--weight-seed", type=int, default=1234)
    g = ap.add_argument_group("arms c and d (plugin)")
    g.add_argument("--plugin-env", action="append", default=[], metavar="KEY=VALUE",
                   help="environment of the servers of arms c and d")
    g.add_argument("--plugin-args", default="", help="extra server args of arms c and d (shell-quoted string)")
    g.add_argument("--plugin-no-enable-hisparse", action="store_true",
                   help="arm c without --enable-hisparse/--hisparse-config (not with arm d, which needs them)")
    g.add_argument("--allow-plugin-failure", action="store_true",
                   help="measure arms c/d even if the plugin failed to load")
    g.add_argument("--plugin-ep", default="", metavar="NAME=module:attr",
                   help="entry point to register (default: from pyproject.toml)")
    g = ap.add_argument_group("correctness")
    g.add_argument("--corr-lens", default="8192,16384,32768")
    g.add_argument("--corr-seeds", type=int, default=2)
    g.add_argument("--corr-out", type=int, default=256)
    g.add_argument("--corr-repeat", type=int, default=2, help="prompts decoded twice by the same server")
    g.add_argument("--corr-pair-len", type=int, default=16384, help="0 disables the context-sensitivity pair")
    g = ap.add_argument_group("capacity")
    g.add_argument("--cap-input-len", type=int, default=16384)
    g.add_argument("--cap-output-len", type=int, default=4096)
    g.add_argument("--cap-requests", type=int, default=64)
    g.add_argument("--cap-timeout", type=float, default=100)
    g.add_argument("--cap-plateau-s", type=float, default=10)
    g.add_argument("--cap-poll-s", type=float, default=0.5)
    g = ap.add_argument_group("throughput")
    g.add_argument("--tp-input-len", type=int, default=16384)
    g.add_argument("--tp-output-len", type=int, default=256)
    g.add_argument("--tp-levels", default="1,8,32,max")
    g.add_argument("--tp-repeats", type=int, default=1,
                   help="run every throughput level this many times in a row (new prompts each time)")
    g.add_argument("--tp-level-timeout", type=float, default=120)
    g.add_argument("--tp-max-fallback", type=int, default=64, help="'max' level if capacity was not measured")
    g = ap.add_argument_group("storm (opt-in phase)")
    g.add_argument("--storm-input-len", type=int, default=16384,
                   help="input tokens of the decoding request and of every burst request (default %(default)s)")
    g.add_argument("--storm-output-len", type=int, default=600,
                   help="output tokens of the decoding (streaming) request (default %(default)s)")
    g.add_argument("--storm-after-tokens", type=int, default=100,
                   help="the burst is sent when the decoding request has this many tokens; its TPOT before the "
                        f"burst is the median gap of tokens {STORM_TPOT_FROM + 1}..this (default %(default)s)")
    g.add_argument("--storm-requests", type=int, default=24, help="requests of the burst, sent at once (default %(default)s)")
    g.add_argument("--storm-burst-output-len", type=int, default=32,
                   help="output tokens of every burst request (default %(default)s)")
    g.add_argument("--storm-timeout", type=float, default=180,
                   help="seconds for the whole storm; then all requests are aborted and timed_out is set "
                        "(default %(default)s)")
    g.add_argument("--preflight-timeout", type=float, default=180)
    args = ap.parse_args(argv)
    try:
        args.arms = parse_csv(args.arms, ALL_ARMS, "arms")
        args.phases = parse_csv(args.phases, ALL_PHASES, "phases")
        args.tp_levels = parse_levels(args.tp_levels)
        args.corr_lens = [int(x) for x in args.corr_lens.split(",") if x.strip()]
        parse_env_assignments(args.plugin_env)
        for arm in ALL_ARMS:  # main() builds every arm's spec
            hisparse_config_json(args.hisparse_config, arm)
        shlex.split(args.plugin_args)
        shlex.split(args.extra_server_args)
        if args.plugin_ep and not re.fullmatch(r"[\w.-]+=[\w.]+:[\w.]+", args.plugin_ep.replace(" ", "")):
            raise ValueError(f"--plugin-ep must look like name=module:attr, got {args.plugin_ep!r}")
    except (ValueError, json.JSONDecodeError) as e:
        ap.error(str(e))
    if max(args.corr_lens + [args.cap_input_len, args.tp_input_len, args.storm_input_len]) + max(
            args.corr_out, args.cap_output_len, args.tp_output_len, args.storm_output_len, args.storm_burst_output_len) \
            > args.context_length:
        ap.error("input + output length exceeds --context-length")
    if "d" in args.arms and args.plugin_no_enable_hisparse:
        ap.error("arm d passes \"resident_first\": false through --hisparse-config; drop --plugin-no-enable-hisparse")
    if min(args.storm_input_len, args.storm_output_len, args.storm_requests, args.storm_burst_output_len) < 1:
        ap.error("--storm-input-len, --storm-output-len, --storm-requests and --storm-burst-output-len must be >= 1")
    if not STORM_TPOT_FROM < args.storm_after_tokens < args.storm_output_len:
        ap.error(f"--storm-after-tokens must be in ({STORM_TPOT_FROM}, --storm-output-len): "
                 f"the TPOT before the burst needs tokens {STORM_TPOT_FROM + 1}..after-tokens and the burst must "
                 "come before the request ends")
    args.model_dir = args.model_dir.resolve()
    return args


def main(argv: list[str] | None = None) -> int:
    global LOG
    args = parse_args(argv)
    dl = Deadline(args.deadline_s)
    state = args.state_dir
    if args.fresh and state.exists():
        for p in list(state.glob("arm-*.json")) + list(state.glob("server-*.log")) + \
                [state / "meta.json", state / "results.json", state / "results.md"]:
            with contextlib.suppress(OSError):
                p.unlink()
    state.mkdir(parents=True, exist_ok=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    LOG = Log([state / "harness.log"] + ([args.out / "harness.log"] if args.out else []))
    LOG(f"run_e2e.py {' '.join(argv if argv is not None else sys.argv[1:])}")
    LOG(f"arms={args.arms} phases={args.phases} deadline={args.deadline_s:.0f}s state={state} out={args.out}")
    outputs = Outputs(state, args.out, args.import_results)
    vocab = json.loads((args.model_dir / "config.json").read_text())["vocab_size"]

    meta = load_state(state)["meta"]
    meta.update({"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                 "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}})
    meta.setdefault("runs", []).append({"argv": sys.argv[1:] if argv is None else argv,
                                        "started": meta["date"]})

    env0, env_info = base_env(args, state)
    common, plugin_dir, plugin_ep = prepare_pyext(state, args)
    meta["plugin_entry_point"] = f"{plugin_ep[0]} = {plugin_ep[1]}"

    specs = {}
    for i, arm in enumerate(ALL_ARMS):
        specs[arm] = arm_spec(arm, args, env0, common, plugin_dir, args.port_base + 10 * i)
    if args.dry_run:
        for arm in args.arms:
            cmd, env = specs[arm]
            diff = {k: v for k, v in env.items() if os.environ.get(k) != v}
            print(f"# arm {arm}: {ARM_LABELS[arm]}")
            print("env " + " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(diff.items())))
            print(shlex.join(cmd) + "\n")
        return 0

    stop_flag = {"server": None}

    def on_signal(signum, frame):
        LOG(f"signal {signum}: stopping")
        srv = stop_flag["server"]
        if srv is not None:
            srv.stop(grace=5)
        outputs.publish()
        sys.exit(128 + signum)

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, on_signal)
    kill_stale_servers(state)

    def save_meta():
        atomic_write(state / "meta.json", json.dumps(meta, indent=1, default=str))

    if "preflight" in args.phases:
        LOG("phase preflight")
        meta["preflight"] = phase_preflight(args, env0, env_info)
    else:
        meta.setdefault("preflight", {"env": env_info})
    save_meta()
    outputs.publish()

    rc = 0
    arm_phases = [p for p in ARM_PHASES if p in args.phases]
    for arm in args.arms if arm_phases else []:
        cmd, env = specs[arm]
        port = args.port_base + 10 * ALL_ARMS.index(arm)
        rpath = state / f"arm-{arm}.json"
        result = {"arm": arm, "label": ARM_LABELS[arm], "status": "starting", "cmd": shlex.join(cmd),
                  "pythonpath": env["PYTHONPATH"],
                  "env": {k: env[k] for k in sorted(env) if k.startswith(("SGLANG_", "HISPARSE_", "CUDA_HOME"))}
                  | parse_env_assignments(args.plugin_env if arm in PLUGIN_ARMS else [])}
        old = json.loads(rpath.read_text()) if rpath.exists() else {}
        for p in ARM_PHASES:  # keep earlier phases not rerun now
            if p not in arm_phases and p in old:
                result[p] = old[p]

        def save(result=result, rpath=rpath):
            atomic_write(rpath, json.dumps(result, indent=1, default=str))
            outputs.publish()

        if dl.left() < args.arm_min_s:
            result.update(status="skipped", error=f"not started: {dl.left():.0f}s left < --arm-min-s {args.arm_min_s:.0f}")
            LOG(f"arm {arm}: SKIPPED ({result['error']}); rerun with --arms {arm}")
            if not old:
                save()
            rc = max(rc, 3)
            continue
        log_path = state / f"server-{arm}.log"
        srv = Server(arm, cmd, env, log_path, port, state)
        stop_flag["server"] = srv
        LOG(f"arm {arm} ({ARM_LABELS[arm]}): starting server on port {port}")
        LOG(f"  PYTHONPATH={env['PYTHONPATH']}")
        LOG(f"  $ {shlex.join(cmd)}")
        log_off = file_size(log_path)
        try:
            srv.start()
            result["startup_s"] = round(srv.wait_healthy(min(args.health_timeout, dl.left() - args.reserve_s)), 1)
            LOG(f"  healthy after {result['startup_s']}s")
            t = time.perf_counter()
            generate(port, make_prompt(3, min(4096, args.tp_input_len), vocab), 16,
                     timeout=max(30.0, min(300.0, dl.left() - args.reserve_s)))
            result["warmup_s"] = round(time.perf_counter() - t, 2)
            with contextlib.suppress(Exception):
                info = http_json("GET", port, "/server_info", timeout=30)
                ist = (info.get("internal_states") or [{}])[0]
                result["server_internal"] = {k: ist.get(k) for k in (
                    "effective_max_running_requests_per_dp", "memory_usage", "last_gen_throughput")}
                result["server_info"] = {k: info.get(k) for k in (
                    "max_total_num_tokens", "max_req_input_len", "page_size", "chunked_prefill_size",
                    "cuda_graph_max_bs", "max_running_requests", "version", "enable_hisparse",
                    "hisparse_config", "attention_backend", "dsa_prefill_backend", "dsa_decode_backend")}
            seg = summarize_log(read_from(log_path, log_off))
            result["log"] = seg
            result["weight_fingerprints"] = seg["weight_fingerprints"]
            LOG(f"  warm-up {result['warmup_s']}s; weights {seg['weight_init']} fingerprint {seg['weight_fingerprints']}; "
                f"max_total_num_tokens={seg['max_total_num_tokens']}; plugins visible {seg['visible_plugins']}; "
                f"dense threshold {seg['dense_attn_threshold']}")
            if seg["plugin_failures"]:
                LOG(f"  WARNING plugin failures in the server log: {seg['plugin_failures']}")
            if not seg["weight_fingerprints"]:
                LOG("  WARNING: no weight fingerprint in the server log (fixture plugin not loaded?)")
            if arm in PLUGIN_ARMS:
                visible = any(f"{plugin_ep[0]}=" in v for v in seg["visible_plugins"])
                failed = [f for f in seg["plugin_failures"] if plugin_ep[0] in f]
                result["plugin_check"] = {"entry_point": f"{plugin_ep[0]} = {plugin_ep[1]}",
                                          "visible": visible, "failures": failed}
                if (failed or not visible) and not args.allow_plugin_failure:
                    raise RuntimeError(f"arm {arm}: plugin entry point {plugin_ep[0]} "
                                       f"{'failed: ' + str(failed) if failed else 'not visible to sglang'}; "
                                       f"arm {arm} would just repeat arm b (--allow-plugin-failure runs it anyway)")
            result["status"] = "running"
            save()
            if "correctness" in arm_phases:
                LOG(f"arm {arm}: correctness")
                result["correctness"] = phase_correctness(srv, args, vocab, dl, save)
                save()
            if "capacity" in arm_phases:
                LOG(f"arm {arm}: capacity")
                result["capacity"] = phase_capacity(srv, args, vocab, dl)
                save()
            if "throughput" in arm_phases:
                LOG(f"arm {arm}: throughput")
                cap = (result.get("capacity") or {}).get("max_running") or None
                result["throughput"] = phase_throughput(srv, args, vocab, dl, cap, save)
                save()
            if "storm" in arm_phases:
                LOG(f"arm {arm}: storm")
                result["storm"] = phase_storm(srv, args, vocab, dl)
                save()
            result["status"] = "ok"
        except (ServerDied, TimeoutError) as e:
            result.update(status="failed", error=str(e))
            LOG(f"arm {arm}: FAILED: {e}")
            rc = max(rc, 2)
        except Exception as e:
            result.update(status="failed", error=f"{type(e).__name__}: {e}\nlast log lines:\n{log_tail(log_path, 40)}")
            LOG(f"arm {arm}: FAILED: {type(e).__name__}: {e}")
            rc = max(rc, 2)
        finally:
            srv.stop()
            stop_flag["server"] = None
            full = summarize_log(read_from(log_path, log_off))
            result["log"] = full
            result["weight_fingerprints"] = full["weight_fingerprints"] or result.get("weight_fingerprints")
            result["elapsed_s"] = round(dl.elapsed(), 1)
            save()
    meta["runs"][-1]["finished"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    save_meta()
    data = outputs.publish()
    LOG("report:\n" + render_markdown(data))
    LOG(f"done in {dl.elapsed():.0f}s (rc={rc}); results: {state / 'results.json'}"
        + (f" and {args.out}" if args.out else ""))
    return rc


if __name__ == "__main__":
    sys.exit(main())
