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
