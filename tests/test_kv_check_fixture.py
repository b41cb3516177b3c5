"""The end-to-end harness's in-server KV check (benchmarks/e2e/kv_check_fixture.py) finds a wrong row.

It runs here on the real coordinator with the reference ops, driven by the simulated decode server: after
every step every row attention would read for a top-k position is compared with the host pool's row of
that position. A correct run has no mismatch; a device row changed behind the coordinator's back is found
and located."""

from __future__ import annotations

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "e2e"))

import kv_check_fixture  # noqa: E402

from hisparse_sglang.config import HiSparseConfig  # noqa: E402
from hisparse_sglang.coordinator import core  # noqa: E402
from hisparse_sglang.testing.sim import SimulatedServer  # noqa: E402


@pytest.fixture
def checked_server(monkeypatch):
    """A simulated server whose coordinator records its swap-ins (restored after the test)."""
    monkeypatch.setattr(core.Coordinator, "__init__", core.Coordinator.__init__)
    monkeypatch.setattr(core.Coordinator, "swap_in", core.Coordinator.swap_in)
    monkeypatch.setattr(kv_check_fixture, "_RECORDERS", [])
    kv_check_fixture._wrap_swap_in(core)
    config = HiSparseConfig(top_k=64, device_buffer_size=128, page_size=16, host_to_device_ratio=4,
                            resident_first=False)
    server = SimulatedServer(config, layer_num=2, item_bytes=64, device_pages=64, max_reqs=4, max_context=1024,
                             seed=3)
    for prompt_len in (300, 500, 90):
        server.add_request(prompt_len, 40)
    return server


def test_a_correct_run_has_no_mismatch(checked_server):
    recorder = checked_server.coordinator._kv_check
    for _ in range(12):
        checked_server.step()
        recorder.check()
    assert recorder.checks == 12
    assert recorder.rows_checked > 0
    assert recorder.mismatches == 0, recorder.first_mismatch


def test_a_wrong_device_row_is_found_and_located(checked_server):
    recorder = checked_server.coordinator._kv_check
    for _ in range(4):
        checked_server.step()
    layer = 1
    real = int(recorder.real)
    rows = recorder.rows[layer, :real]
    positions = recorder.top_k[layer, :real]
    valid = (positions >= 0) & (positions < recorder.seq_lens[:real].unsqueeze(1)) & (rows >= 0)
    request, entry = (int(v) for v in valid.nonzero()[0])
    row = int(rows[request, entry])
    checked_server.coordinator.device_layers[layer][row, 5] ^= 0xFF
    recorder.check()
    assert recorder.mismatches >= 1
    found = recorder.first_mismatch
    assert (found["layer"], found["device_row"]) == (layer, row)
    assert found["slot"] == int(recorder.slots[request]) and not found["unserved"]


def test_a_position_without_a_row_counts(checked_server):
    recorder = checked_server.coordinator._kv_check
    checked_server.step()
    real = int(recorder.real)
    positions = recorder.top_k[0, :real]
    valid = (positions >= 0) & (positions < recorder.seq_lens[:real].unsqueeze(1))
    request, entry = (int(v) for v in valid.nonzero()[0])
    recorder.rows[0, request, entry] = -1
    recorder.check()
    assert recorder.mismatches == 1 and recorder.first_mismatch["unserved"]
