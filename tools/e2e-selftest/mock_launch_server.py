"""Mock of `python -m sglang.launch_server` for selftest.py (stdlib + optional torch).

selftest.py copies this file into a fake `sglang` package (mock_sglang.make_mock_site) as
sglang/launch_server.py; it is never imported by the harness.  It speaks the subset of SGLang 0.5.17's
HTTP API the harness uses, prints SGLang-style log lines, runs `sglang.srt.plugins` entry points and
the hooks they register on the targets it knows, and spawns a child in its process group.

PD (--disaggregation-mode prefill|decode): every /generate must carry bootstrap_host 127.0.0.1,
bootstrap_port (the prefill's --disaggregation-bootstrap-port) and an integer bootstrap_room.  The
prefill records the room with a hash of the input ids and serves it on its bootstrap port
(GET /room/<room>); the decode waits until the prefill has "sent" that room, refuses other input ids,
and rejects a prompt longer than its GPU pool (its logical pool with MOCK_PD_LOGICAL=1, like the
plugin), as SGLang's validate_input_length does.  Both log `PD <role> room <room>` per request.

For the chaos and hostpool phases (benchmarks/e2e/chaos.py, hostpool.py):
* requests longer than --context-length, or asking for more, are refused with SGLang's 400 messages;
* /abort_request aborts the rids it names (prefix match, as SGLang) or all; aborted requests end with
  finish_reason abort "Aborted"; a client that disconnects has its request dropped;
* MOCK_ACCOUNTING=1: the `HiSparse:` line (the plugin's format) counts the running requests' host and
  device rows, quarantined rows and leaks; /v1/loads gives num_used_tokens; with --enable-metrics
  /metrics serves the plugin's sglang:hisparse_* series (names from hisparse_sglang's METRICS);
* a PD decode whose prefill stops answering fails the waiting requests after MOCK_HEARTBEAT_S with
  "Lost connection with prefill instance", one whose KV never comes after SGLANG_DISAGGREGATION_WAITING_TIMEOUT
  (streamed: finish_reason abort, status 500), and holds their rows for MOCK_QUARANTINE_S, as the plugin's
  quarantine does;
* mutations: MOCK_LEAK_ON_ABORT=1 (an aborted request's host rows are never freed), MOCK_LEAK_ON_DISCONNECT=1
  (a disconnected request stays running forever), MOCK_IGNORE_SIGTERM=1, MOCK_TEARDOWN_S (SIGTERM exits
  that much later);
* with --enable-hisparse and MOCK_HISPARSE_LOG=1 the host pool lines of the plugin are logged; with
  MOCK_HOST_POOL_TOUCH=1 the pool's bytes are really mapped and touched (so its memory shows in
  /proc/meminfo); MOCK_SKIP_TORCH=1 skips the weight-init fixture's torch model (faster start).
The child (the "scheduler") dies with the server (PR_SET_PDEATHSIG, as SGLang's scheduler).
Without --skip-tokenizer-init it takes `text` prompts (encoded with the model's tokenizer.json where the
`tokenizers` package imports, else one token per word) and streams `text` beside `output_ids`, as
`python -m sglang.bench_serving` needs; /v1/models and /model_info answer.  With --enable-metrics,
/metrics serves SGLang-style samples and, where the plugin's source is importable (arms c and d) and the
plugin's line is logged (MOCK_HISPARSE_LOG=1), the plugin's `sglang:hisparse_*` metrics, named by
hisparse_sglang/integration/sglang/metrics.py and written with each `HiSparse:` line (the line first).
MOCK_METRICS_SKEW=key[,key] (report keys, e.g. resident, bytes_moved) makes /metrics disagree with the
line: the mutation the harness's /metrics check must catch.
"""
import argparse
import ctypes
import functools
import hashlib
import importlib.metadata as md
import json
import mmap
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ThreadingHTTPServer.request_queue_size = 256  # dozens of requests arrive at once (socketserver's default is 5)

ap = argparse.ArgumentParser()
ap.add_argument("--port", type=int); ap.add_argument("--max-total-tokens", type=int, default=4096)
ap.add_argument("--enable-hisparse", action="store_true"); ap.add_argument("--hisparse-config", default="{}")
ap.add_argument("--model-path")
ap.add_argument("--disaggregation-mode", default="null"); ap.add_argument("--disaggregation-bootstrap-port", type=int)
ap.add_argument("--context-length", type=int, default=65536); ap.add_argument("--skip-tokenizer-init", action="store_true")
ap.add_argument("--enable-metrics", action="store_true")
args, rest = ap.parse_known_args()
if os.environ.get("MOCK_IGNORE_SIGTERM") == "1":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
elif os.environ.get("MOCK_TEARDOWN_S"):
    def _slow_exit(*_):
        time.sleep(float(os.environ["MOCK_TEARDOWN_S"])); os._exit(0)
    signal.signal(signal.SIGTERM, _slow_exit)
PD = args.disaggregation_mode
def log(msg): print(f"[2026-01-01 00:00:00] {msg}", flush=True)
log(f"mock server argv: {sys.argv[1:]}")
# like sglang.srt.plugins.load_plugins()
for ep in md.entry_points(group="sglang.srt.plugins"):
    try:
        fn = ep.load()
    except Exception as e:
        log(f"Failed to load plugin {ep.name} from group sglang.srt.plugins ({type(e).__name__}: {e})"); continue
    try:
        fn()
    except Exception as e:
        log(f"Failed to execute general plugin: {ep.name} ({e})")
# like the dummy loader: initialise a toy model through the (possibly hooked) init
import sglang.srt.model_loader.weight_utils as wu  # noqa: E402 (after the plugins load)
from sglang.srt.plugins.hook_registry import HookRegistry  # noqa: E402

init = wu.initialize_dummy_weights
for target, hook, _ in HookRegistry.hooks:
    if target.endswith("initialize_dummy_weights"):
        init = functools.partial(hook, init)
try:
    if os.environ.get("MOCK_SKIP_TORCH") == "1":
        raise ImportError("MOCK_SKIP_TORCH")
    import torch
    class Toy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = torch.nn.Embedding(64, 16); self.input_layernorm = torch.nn.LayerNorm(16)
            self.o_proj = torch.nn.Linear(16, 16, bias=False); self.lm_head = torch.nn.Linear(16, 64, bias=False)
    init(Toy())
except ImportError:
    print("[hisparse-e2e-fixture] pid=0 weights mode=mock-no-torch params=0 elements=0 fingerprint=0/0", file=sys.stderr, flush=True)
if os.environ.get("SGLANG_DSA_PREFILL_DENSE_ATTN_KV_LEN_THRESHOLD"):
    log(f"Dense attention kv len threshold is manually set to {os.environ['SGLANG_DSA_PREFILL_DENSE_ATTN_KV_LEN_THRESHOLD']} for DSA.")
ratio = json.loads(args.hisparse_config or "{}").get("host_to_device_ratio", 2) if args.enable_hisparse else 1
capacity_tokens = args.max_total_tokens * ratio
# the longest prompt a PD decode instance admits: its GPU pool, or its logical pool (the plugin's hooks)
input_limit = (capacity_tokens if os.environ.get("MOCK_PD_LOGICAL") == "1" else args.max_total_tokens) - 5
PD_TARGET = "sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager.register_buffer_to_engine"
if PD != "null":
    # like SGLang's KV manager: register the KV regions (one per layer) through the hooked method
    import sglang.srt.disaggregation.mooncake.conn as conn
    for target, hook, _ in HookRegistry.hooks:
        if target == PD_TARGET:
            conn.MooncakeKVManager.register_buffer_to_engine = functools.partialmethod(
                lambda self, _orig, _hook: _hook(_orig, self), conn.MooncakeKVManager.register_buffer_to_engine, hook)
    rows = capacity_tokens if PD == "decode" else args.max_total_tokens
    keep = [ctypes.create_string_buffer(64) for _ in range(5)]
    conn.MooncakeKVManager(conn.KVArgs([ctypes.addressof(b) for b in keep[:4]], [rows * 1152] * 4, [1152 * 64] * 4,
                                       [ctypes.addressof(keep[4])], [64]), PD).register_buffer_to_engine()
rooms, rooms_lock = {}, threading.Lock()

def ids_hash(ids):
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]

def bootstrap_error(body):
    room = body.get("bootstrap_room")
    if body.get("bootstrap_host") != "127.0.0.1" or not isinstance(body.get("bootstrap_port"), int):
        return f"PD request without bootstrap_host/bootstrap_port: {body.get('bootstrap_host')!r} {body.get('bootstrap_port')!r}"
    if PD == "prefill" and body["bootstrap_port"] != args.disaggregation_bootstrap_port:
        return f"bootstrap_port {body['bootstrap_port']} is not this prefill's {args.disaggregation_bootstrap_port}"
    if not isinstance(room, int) or not 0 <= room < 2**63:
        return f"bootstrap_room must be an integer in [0, 2**63): {room!r}"
    return None

def wait_for_kv(body, ids):
    """Decode: until the prefill (asked on the request's bootstrap port) has this room; None or the error."""
    url = f"http://{body['bootstrap_host']}:{body['bootstrap_port']}/room/{body['bootstrap_room']}"
    t_end = time.time() + KV_TIMEOUT_S
    unreachable_since = None
    while time.time() < t_end:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                info = json.loads(r.read())
            unreachable_since = None
        except (urllib.error.URLError, ConnectionError, OSError):
            info = {}
            unreachable_since = unreachable_since or time.time()
            if time.time() - unreachable_since >= HEARTBEAT_S:  # SGLang's heartbeat gives the prefill up
                return f"Lost connection with prefill instance (bootstrap_addr: {body['bootstrap_host']}:{body['bootstrap_port']})"
        except Exception:
            info = {}
        if info.get("done"):
            return None if info["hash"] == ids_hash(ids) else f"bootstrap_room {body['bootstrap_room']} carries other input_ids"
        time.sleep(0.02)
    return f"Request {body.get('rid')} timed out after {KV_TIMEOUT_S:g}s in KVPoll.WaitingForInput"

class Bootstrap(BaseHTTPRequestHandler):
    def log_message(self, *a): pass
    def do_GET(self):
        with rooms_lock:
            info = rooms.get(int(self.path.rsplit("/", 1)[1]), {})
        b = json.dumps(info).encode(); self.send_response(200)
        self.send_header("Content-Length", str(len(b))); self.end_headers(); self.wfile.write(b)
if PD == "prefill":
    boot = ThreadingHTTPServer(("127.0.0.1", args.disaggregation_bootstrap_port), Bootstrap)
    threading.Thread(target=boot.serve_forever, daemon=True).start()
log(f"max_total_num_tokens={args.max_total_tokens}, chunked_prefill_size=8192, hisparse={args.enable_hisparse}")
HS_LOG = os.environ.get("MOCK_HISPARSE_LOG") == "1"  # the plugin's periodic HiSparse line
if args.enable_hisparse and HS_LOG:
    # the plugin's host pool lines (memory/host_pool.py); MOCK_HOST_POOL_TOUCH=1 maps and touches its bytes
    try:
        with open(os.path.join(args.model_path or "", "config.json")) as f:
            layers = int(json.load(f).get("num_hidden_layers", 4))
    except (OSError, ValueError):
        layers = 4
    pool_rows = (args.max_total_tokens * ratio // 64 + 1) * 64
    pool_bytes = layers * pool_rows * 1152
    log(f"HiSparse host pool: {layers} layers x {pool_rows} rows x 1152 B = {pool_bytes / 2**30:.2f} GiB (pinned)")
    if os.environ.get("MOCK_HOST_POOL_TOUCH") == "1":
        t_touch = time.perf_counter()
        host_pool = mmap.mmap(-1, pool_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # as memory/pinning.py maps it
        for off in range(0, pool_bytes, mmap.PAGESIZE):
            host_pool[off] = 1
        ready = time.perf_counter() - t_touch
        log(f"HiSparse host pool: {pool_bytes / 2**30:.2f} GiB ready in {ready:.1f} s ({pool_bytes / 2**30 / max(ready, 1e-9):.1f} GiB/s; "
            f"touched in {ready:.1f} s, pinned in 0.0 s, 1 threads)")
# a child in the same process group, like the scheduler / detokenizer; it dies with this process
child = subprocess.Popen([sys.executable, "-c", "import ctypes, signal, time; ctypes.CDLL(None).prctl(1, signal.SIGKILL); "
                          "time.sleep(3600)", "mock-scheduler-child"])
FLIP = int(os.environ.get("MOCK_FLIP_AT", "-1"))
# prefill holds the "GPU" for this long per input token; decoding waits for it (a storm stalls decoders)
PREFILL_S = float(os.environ.get("MOCK_PREFILL_S_PER_TOKEN", "0"))
prefill_lock = threading.Lock()
TOKENIZER = None
if not args.skip_tokenizer_init:
    try:
        from tokenizers import Tokenizer
        TOKENIZER = Tokenizer.from_file(os.path.join(args.model_path or ".", "tokenizer.json"))
    except Exception as e:
        log(f"mock: no tokenizers package or tokenizer.json ({type(e).__name__}); one token per word")

def encode(text):
    """What the server's tokenizer makes of a text prompt (with <bos>)."""
    return TOKENIZER.encode(text).ids if TOKENIZER else [0] + [2 + len(w) for w in text.split()]

def plugin_metric_specs():
    """(name, kind, report key, cumulative) of the plugin's metrics, from its source if importable."""
    import importlib.util as iu
    spec = iu.find_spec("hisparse_sglang")
    if spec is None or not spec.submodule_search_locations:
        return []
    path = os.path.join(list(spec.submodule_search_locations)[0], "integration", "sglang", "metrics.py")
    mspec = iu.spec_from_file_location("mock_hisparse_metrics", path)
    module = sys.modules["mock_hisparse_metrics"] = iu.module_from_spec(mspec)  # dataclasses look it up
    mspec.loader.exec_module(module)
    return [(m.name, m.kind, m.key, m.cumulative) for m in module.METRICS]
# the plugin's metrics: only where it "runs" (its line is logged) and SGLang exports metrics
PLUGIN_METRICS = plugin_metric_specs() if args.enable_metrics and os.environ.get("MOCK_HISPARSE_LOG") == "1" else []
LABELS = f'engine_type="unified",model_name="{args.model_path}",moe_ep_rank="0",pp_rank="0",tp_rank="0"'
SKEW = [k for k in os.environ.get("MOCK_METRICS_SKEW", "").split(",") if k]
exported, metrics_lock = {}, threading.Lock()  # the plugin's samples by name; the lock makes line + samples one step

def export(values):
    """Like the plugin's exporter: gauges set, counters increased by the report's delta (running totals by their change)."""
    for name, kind, key, cumulative in PLUGIN_METRICS:
        if kind == "gauge":
            exported[name] = values[key]
        elif cumulative:
            exported[name] = values[key]
        else:
            exported[name] = exported.get(name, 0) + values[key]

def metrics_text():
    lines = ["# HELP sglang:num_running_reqs The number of running requests.", "# TYPE sglang:num_running_reqs gauge",
             f"sglang:num_running_reqs{{{LABELS}}} {float(state['running'])}"]
    with metrics_lock:
        for name, kind, key, _ in PLUGIN_METRICS:
            if name not in exported:
                continue
            value = exported[name]
            if value is not None and key in SKEW:
                value += 2**20 if key == "bytes_moved" else 1
            lines += [f"# TYPE {name} {kind}", f"{name}{{{LABELS}}} {'NaN' if value is None else float(value)}"]
    return "\n".join(lines) + "\n"
totals = {"demotions_total": 0}
RESIDENT_UP_TO = int(os.environ.get("MOCK_RESIDENT_UP_TO", "0"))  # that many running requests stay resident
ACCOUNTING = os.environ.get("MOCK_ACCOUNTING") == "1"
LEAK_ON_ABORT = os.environ.get("MOCK_LEAK_ON_ABORT") == "1"
LEAK_ON_DISCONNECT = os.environ.get("MOCK_LEAK_ON_DISCONNECT") == "1"
QUARANTINE_S = float(os.environ.get("MOCK_QUARANTINE_S", "2"))
HEARTBEAT_S = float(os.environ.get("MOCK_HEARTBEAT_S", "0.5"))
# SGLang's waiting timeout (the harness sets it from --pd-timeout-s): a transfer that never comes fails then
KV_TIMEOUT_S = float(os.environ.get("SGLANG_DISAGGREGATION_WAITING_TIMEOUT", "10"))
lock = threading.Condition()
state = {"used": 0, "running": 0, "waiting": 0, "abort": 0, "tokens": 0}
# MOCK_ACCOUNTING: per running request [prompt tokens, tokens decoded, aborted-by-rid flag], keyed by an id
live, phantoms, prealloc = {}, [], {}
acct = {"leaked_rows": 0, "quarantine": []}  # quarantine: [(expiry, rows)]
ready_at = time.time() + 1.0

def page_up(n):
    return -(-n // 64) * 64

def accounting_values(r):
    """The plugin's report() figures for the running requests (called with `lock` held)."""
    now = time.time()
    acct["quarantine"] = [(t, n) for t, n in acct["quarantine"] if t > now]
    if not ACCOUNTING:
        res_n, off_n = (r, 0) if r <= RESIDENT_UP_TO else (0, r)
        return {"resident": res_n, "offloaded": off_n, "device_rows_used": 100, "device_rows_total": 4096,
                "host_rows_used": 200, "host_rows_total": 32768, "host_rows_quarantined": 0}
    reqs = [(v[0], v[1]) for v in live.values()] + phantoms
    resident = len(reqs) <= RESIDENT_UP_TO
    quarantined = sum(n for _, n in acct["quarantine"])
    return {"resident": len(reqs) if resident else 0, "offloaded": 0 if resident else len(reqs),
            "device_rows_used": sum(page_up(p + d) for p, d in reqs) if resident else 4160 * len(reqs),
            "device_rows_total": args.max_total_tokens,
            "host_rows_used": sum(page_up(p + d) for p, d in reqs) + sum(prealloc.values()) + acct["leaked_rows"] + quarantined,
            "host_rows_total": capacity_tokens, "host_rows_quarantined": quarantined}

def out_ids(ids, n):
    rng = random.Random(sum(ids[-64:]) * 7 + len(ids) + sum(ids) % 1000)
    o = [rng.randrange(2, 32768) for _ in range(n)]
    if 0 <= FLIP < n:
        o[FLIP] = (o[FLIP] + 1) % 32768
    return o

def hisparse_line(r):
    """The plugin's periodic line for a step with r running requests (r == 0: the step the last one left,
    which the plugin logs too), then its export, as the plugin does."""
    with lock:
        v = accounting_values(r)
        off_n = v["offloaded"]
        totals["demotions_total"] += off_n
        hit, moved = (0.975, 1.5) if r else (None, 0.0)
        v.update(hit_rate=hit, bytes_moved=moved * 2**20, promoting=0, demotions_per_min=6.0 * r,
                 promotions_per_min=0.0, switch_ms_max=0.25 if r else 0.0, step_host_ms=0.11, step_host_ms_max=0.2,
                 lookups=1000 * off_n, misses=25 * off_n, demotions_total=totals["demotions_total"],
                 promotions_total=0, verify_rows_capped_total=0, verify_drafts_dropped_total=0)
    with metrics_lock:  # the plugin logs its line, then exports
        log(f"HiSparse: hit rate {'n/a' if hit is None else f'{100 * hit:.1f}%'}, moved {moved:.1f} MiB, "
            f"resident {v['resident']}, offloaded {v['offloaded']} (promoting 0), "
            f"demotions {6.0 * r:.1f}/min, promotions 0.0/min, device rows {v['device_rows_used']}/{v['device_rows_total']}, "
            f"host rows {v['host_rows_used']}/{v['host_rows_total']} (quarantined {v['host_rows_quarantined']}), "
            f"switch work max {v['switch_ms_max']:.2f} ms/step, step host work 0.110 ms (max 0.20)")
        export(v)

def reporter():
    was_running = False
    while True:
        time.sleep(0.2)
        with lock:
            r, w, t = state["running"], state["waiting"], state["tokens"]; state["tokens"] = 0
        if not r and was_running and HS_LOG and ACCOUNTING:  # the line of the step the last request left
            hisparse_line(0)
        was_running = bool(r)
        if r:
            use = ("#gpu token: 100, gpu token usage: 0.10, #cpu token: 200, cpu token usage: 0.20" if args.enable_hisparse
                   else f"#token: {r * 100}, token usage: {min(1.0, r * 0.1):.2f}")
            log(f"Decode batch, #running-req: {r}, {use}, cuda graph: True, gen throughput (token/s): {t / 0.2:.2f}, #queue-req: {w}, ")
            if HS_LOG:
                hisparse_line(r)
threading.Thread(target=reporter, daemon=True).start()

class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"
    def log_message(self, *a): pass
    def _json(self, code, obj):
        b = json.dumps(obj).encode(); self.send_response(code)
        self.send_header("Content-Type", "application/json"); self.send_header("Content-Length", str(len(b)))
        self.end_headers(); self.wfile.write(b)
    def prefill_only(self, body, ids):
        """A PD prefill: 'computes' the prompt, 'sends' its KV (the room becomes visible), answers the first token."""
        with rooms_lock:
            rooms[body["bootstrap_room"]] = {"hash": ids_hash(ids), "done": False}
        log(f"Prefill batch, #new-seq: 1, #new-token: {len(ids)}, #cached-token: 0, token usage: 0.10, "
            f"#running-req: 0, #queue-req: 0, #pending-token: 0, ")
        if PREFILL_S:
            with prefill_lock:
                time.sleep(len(ids) * PREFILL_S)
        with rooms_lock:
            rooms[body["bootstrap_room"]]["done"] = True
        out = {"output_ids": out_ids(ids, 1), "meta_info": {"id": body.get("rid"), "finish_reason": {"type": "length", "length": 1},
                                                            "prompt_tokens": len(ids), "completion_tokens": 1}}
        if not body.get("stream"):
            return self._json(200, out)
        self.send_response(200); self.send_header("Content-Type", "text/event-stream"); self.end_headers()
        self.wfile.write(b"data: " + json.dumps(out).encode() + b"\n\ndata: [DONE]\n\n")
    def do_GET(self):
        if self.path == "/health":
            return self._json(200 if time.time() > ready_at else 503, {})
        if self.path.startswith("/v1/loads"):
            with lock:
                return self._json(200, {"loads": [{"num_running_reqs": state["running"], "num_waiting_reqs": state["waiting"],
                                                   "num_used_tokens": state["used"],
                                                   "token_usage": round(state["used"] / capacity_tokens, 4),
                                                   "max_total_num_tokens": args.max_total_tokens}]})
        if self.path == "/v1/models":
            return self._json(200, {"object": "list", "data": [{"id": args.model_path, "object": "model"}]})
        if self.path == "/model_info":
            return self._json(200, {"model_path": args.model_path, "tokenizer_path": args.model_path})
        if self.path == "/metrics" and args.enable_metrics:
            b = metrics_text().encode(); self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4"); self.send_header("Content-Length", str(len(b)))
            self.end_headers(); return self.wfile.write(b)
        if self.path == "/server_info":
            return self._json(200, {"max_total_num_tokens": args.max_total_tokens, "version": "mock", "disaggregation_mode": PD})
        self._json(404, {})
    def stream_abort(self, message, status_code):
        """A request SGLang ends before it decodes (PD transfer failure): a streamed abort, or HTTP status_code."""
        if not self.body.get("stream"):
            return self._json(status_code, {"detail": message})
        self.send_response(200); self.send_header("Content-Type", "text/event-stream"); self.end_headers()
        fin = {"type": "abort", "message": message, "status_code": status_code}
        self.wfile.write(b"data: " + json.dumps({"output_ids": [], "meta_info": {"id": self.body.get("rid"), "finish_reason": fin,
                                                 "completion_tokens": 0}}).encode() + b"\n\ndata: [DONE]\n\n")
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        self.body = body
        if self.path == "/abort_request":
            with lock:
                if body.get("abort_all"):
                    state["abort"] += 1
                elif body.get("rid"):
                    for entry in live.values():
                        if entry[3] and str(entry[3]).startswith(body["rid"]):
                            entry[2] = True
                lock.notify_all()
            return self._json(200, {})
        if self.path != "/generate":
            return self._json(404, {})
        if "input_ids" not in body and args.skip_tokenizer_init:
            return self._json(400, {"error": {"message": "text input needs the tokenizer (started with --skip-tokenizer-init)"}})
        ids, sp = body.get("input_ids") or encode(body["text"]), body["sampling_params"]
        text_of = (lambda k: " t" * k) if not args.skip_tokenizer_init else None  # the detokenized output
        n = sp["max_new_tokens"]; need = len(ids) + n
        # SGLang's tokenizer manager: the context length first
        if len(ids) >= args.context_length:
            return self._json(400, {"error": {"message": f"The input ({len(ids)} tokens) is longer than the model's context "
                                                         f"length ({args.context_length} tokens)."}})
        if len(ids) + n > args.context_length:
            return self._json(400, {"error": {"message": f"Requested token count exceeds the model's maximum context length of "
                                                         f"{args.context_length} tokens. You requested a total of {len(ids) + n} tokens: "
                                                         f"{len(ids)} tokens from the input messages and {n} tokens for the completion."}})
        if PD != "null":
            key = object()
            if PD == "decode":
                with lock:
                    state["waiting"] += 1; prealloc[key] = page_up(len(ids))
            try:
                err = bootstrap_error(body) or (wait_for_kv(body, ids) if PD == "decode" else None)
            finally:
                if PD == "decode":
                    with lock:
                        state["waiting"] -= 1
                        rows = prealloc.pop(key)
                        if ACCOUNTING and err and ("Lost connection" in err or "KVPoll.WaitingForInput" in err):
                            acct["quarantine"].append((time.time() + QUARANTINE_S, rows))
            if err and ("Lost connection" in err or "KVPoll.WaitingForInput" in err):
                log(f"PD {PD} room {body.get('bootstrap_room')} rid {body.get('rid')} tokens {len(ids)} failed: {err}")
                return self.stream_abort(f"Decode transfer failed for request rank=0 req.rid='{body.get('rid')}' "
                                         f"req.bootstrap_room={body.get('bootstrap_room')} with exception KVTransferError: {err}", 500)
            if not err and PD == "decode" and len(ids) >= input_limit:
                err = (f"Input length ({len(ids)} tokens) exceeds the maximum allowed length ({input_limit} tokens). "
                       "Use a shorter input or enable --allow-auto-truncate.")
            log(f"PD {PD} room {body.get('bootstrap_room')} rid {body.get('rid')} tokens {len(ids)}" + (f" rejected: {err}" if err else ""))
            if err:
                return self._json(400, {"error": {"message": err}})
            if PD == "prefill":
                return self.prefill_only(body, ids)
        gen = state["abort"]
        with lock:
            state["waiting"] += 1
            while state["used"] + need > capacity_tokens and gen == state["abort"]:
                lock.wait(0.05)
            state["waiting"] -= 1
            aborted = gen != state["abort"]
            if not aborted:
                state["used"] += need
        admitted = not aborted
        key, entry = object(), [len(ids), 0, False, body.get("rid")]
        if admitted:
            with lock:
                log(f"Prefill batch, #new-seq: 1, #new-token: {len(ids)}, #cached-token: 0, token usage: 0.10, "
                    f"#running-req: {state['running']}, #queue-req: {state['waiting']}, #pending-token: 0, ")
                state["running"] += 1; live[key] = entry
            if PREFILL_S:
                with prefill_lock:
                    time.sleep(len(ids) * PREFILL_S)
        o = out_ids(ids, n)
        done = 0
        stream = body.get("stream")
        disconnected = False
        if stream:
            self.send_response(200); self.send_header("Content-Type", "text/event-stream"); self.end_headers()
        try:
            while admitted and done < n:
                time.sleep(0.002)
                if PREFILL_S:
                    with prefill_lock:
                        pass
                with lock:
                    if gen != state["abort"] or entry[2]:
                        aborted = True; break
                    state["tokens"] += 1
                done += 1; entry[1] = done
                if stream:
                    # the new token only (the harness counts completion_tokens), so that dozens of streams stay cheap
                    chunk = {"output_ids": o[done - 1:done], "meta_info": {"completion_tokens": done,
                             "finish_reason": {"type": "length"} if done == n else None}}
                    if text_of:
                        chunk["text"] = text_of(done)
                    self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        except (BrokenPipeError, ConnectionResetError):
            disconnected = True
            raise
        finally:
            if admitted:
                with lock:
                    live.pop(key, None)
                    if disconnected and LEAK_ON_DISCONNECT:  # mutation: the request stays running for ever
                        phantoms.append((len(ids), done))
                    else:
                        state["running"] -= 1; state["used"] -= need
                    if aborted and LEAK_ON_ABORT:  # mutation: its host rows are never freed
                        acct["leaked_rows"] += page_up(len(ids) + done)
                    lock.notify_all()
        fin = {"type": "abort", "message": "Aborted", "status_code": None} if aborted else {"type": "length", "length": n}
        meta = {"id": body.get("rid"), "finish_reason": fin, "prompt_tokens": len(ids), "completion_tokens": done}
        if body.get("return_logprob"):
            lps = [-1.0 - 0.001 * (t % 97) for t in o[:done]]
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(lps, o)]
            meta["output_top_logprobs"] = [[[lp, t, None], [lp - 0.5, (t + 1) % 32768, None]] for lp, t in zip(lps, o)]
        final = {"output_ids": o[:done], "meta_info": meta} | ({"text": text_of(done)} if text_of else {})
        if stream:
            self.wfile.write(b"data: " + json.dumps(final).encode() + b"\n\n")
            self.wfile.write(b"data: [DONE]\n\n")
        else:
            self._json(200, final)

ThreadingHTTPServer.daemon_threads = True
ThreadingHTTPServer(("127.0.0.1", args.port), H).serve_forever()
