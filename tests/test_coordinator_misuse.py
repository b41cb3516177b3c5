"""The coordinator's calls refuse misuse with a typed error and change nothing (CPU, reference ops).

A scheduler bug (a slot decoded twice in one batch, lengths that do not match the slots, a request
that was never admitted or is still staging, a prefill longer than its slot) must not silently
advance or corrupt HiSparse's state.
"""

import pytest
import torch

from hisparse_sglang.config import HiSparseConfig
from hisparse_sglang.errors import HiSparseMemoryError
from hisparse_sglang.testing.sim import SimulatedServer

PAGE = 4


def decoding_server() -> tuple[SimulatedServer, list[int]]:
    config = HiSparseConfig(top_k=8, device_buffer_size=16, page_size=PAGE)
    server = SimulatedServer(config, layer_num=1, device_pages=64, max_reqs=4, max_context=128)
    uids = [server.add_request(30, 50), server.add_request(22, 50)]
    server.step()
    return server, [server.requests[uid].slot for uid in uids]


def state(server: SimulatedServer) -> tuple:
    coordinator = server.coordinator
    return (
        {slot: (r.seq_len, r.mode) for slot, r in coordinator.requests.items()},
        coordinator.allocator.device_row_of_loc.clone(),
        coordinator.allocator.device_rows.free_pages,
    )


def call(server: SimulatedServer, slots, seq_lens, count=None):
    new_locs = torch.zeros(len(slots) if count is None else count, dtype=torch.int64)
    server.coordinator.prepare_decode(slots, seq_lens, new_locs)


def test_a_slot_twice_in_one_batch_is_refused():
    server, (a, b) = decoding_server()
    before = state(server)
    length = server.coordinator.requests[a].seq_len + 1
    with pytest.raises(HiSparseMemoryError, match=rf"slot\(s\) \[{a}\] more than once"):
        call(server, [a, a], [length, length])
    assert torch.equal(state(server)[1], before[1]) and state(server)[0] == before[0]


@pytest.mark.parametrize("lengths, count", [(1, 2), (2, 1), (2, 3)])
def test_lengths_that_do_not_match_the_slots_are_refused(lengths, count):
    server, (a, b) = decoding_server()
    before = state(server)
    seq_lens = [server.coordinator.requests[a].seq_len + 1, server.coordinator.requests[b].seq_len + 1][:lengths]
    with pytest.raises(HiSparseMemoryError, match="pass one of each per slot"):
        call(server, [a, b], seq_lens, count=count)
    assert state(server)[0] == before[0]


@pytest.mark.parametrize("slot", [3, -1, -4, 99, -99])
def test_unknown_slots_are_refused_by_name(slot):
    server, (a, _) = decoding_server()
    before = state(server)
    with pytest.raises(HiSparseMemoryError, match=rf"request slot {slot} is not admitted"):
        call(server, [a, slot], [server.coordinator.requests[a].seq_len + 1, 10])
    assert state(server)[0] == before[0]


def test_a_step_of_other_than_one_token_is_refused():
    server, (a, b) = decoding_server()
    before = state(server)
    current = server.coordinator.requests[b].seq_len
    with pytest.raises(HiSparseMemoryError, match=rf"slot {b}: decode step to length {current + 2}"):
        call(server, [a, b], [server.coordinator.requests[a].seq_len + 1, current + 2])
    assert state(server)[0] == before[0]


def test_a_staging_request_cannot_decode():
    config = HiSparseConfig(top_k=8, device_buffer_size=16, page_size=PAGE)
    server = SimulatedServer(config, layer_num=1, device_pages=64, max_reqs=4, max_context=128)
    uid = server.add_request(30, 5)
    slot = server.requests[uid].slot
    with pytest.raises(HiSparseMemoryError, match=rf"request slot {slot} is still staging"):
        call(server, [slot], [31])


@pytest.mark.parametrize("length", [0, 129, 10**6])
def test_admissions_outside_the_slot_context_are_refused(length):
    config = HiSparseConfig(top_k=8, device_buffer_size=16, page_size=PAGE)
    server = SimulatedServer(config, layer_num=1, device_pages=64, max_reqs=4, max_context=128)
    coordinator = server.coordinator
    with pytest.raises(HiSparseMemoryError, match=r"must be in \[1, 128\]"):
        coordinator.admit_prefilled(0, length)
    with pytest.raises(HiSparseMemoryError, match=r"must be in \[1, 128\]"):
        coordinator.admit_direct(1, length)
    assert not coordinator.requests and not coordinator.pending


def test_the_batch_still_decodes_after_refused_calls():
    server, (a, b) = decoding_server()
    with pytest.raises(HiSparseMemoryError):
        call(server, [a, a], [1, 1])
    with pytest.raises(HiSparseMemoryError):
        call(server, [a, 7], [1, 1])
    for _ in range(6):
        server.step()
        server.check_invariants()


def can_decode_server(device_pages: int) -> tuple[SimulatedServer, list[int], int]:
    """Two decoding requests and one still staging (not resident-first: the staged request waits
    for its copy, so it stays pending until the next step)."""
    config = HiSparseConfig(top_k=8, device_buffer_size=16, page_size=PAGE, resident_first=False)
    server = SimulatedServer(config, layer_num=1, device_pages=device_pages, max_reqs=4, max_context=128)
    uids = [server.add_request(30, 50), server.add_request(22, 50)]
    server.step()
    staging = server.requests[server.add_request(9, 50)].slot
    return server, [server.requests[uid].slot for uid in uids], staging


def fill_device_pool(server: SimulatedServer, leave_free: int) -> None:
    rows = server.coordinator.allocator.device_rows
    rows.alloc_pages(rows.free_pages - leave_free)


@pytest.mark.parametrize("pressure", [False, True], ids=["pages-free", "memory-pressure"])
@pytest.mark.parametrize("kind", ["unknown", "negative", "out-of-range", "staging"])
def test_can_decode_refuses_a_slot_that_is_not_decoding_whatever_memory_is_free(kind, pressure):
    server, (a, b), staging = can_decode_server(device_pages=64)
    if pressure:
        fill_device_pool(server, leave_free=0)
    coordinator = server.coordinator
    assert staging in coordinator.pending
    bad = {"unknown": 3, "negative": -1, "out-of-range": 99, "staging": staging}[kind]
    message = rf"request slot {bad} is still staging" if kind == "staging" else rf"request slot {bad} is not admitted"
    free_before = coordinator.allocator.device_rows.free_pages
    assert (free_before >= 3) != pressure  # the fast path (more pages free than slots) is the one without pressure
    for batch in ([a, bad], [bad, b], [bad]):
        before = state(server)
        with pytest.raises(HiSparseMemoryError, match=message):
            coordinator.can_decode(batch)
        assert state(server)[0] == before[0] and state(server)[2] == free_before


def test_can_decode_refuses_a_finished_request():
    server, (a, b), _ = can_decode_server(device_pages=64)
    coordinator = server.coordinator
    coordinator.finish(b)
    with pytest.raises(HiSparseMemoryError, match=rf"request slot {b} is not admitted"):
        coordinator.can_decode([a, b])


def test_can_decode_still_answers_for_decoding_requests():
    server, (a, b), _ = can_decode_server(device_pages=64)
    coordinator = server.coordinator
    assert [coordinator.requests[slot].mode for slot in (a, b)] == ["offloaded", "offloaded"]
    assert coordinator.can_decode([a, b]) and coordinator.can_decode([])
    fill_device_pool(server, leave_free=0)
    assert coordinator.can_decode([a, b])  # offloaded requests decode into their buffers: no page needed
