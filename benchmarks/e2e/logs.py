"""Reading SGLang's server logs: the decode/prefill batch lines, the plugin's ``HiSparse:`` line and
the fixture's lines (pure functions on text; unit-tested by tools/e2e-selftest/selftest.py on synthetic lines)."""

from __future__ import annotations

import contextlib
import json
import re
import statistics
from pathlib import Path

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
# the fixture's record of the regions SGLang's Mooncake KV manager registers (HISPARSE_E2E_PD_TRACE=1)
PD_REGISTER_RE = re.compile(r"\[hisparse-e2e-fixture\] pid=\d+ pd-register (?P<json>\{.*\})")
KV_CHECK_RE = re.compile(r"\[hisparse-e2e-fixture\] pid=\d+ kv-check (?P<json>\{.*\})")
# SGLang's rejection of a prompt longer than a request may be (validate_input_length)
INPUT_TOO_LONG_RE = re.compile(r"Input length \(\d+ tokens\) exceeds the maximum allowed length \(\d+ tokens\)[^\n]*")
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
    ("device_rows_used", re.compile(r"device rows (\d+)/"), int),
    ("host_rows_used", re.compile(r"host rows (\d+)/"), int),
    ("switch_work_max_ms", re.compile(r"switch work max ([0-9.]+) ms/step"), float),
    ("step_host_ms", re.compile(r"step host work ([0-9.]+) ms"), float),
    ("staged_by_dma", re.compile(r"prefills staged by DMA (\d+)"), int),
    ("staged_by_kernel", re.compile(r"by kernel (\d+)"), int),
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
    """Maxima over the plugin's `HiSparse:` lines of a log segment; None if there are none.

    all_resident: every line that counts a running request counts none offloaded (None when no line
    counts a request): no request of the segment decoded from a GPU buffer."""
    rows = parse_hisparse_lines(text)
    if not rows:
        return None

    def top(key: str, fn=max):
        vals = [r[key] for r in rows if key in r]
        return fn(vals) if vals else None

    busy = [r for r in rows if r.get("resident", 0) + r.get("offloaded", 0) > 0]
    return {"lines": len(rows), "switch_work_max_ms": top("switch_work_max_ms"),
            "demotions_per_min_max": top("demotions_per_min"), "promotions_per_min_max": top("promotions_per_min"),
            "offloaded_max": top("offloaded"), "resident_max": top("resident"),
            "hit_rate_pct_min": top("hit_rate_pct", min),
            "step_host_ms_median": top("step_host_ms", statistics.median),
            "device_rows_used_max": top("device_rows_used"), "host_rows_used_max": top("host_rows_used"),
            # totals since the server started: the last line's are the largest
            "staged_by_dma": top("staged_by_dma"), "staged_by_kernel": top("staged_by_kernel"),
            "all_resident": all(r.get("offloaded", 0) == 0 for r in busy) if busy else None}


def fingerprints_by_model(fingerprints: list[str]) -> dict[str, set[str]]:
    """The fixture's fingerprints ("<model class>:<sum>/<sum of squares>") by model class: a server with a draft
    model (MTP) logs two, one per class.  A fingerprint without a class (older fixture) counts under ""."""
    out: dict[str, set[str]] = {}
    for fp in fingerprints:
        model, _, value = fp.rpartition(":")
        out.setdefault(model, set()).add(value)
    return out


def same_weights(fx: list[str] | None, fy: list[str] | None) -> bool | None:
    """Whether two arms served the same weights: every model class both loaded has one and the same fingerprint
    (an MTP arm's draft is not compared with an arm without one); None when either logged none."""
    if not fx or not fy:
        return None
    bx, by = fingerprints_by_model(fx), fingerprints_by_model(fy)
    common = bx.keys() & by.keys()
    return bool(common) and all(len(bx[m]) == 1 and bx[m] == by[m] for m in common)


def summarize_log(text: str) -> dict:
    """Everything the harness reads from a (segment of a) server log."""
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
        "pd_register": parse_pd_register(text),
        "kv_check": parse_kv_check(text),
        "input_too_long": sorted(set(INPUT_TOO_LONG_RE.findall(text)))[:3],
    }


def parse_pd_register(text: str) -> dict | None:
    """The last `pd-register` record of the fixture in a log (None if there is none)."""
    found = None
    for m in PD_REGISTER_RE.finditer(text):
        with contextlib.suppress(ValueError):
            found = json.loads(m.group("json"))
    return found


def parse_kv_check(text: str) -> dict | None:
    """The last `kv-check` totals of the fixture in a log (None if the check was off)."""
    found = None
    for m in KV_CHECK_RE.finditer(text):
        with contextlib.suppress(ValueError):
            found = json.loads(m.group("json"))
    return found


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


# servers.Server.start writes this line before every start of a server: a state directory's logs append, so a
# log may hold several server lives, of which only the last is the running or just-stopped server's.
START_MARK = "===== run_e2e.py arm "


def log_since_start(path: Path) -> str:
    """The log of the server's last life: from the last start mark on (all of it when it has none)."""
    text = read_from(path, 0)
    start = text.rfind(START_MARK)
    return text[start:] if start >= 0 else text


def file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
