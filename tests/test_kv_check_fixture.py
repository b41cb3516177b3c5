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


def fused_verify_server(monkeypatch, mistake=None) -> SimulatedServer:
    """A recorded verify server (T = 3, resident-first) whose swap-in gets a resident request's entries as
    device rows, as SGLang 0.5.17 - 0.5.21's fused top-k through the verify page table gives them: the position
    ``p`` of a resident request becomes the row its location maps to, and the swap-in passes it through
    (``resident_rows``). ``mistake(entries, resident)`` may change the rows first."""
    import torch

    from hisparse_sglang.testing.sim import SpeculativeMode

    def fused_top_k(self, req_pool_indices, seq_lens, top_k, layer_id, resident_rows=False):
        slots = req_pool_indices.to(torch.int64)
        resident = self.buffers.buffer_of_req[slots] < 0
        locations = self.req_to_token[slots].to(torch.int64).unsqueeze(1).expand(-1, top_k.shape[1], -1)
        rows = self.allocator.device_row_of_loc[locations.gather(2, top_k.clamp(min=0).to(torch.int64))]
        # SGLang's kernel selects only within each position's causal range [0, s + j]: -1 elsewhere
        causal = top_k <= (seq_lens.reshape(-1, 1) + torch.arange(top_k.shape[1])).unsqueeze(2)
        top_k = torch.where(causal, top_k, -1)
        entries = torch.where(resident.reshape(-1, 1, 1) & (top_k >= 0), rows.to(top_k.dtype), top_k)
        if mistake is not None:
            mistake(entries, resident)
        return serve(self, req_pool_indices, seq_lens, entries, layer_id, True)

    config = HiSparseConfig(top_k=16, device_buffer_size=64, page_size=16, host_to_device_ratio=4,
                            resident_first=True)
    server = recorded_server(monkeypatch, (300, 200), config=config, seed=5, verify=False,
                             speculative=SpeculativeMode(3, host_lag=False, accept=lambda uid, i: 2))
    serve = core.Coordinator.swap_in_verify  # wrapped by the check, as H4 calls it
    monkeypatch.setattr(core.Coordinator, "swap_in_verify", fused_top_k)
    return server


def test_resident_rows_given_are_checked_by_the_position_they_stand_for(monkeypatch):
    """With the fused verify top-k a resident request's entries are device rows: the check finds, for each, the
    request's position whose location maps to it and compares the row with that position's host row. A correct
    run has no mismatch; a changed resident row is found."""
    server = fused_verify_server(monkeypatch)
    recorder = server.coordinator._kv_check
    for _ in range(5):
        server.step()
        recorder.check()
    assert recorder.given_checked > 0 and recorder.rows_checked > 0
    assert recorder.mismatches == 0, recorder.first_mismatch
    layer = 1
    real = int(recorder.real) * recorder.positions
    given = recorder.given[:real].nonzero().flatten()
    request = int(given[0])
    entries = recorder.top_k[layer, request]
    seq_len = int(recorder.seq_lens[request])
    row = next(int(r) for r in entries.tolist() if r > 0 and int(
        (server.coordinator.allocator.device_row_of_loc[server.coordinator.req_to_token[int(recorder.slots[request]),
                                                        :seq_len].long()] == r).sum()))
    server.coordinator.device_layers[layer][row, 7] ^= 0xFF
    recorder.check()
    assert recorder.mismatches >= 1
    found = recorder.first_mismatch
    assert found["given_row"] and (found["layer"], found["device_row"]) == (layer, row) and not found["stray"]


def test_a_given_row_of_no_position_of_its_request_counts(monkeypatch):
    """An entry of a resident request that is no row of the request's positions (a mapping gone wrong) is a
    mismatch, named as such."""
    import torch

    def one_row_elsewhere(entries, resident):
        request = int(resident.nonzero()[0])
        entries[request, 0, 0] = torch.iinfo(torch.int32).max // 2  # beyond the device rows

    server = fused_verify_server(monkeypatch, one_row_elsewhere)
    recorder = server.coordinator._kv_check
    server.step()
    recorder.check()
    assert recorder.mismatches >= 1 and recorder.first_mismatch["stray"] and recorder.first_mismatch["given_row"]
