"""HiSparse's per-step decode work never waits for the GPU (GPU only).

SGLang's overlap scheduler prepares step N+1 on the host while step N runs on the GPU; a host
wait in that preparation (a synchronize, ``.item()``, a pageable copy, a boolean mask) would
serialise the two. Every call HiSparse makes on a decode step (the allocator's ``alloc_decode``,
the coordinator's ``prepare_decode``, ``wait_for_pending_backup`` and each layer's ``swap_in``)
runs here under ``torch.cuda.set_sync_debug_mode("error")``, which raises on any synchronizing
CUDA call, for batches that are all resident, all offloaded, and mixed, across page starts,
demotions and promotions.
"""

import contextlib

import pytest
import torch

from hisparse_sglang.config import HiSparseConfig
from hisparse_sglang.coordinator import OFFLOADED, RESIDENT
from hisparse_sglang.testing.sim import SimulatedServer

pytestmark = pytest.mark.gpu

PAGE = 64
BATCH = 12
PROMPT = 1500


@contextlib.contextmanager
def no_sync_allowed():
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def guard(obj, name: str, calls: dict) -> None:
    original = getattr(obj, name)

    def guarded(*args, **kwargs):
        calls[name] = calls.get(name, 0) + 1
        with no_sync_allowed():
            return original(*args, **kwargs)

    setattr(obj, name, guarded)


def server_for(mode: str) -> SimulatedServer:
    from hisparse_sglang.ops.swap_in import CudaOps

    cuda_ops = CudaOps()

    config = HiSparseConfig(
        top_k=256, device_buffer_size=512, page_size=PAGE, host_to_device_ratio=4,
        resident_first=mode != "offloaded", switch_cooldown_steps=2, promote_free_fraction=0.0,
    )
    pages_per_request = -(-(PROMPT + 200) // PAGE)
    device_pages = BATCH * pages_per_request + 64 if mode != "mixed" else BATCH * pages_per_request // 2
    return SimulatedServer(
        config, layer_num=3, item_bytes=1152, device_pages=device_pages, max_reqs=BATCH + 1,
        max_context=PROMPT + 37 * BATCH + 256, ops=cuda_ops, device="cuda", seed=3, checked=False,
    )


@pytest.mark.parametrize("mode", ["resident", "offloaded", "mixed"])
def test_decode_steps_do_not_synchronize(mode):
    server = server_for(mode)
    for i in range(BATCH):
        assert server.add_request(PROMPT + 37 * i, 200) is not None or mode == "mixed"
    server.step()  # admission and staging may synchronize; decoding may not
    torch.cuda.synchronize()
    calls: dict = {}
    for name in ("prepare_decode", "swap_in", "wait_for_pending_backup"):
        guard(server.coordinator, name, calls)
    guard(server.allocator, "alloc_decode", calls)
    modes = set()
    for _ in range(90):  # more than a page of steps: every request starts a page
        server.step()
        modes |= {record.mode for record in server.coordinator.requests.values()}
        torch.cuda.synchronize()
        server.check_invariants()
    expected = {"resident": {RESIDENT}, "offloaded": {OFFLOADED}, "mixed": {RESIDENT, OFFLOADED}}[mode]
    assert expected <= modes, f"the {mode} run saw modes {modes}"
    assert calls["prepare_decode"] == 90 and calls["swap_in"] == 90 * 3 and calls["alloc_decode"] == 90
