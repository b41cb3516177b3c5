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


def recorded_server(monkeypatch, prompt_lens, **kwargs) -> SimulatedServer:
    """A simulated server whose coordinator records its swap-ins (the wrapped methods restored after the test)."""
    for name in ("__init__", "swap_in", "swap_in_verify"):
        monkeypatch.setattr(core.Coordinator, name, getattr(core.Coordinator, name))
    monkeypatch.setattr(kv_check_fixture, "_RECORDERS", [])
    kv_check_fixture._wrap_swap_in(core)
    server = SimulatedServer(layer_num=2, item_bytes=64, device_pages=64, max_reqs=4, max_context=1024, **kwargs)
    for prompt_len in prompt_lens:
        server.add_request(prompt_len, 40)
    return server


@pytest.fixture
def checked_server(monkeypatch):
    config = HiSparseConfig(top_k=64, device_buffer_size=128, page_size=16, host_to_device_ratio=4,
                            resident_first=False)
    return recorded_server(monkeypatch, (300, 500, 90), config=config, seed=3)


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


@pytest.fixture
def checked_verify_server(monkeypatch):
    """Speculative verify steps (T = 3, two accepted per step), recorded."""
    from hisparse_sglang.testing.sim import SpeculativeMode

    config = HiSparseConfig(top_k=16, device_buffer_size=64, page_size=16, host_to_device_ratio=4,
                            resident_first=False)
    return recorded_server(monkeypatch, (300, 200), config=config, seed=5,
                           speculative=SpeculativeMode(3, host_lag=False, accept=lambda uid, i: 2))


def test_verify_steps_are_checked_on_their_history_rows(checked_verify_server):
    recorder = checked_verify_server.coordinator._kv_check
    for _ in range(6):
        checked_verify_server.step()
        recorder.check()
    assert recorder.positions == 3 and recorder.checks == 6
    assert recorder.rows_checked > 0
    assert recorder.mismatches == 0, recorder.first_mismatch
    layer = 0
    real = int(recorder.real) * recorder.positions
    rows, positions = recorder.rows[layer, :real], recorder.top_k[layer, :real]
    valid = (positions >= 0) & (positions < recorder.seq_lens[:real].unsqueeze(1)) & (rows >= 0)
    request, entry = (int(v) for v in valid.nonzero()[-1])  # a row of the last request's last position
    row = int(rows[request, entry])
    checked_verify_server.coordinator.device_layers[layer][row, 3] ^= 0xFF
    recorder.check()
    assert recorder.mismatches >= 1 and recorder.first_mismatch["device_row"] == row


def test_positions_the_swap_in_left_out_are_not_checked(monkeypatch):
    """A verify position at or past its row's verify limit (the buffer could not hold it; its rows are -1 and it is
    never accepted) is not a mismatch; the served positions are still checked. The swap-in here leaves position 2
    of every offloaded row out after the reference twin ran (as the kernel would where its misses do not fit)."""
    from hisparse_sglang.ops import reference
    from hisparse_sglang.testing.sim import SpeculativeMode

    serve = reference.swap_in_positions

    def leaving_out_position_2(top_k, seq_lens, req_pool_indices, num_real_reqs, tables, out=None, counters=None,
                               verify_limit=None, **kwargs):
        rows = serve(top_k, seq_lens, req_pool_indices, num_real_reqs, tables, out, counters, verify_limit, **kwargs)
        rows[:, 2:] = -1
        verify_limit[: rows.shape[0]] = 2
        return rows

    monkeypatch.setattr(reference, "swap_in_positions", leaving_out_position_2)
    config = HiSparseConfig(top_k=16, device_buffer_size=64, page_size=16, host_to_device_ratio=4,
                            resident_first=False)
    server = recorded_server(monkeypatch, (300, 200), config=config, seed=5, verify=False,
                             speculative=SpeculativeMode(3, host_lag=False, accept=lambda uid, i: 2))
    recorder = server.coordinator._kv_check
    for _ in range(4):
        server.step()
        recorder.check()
    assert recorder.rows_checked > 0
    assert recorder.mismatches == 0, recorder.first_mismatch


def test_with_resident_rows_given_only_offloaded_requests_are_recorded_as_positions(monkeypatch):
    """SGLang 0.5.17 - 0.5.21's fused verify top-k gives a resident request's entries as device rows: the check
    records only the offloaded requests' positions (a resident request's entries become -1, not checked)."""
    import types

    import torch

    rows_out = torch.zeros(3, 2, 4, dtype=torch.int32)
    monkeypatch.setattr(core.Coordinator, "swap_in_verify", lambda self, *args: rows_out)
    monkeypatch.setattr(core.Coordinator, "__init__", core.Coordinator.__init__)
    monkeypatch.setattr(core.Coordinator, "swap_in", core.Coordinator.swap_in)
    kv_check_fixture._wrap_swap_in(core)
    recorded = []
    fake = types.SimpleNamespace(
        _kv_check=types.SimpleNamespace(record=lambda *args: recorded.append(args)),
        speculative=types.SimpleNamespace(verify_limit=torch.full((4,), 99, dtype=torch.int32)),
        buffers=types.SimpleNamespace(buffer_of_req=torch.tensor([-1, 0, -1, 1], dtype=torch.int32)),
    )
    top_k = torch.arange(3 * 2 * 4, dtype=torch.int32).reshape(3, 2, 4)
    slots, seq_lens = torch.tensor([2, 1, 3]), torch.tensor([40, 50, 60])
    for given in (False, True):
        assert core.Coordinator.swap_in_verify(fake, slots, seq_lens, top_k, 0, given) is rows_out
    unmasked, masked = recorded[0][1].reshape(3, 2, 4), recorded[1][1].reshape(3, 2, 4)
    assert torch.equal(unmasked, top_k)
    assert bool((masked[0] == -1).all()) and torch.equal(masked[1:], top_k[1:])
