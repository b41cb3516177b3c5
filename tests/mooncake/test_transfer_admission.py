"""A transferred request is admitted into decoding by the framework-free Coordinator (CPU, reference ops).

The decode process (this test) shares one ``KVAllocator`` between the receiver (which grants
logical pages only, no device rows) and the Coordinator. A prefill writer child sends a short
and a long request; after the transfer the short one is admitted resident (its KV preloaded into
device rows) and the long one offloaded and cold (its first lookups swap in from the host pool).
Both must return exactly the transferred bytes; afterwards every page goes back to the allocator.
"""

from __future__ import annotations

import json

import pytest
import torch
from mooncake_peers import POISON, Child, first_difference, request_rows, untouched_are_poisoned, wait_for

from hisparse_sglang.config import HiSparseConfig
from hisparse_sglang.coordinator import OFFLOADED, RESIDENT, Coordinator
from hisparse_sglang.memory import DeviceBufferPool, HostKVPool, KVAllocator
from hisparse_sglang.transfer import LogicalPages, Receiver

pytestmark = pytest.mark.mooncake

PAGE = 64
LAYERS = 3
ROW_BYTES = 656
TOP_K = 64
SPECS = [{"id": "short", "seed": 5, "tokens": 100}, {"id": "long", "seed": 6, "tokens": 700}]


def test_transferred_requests_are_admitted_short_resident_long_offloaded(cleanup):
    config = HiSparseConfig(top_k=TOP_K, device_buffer_size=2 * TOP_K, page_size=PAGE)
    allocator = KVAllocator(host_pages=32, device_pages=12, page_size=PAGE, checked=True)
    host_pool = HostKVPool(LAYERS, 32 * PAGE, ROW_BYTES, pin=False)
    for layer in host_pool.layers:
        layer.fill_(POISON)
    device_layers = [torch.zeros(12 * PAGE, ROW_BYTES, dtype=torch.uint8) for _ in range(LAYERS)]
    buffers = DeviceBufferPool(
        LAYERS, num_req_slots=4, num_buffers=2, buffer_size=2 * TOP_K, page_size=PAGE, context_len=1024
    )
    req_to_token = torch.zeros(4, 1024, dtype=torch.int32)
    coordinator = Coordinator(config, allocator, buffers, host_pool, device_layers, req_to_token)
    # the scheduler's own running request: three logical pages the receiver must never grant
    scheduler_rows = allocator.alloc_extend(
        torch.tensor([0]), torch.tensor([3 * PAGE]), torch.tensor([-1]), with_device_rows=False
    )
    finished = []  # outcomes delivered on the receiver's control thread
    receiver = Receiver(
        host_pool, PAGE, allocator=LogicalPages(allocator), quarantine_s=0.3, on_finished=finished.append
    )
    cleanup.append(receiver)

    writer = Child("write", "--control", receiver.control_address, "--requests", json.dumps(SPECS),
                   "--layers", str(LAYERS), "--row-bytes", str(ROW_BYTES))
    cleanup.append(writer)
    records = writer.finish()
    assert all(records[spec["id"]]["ok"] for spec in SPECS), records
    wait_for(lambda: len(finished) == 2, 10)
    outcomes = {outcome.request_id: outcome for outcome in finished}
    assert sorted(outcomes) == ["long", "short"] and all(outcome.ok for outcome in outcomes.values())
    granted = set().union(*(set(outcome.rows.tolist()) for outcome in outcomes.values()))
    assert not granted & set(scheduler_rows.tolist())
    assert untouched_are_poisoned(host_pool, granted)

    expected = {spec["id"]: request_rows(spec["seed"], LAYERS, spec["tokens"], ROW_BYTES) for spec in SPECS}
    slots = {"short": 0, "long": 1}
    for request_id, slot in slots.items():
        rows = receiver.handover(request_id).rows  # the pages now belong to the scheduler
        req_to_token[slot, : rows.numel()] = rows.to(torch.int32)
        coordinator.admit_direct(slot, rows.numel())
    receiver.check_invariants(exclusive=False)
    assert receiver.stats()["completed_pages"] == 0

    # short: preloaded into device rows, byte for byte
    assert coordinator.requests[slots["short"]].mode == RESIDENT
    short_locs = req_to_token[slots["short"], :100].to(torch.int64)
    device_rows = allocator.translate(short_locs).to(torch.int64)
    assert bool((device_rows > 0).all())
    for layer_id in range(LAYERS):
        assert torch.equal(device_layers[layer_id][device_rows], expected["short"][layer_id])
    # long: offloaded with an empty buffer, nothing of it on the device yet
    assert coordinator.requests[slots["long"]].mode == OFFLOADED
    assert bool((allocator.translate(req_to_token[slots["long"], :700].to(torch.int64)) == 0).all())

    # one decode step: new tokens get locations, then every layer swaps in a top-k of old positions
    seq_lens = torch.tensor([101, 701])
    batch_slots = torch.tensor([slots["short"], slots["long"]])
    last_loc = req_to_token[batch_slots, seq_lens - 2].to(torch.int64)
    new_locs = allocator.alloc_decode(seq_lens, last_loc)
    req_to_token[batch_slots, seq_lens - 1] = new_locs.to(torch.int32)
    coordinator.prepare_decode(batch_slots.tolist(), seq_lens.tolist(), new_locs)
    coordinator.num_real_reqs.fill_(2)
    generator = torch.Generator().manual_seed(3)
    positions = torch.stack([torch.randperm(n, generator=generator)[:TOP_K] for n in (100, 700)])
    misses_before = int(coordinator.swap_counters[1])
    for layer_id in range(LAYERS):
        rows = coordinator.swap_in(batch_slots, seq_lens, positions.to(torch.int32), layer_id).to(torch.int64)
        for batch_index, request_id in enumerate(("short", "long")):
            got = device_layers[layer_id][rows[batch_index]]
            want = expected[request_id][layer_id][positions[batch_index]]
            mismatch = (got != want).any(dim=1).nonzero()
            where = positions[batch_index][mismatch[:1, 0]].tolist()
            assert mismatch.numel() == 0, f"{request_id} layer {layer_id}: position {where} differs"
    assert int(coordinator.swap_counters[1]) - misses_before == LAYERS * TOP_K  # every long lookup missed once

    # the host rows still hold the transfer, and ending both requests returns every page
    for request_id, slot in slots.items():
        locs = req_to_token[slot, : SPECS[slot]["tokens"]].to(torch.int64)
        assert first_difference(host_pool, locs, expected[request_id]) is None
        coordinator.finish(slot)
        allocator.free(req_to_token[slot, : SPECS[slot]["tokens"] + 1])
    allocator.free(scheduler_rows)
    assert allocator.logical.free_pages == 31 and allocator.device_rows.free_pages == 11
