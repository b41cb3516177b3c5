"""A fake `sglang` (and `mooncake`) package for selftest.py: the mock server (mock_launch_server.py as
sglang/launch_server.py) and the few modules it and the fixture import, written to a site folder that the
harness gets as --site.  Nothing here runs on the GPU machine."""

from __future__ import annotations

import shutil
from pathlib import Path

HERE = Path(__file__).resolve().parent

HOOK_REGISTRY = '''
import enum
class HookType(enum.Enum):
    BEFORE = "before"; AFTER = "after"; AROUND = "around"; REPLACE = "replace"
class HookRegistry:
    hooks = []
    @classmethod
    def register(cls, target, hook, hook_type=HookType.AFTER, *, source=None):
        cls.hooks.append((target, hook, hook_type))
'''

WEIGHT_UTILS = '''
def initialize_dummy_weights(model, low=-1e-3, high=1e-3, seed=1234):
    import torch
    for p in model.state_dict().values():
        if torch.is_floating_point(p):
            g = torch.Generator(device=p.device); g.manual_seed(seed); p.uniform_(low, high, generator=g)
'''

# SGLang's Mooncake KV manager, reduced to what the fixture's registration trace reads
MOONCAKE_CONN = '''
class KVArgs:
    def __init__(self, kv_ptrs, kv_lens, kv_item_lens, aux_ptrs, aux_lens):
        self.kv_data_ptrs, self.kv_data_lens, self.kv_item_lens = kv_ptrs, kv_lens, kv_item_lens
        self.aux_data_ptrs, self.aux_data_lens = aux_ptrs, aux_lens
        self.state_data_ptrs, self.state_data_lens = [], []
class MooncakeKVManager:
    def __init__(self, kv_args, mode):
        self.kv_args, self.disaggregation_mode = kv_args, mode
    def register_buffer_to_engine(self):
        pass
'''

# Mooncake's TransferEngine within one process (what mooncake_check.py uses): writes are memmoves
# into the target engine's registered memory
MOONCAKE_ENGINE = '''
import ctypes, itertools, os
if os.environ.get("MOCK_MOONCAKE_BROKEN") == "1":
    raise ImportError("libibverbs.so.1: cannot open shared object file (mock)")
_ports, _engines = itertools.count(16000), {}
class TransferEngine:
    def initialize(self, hostname, metadata, protocol, device):
        self.port, self.regions = next(_ports), []
        _engines[self.port] = self
        return 0
    def get_rpc_port(self):
        return self.port
    def register_memory(self, addr, length, location="*"):
        self.regions.append((addr, length))
        return 0
    def transfer_sync_write(self, session, src, dst, length):
        peer = _engines.get(int(session.rsplit(":", 1)[1]))
        if peer is None or not any(a <= dst and dst + length <= a + n for a, n in peer.regions):
            return -1
        ctypes.memmove(dst, src, length)
        return 0
'''

# `python -m sglang.bench_serving` where the real one is not importable: the flags the harness passes, the
# same HTTP exchange (/v1/models, one warm-up, streamed /generate with text in, `text` and
# completion_tokens out, at most --max-concurrency in flight, /server_info) and a JSON line with the
# result keys the harness reads. Stdlib only; the figures are the mock's, not SGLang's client's.
FAKE_BENCH_SERVING = '''
import argparse, concurrent.futures as cf, json, statistics, sys, time, urllib.request
ap = argparse.ArgumentParser()
for flag in ("--backend", "--host", "--model", "--tokenizer", "--dataset-name", "--dataset-path", "--output-file"):
    ap.add_argument(flag)
for flag in ("--port", "--random-input-len", "--random-output-len", "--num-prompts", "--max-concurrency", "--seed",
             "--ready-check-timeout-sec"):
    ap.add_argument(flag, type=int)
ap.add_argument("--random-range-ratio", type=float); ap.add_argument("--request-rate", default="inf")
ap.add_argument("--disable-tqdm", action="store_true"); ap.add_argument("--output-details", action="store_true")
a = ap.parse_args()
base = f"http://{a.host}:{a.port}"
t_end = time.time() + a.ready_check_timeout_sec
while True:
    try:
        urllib.request.urlopen(base + "/v1/models", timeout=5).read(); break
    except Exception:
        if time.time() > t_end:
            print("Server is not ready. Exiting."); sys.exit(1)
        time.sleep(0.5)
prompt = " ".join(["tralo"] * (a.random_input_len - 1))
def one(n_out):
    body = json.dumps({"text": prompt, "sampling_params": {"temperature": 0.0, "max_new_tokens": n_out, "ignore_eos": True},
                       "stream": True}).encode()
    t0 = time.perf_counter(); ttft = None; n = 0
    req = urllib.request.Request(base + "/generate", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.strip()
            if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("text"):
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                n = chunk["meta_info"]["completion_tokens"]
    return ttft, time.perf_counter() - t0, n
one(min(32, a.random_output_len))
start = time.perf_counter()
with cf.ThreadPoolExecutor(max_workers=a.max_concurrency) as pool:
    outs = list(pool.map(one, [a.random_output_len] * a.num_prompts))
duration = time.perf_counter() - start
ok = [o for o in outs if o[0] is not None and o[2] > 0]
tpots = [(lat - ttft) / (n - 1) for ttft, lat, n in ok if n > 1]
ms = lambda xs, q=0.5: 1000 * statistics.quantiles(xs, n=100)[int(100 * q) - 1] if len(xs) > 1 else (1000 * xs[0] if xs else 0.0)
result = {"backend": a.backend, "dataset_name": a.dataset_name, "max_concurrency": a.max_concurrency,
          "random_input_len": a.random_input_len, "random_output_len": a.random_output_len,
          "random_range_ratio": a.random_range_ratio, "fake_bench_serving": True, "duration": duration,
          "completed": len(ok), "total_input_tokens": len(ok) * a.random_input_len,
          "total_output_tokens": sum(o[2] for o in ok), "request_throughput": len(ok) / duration,
          "output_throughput": sum(o[2] for o in ok) / duration,
          "median_ttft_ms": 1000 * statistics.median([o[0] for o in ok]) if ok else 0.0,
          "median_tpot_ms": 1000 * statistics.median(tpots) if tpots else 0.0, "p99_tpot_ms": ms(tpots, 0.99),
          "median_e2e_latency_ms": 1000 * statistics.median([o[1] for o in ok]) if ok else 0.0,
          "server_info": json.loads(urllib.request.urlopen(base + "/server_info", timeout=5).read())}
with open(a.output_file, "a") as f:
    f.write(json.dumps(result) + "\\n")
print(f"fake bench_serving: {len(ok)} of {a.num_prompts} completed in {duration:.2f} s")
'''

MOCK_PLUGIN = '''
import sys
def register():
    print("[mockplug] registered", file=sys.stderr, flush=True)
'''

PACKAGES = ("sglang", "sglang/srt", "sglang/srt/plugins", "sglang/srt/model_loader", "sglang/srt/disaggregation",
            "sglang/srt/disaggregation/mooncake", "mooncake")


def make_mock_site(root: Path) -> Path:
    site = root / "mock_site"
    for d in PACKAGES:
        (site / d).mkdir(parents=True, exist_ok=True)
        (site / d / "__init__.py").write_text("")
    (site / "sglang/srt/plugins/hook_registry.py").write_text(HOOK_REGISTRY)
    (site / "sglang/srt/model_loader/weight_utils.py").write_text(WEIGHT_UTILS)
    (site / "sglang/srt/disaggregation/mooncake/conn.py").write_text(MOONCAKE_CONN)
    shutil.copy2(HERE / "mock_launch_server.py", site / "sglang/launch_server.py")
    (site / "sglang/bench_serving.py").write_text(FAKE_BENCH_SERVING)
    (site / "mooncake/engine.py").write_text(MOONCAKE_ENGINE)
    dist = site / "mooncake_transfer_engine_cuda13-0.3.14.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: mooncake-transfer-engine-cuda13\nVersion: 0.3.14\n")
    (site / "mockplug.py").write_text(MOCK_PLUGIN)
    return site


def leftover_children(marker: str | None = None) -> list[int]:
    """Mock "schedulers" still alive; with `marker`, only those whose environment contains it (the temp dir of
    the run that started them: other sessions on the same machine may run mock servers too)."""
    pids = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if b"mock-scheduler-child" in (p / "cmdline").read_bytes() and (
                        marker is None or marker.encode() in (p / "environ").read_bytes()):
                    pids.append(int(p.name))
            except OSError:
                pass
    return pids
