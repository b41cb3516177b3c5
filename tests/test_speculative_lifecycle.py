"""Speculative decoding lifecycles (docs/speculative.md): random admit / PD admit / verify / finish / abort /
retract sequences with random accept lengths 0..T, in both modes (resident-first with demotions and
promotions, always-offload), the host learning accept lengths one verify late or at once.

After every operation the simulator (testing/sim.py, speculative mode) checks: every row the multi-position
swap-in returns for a valid top-k entry of every verify position holds that token's KV (the committed
token's, or what this verify wrote for a verify position), no host row ever holds a rejected draft token's
KV, every committed token is on its host row, slot D holds the newest committed token (unless flagged
for refresh), no device row is owned twice; at the end that every row, page, buffer and mapping is free.

HISPARSE_SPEC_PROPERTY_EXAMPLES sets the number of random sequences (default 500 across the three property
tests: 60 %, 20 %, 20 %; 25-40 s on 2 cores). ``pytest --hypothesis-show-statistics`` shows how many
examples demoted, promoted, cancelled a promotion, verified offloaded requests and copied misses.
"""

import os

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from hisparse_sglang.config import HiSparseConfig
from hisparse_sglang.testing.sim import SimulatedServer, SpeculativeMode

TOTAL_EXAMPLES = int(os.environ.get("HISPARSE_SPEC_PROPERTY_EXAMPLES", "500"))
LIFECYCLE_EXAMPLES = max(1, TOTAL_EXAMPLES * 6 // 10)
PRESSURE_EXAMPLES = max(1, TOTAL_EXAMPLES // 5)
SWITCH_EXAMPLES = max(1, TOTAL_EXAMPLES - LIFECYCLE_EXAMPLES - PRESSURE_EXAMPLES)

operation = st.one_of(
    st.tuples(st.just("add"), st.integers(1, 40), st.integers(0, 30)),
    st.tuples(st.just("pd"), st.integers(1, 60), st.integers(0, 30)),
    st.tuples(st.just("step"), st.integers(1, 6)),
    st.tuples(st.just("finish"), st.integers(0, 7)),
    st.tuples(st.just("abort"), st.integers(0, 7)),
    st.tuples(st.just("retract"), st.integers(0, 7)),
    st.tuples(st.just("readmit")),
)

setup = st.fixed_dictionaries(
    {
        "page_size": st.sampled_from([4, 8]),
        "num_draft_tokens": st.integers(1, 4),
        "buffer_pages": st.integers(2, 4),
        "top_k_fraction": st.sampled_from([0.25, 0.5, 1.0]),
        "ratio": st.integers(2, 4),
        "resident_first": st.booleans(),
        "cooldown": st.integers(0, 3),
        "max_switches": st.integers(1, 3),
        "promote_free_fraction": st.sampled_from([0.0, 0.2]),
        "device_pages": st.integers(8, 16),
        "event_delay": st.integers(0, 2),
        "layers": st.integers(1, 2),
        "host_lag": st.booleans(),
        "seed": st.integers(0, 2**16),
    }
)


def build(params, max_context: int = 160, accept=None) -> SimulatedServer:
    page = params["page_size"]
    buffer_size = page * params["buffer_pages"]
    num_positions = min(params["num_draft_tokens"], page - 1)
    config = HiSparseConfig(
        # the verify positions of a request share its buffer: T x top_k <= device_buffer_size
        top_k=max(1, int(buffer_size // num_positions * params["top_k_fraction"])),
        device_buffer_size=buffer_size,
        page_size=page,
        host_to_device_ratio=params["ratio"],
        resident_first=params["resident_first"],
        switch_cooldown_steps=params["cooldown"],
        max_switches_per_step=params["max_switches"],
        promote_free_fraction=params["promote_free_fraction"],
    )
    return SimulatedServer(
        config,
        layer_num=params["layers"],
        item_bytes=16,
        device_pages=params["device_pages"],
        max_reqs=5,
        max_context=max_context,
        seed=params["seed"],
        cpu_event_delay_steps=params["event_delay"],
        speculative=SpeculativeMode(num_positions, host_lag=params["host_lag"], accept=accept),
    )


def run(params, operations) -> SimulatedServer:
    server = build(params)
    server.apply(operations)
    server.drain()
    return server


def note_coverage(server: SimulatedServer) -> None:
    """What the example exercised (``pytest --hypothesis-show-statistics``)."""
    telemetry = server.coordinator.telemetry
    lookups, misses = server.coordinator.swap_counters.tolist()
    for name, happened in (
        ("demoted", telemetry.demotions), ("promoted", telemetry.promotions),
        ("cancelled a promotion", telemetry.promotion_cancels), ("verified offloaded", lookups),
        ("copied misses", misses),
    ):
        event(f"{name}: {'yes' if happened else 'no'}")


PROPERTY_SETTINGS = dict(
    deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)


@settings(max_examples=LIFECYCLE_EXAMPLES, **PROPERTY_SETTINGS)
@given(params=setup, operations=st.lists(operation, min_size=1, max_size=30))
def test_random_speculative_lifecycles_keep_every_invariant(params, operations):
    note_coverage(run(params, operations))


@settings(max_examples=PRESSURE_EXAMPLES, **PROPERTY_SETTINGS)
@given(
    params=setup,
    prompts=st.lists(st.tuples(st.booleans(), st.integers(8, 60), st.integers(0, 40)), min_size=1, max_size=6),
)
def test_speculative_decode_to_completion_under_memory_pressure(params, prompts):
    """More demand than device memory (demotions, promotions, retractions, PD admissions), run to the end:
    every request finishes or is rejected as too large for an idle server."""
    params = dict(params, device_pages=min(params["device_pages"], 12))
    server = build(params)
    uids = []
    for transferred, prompt_len, output_len in prompts:
        uid = server.admit_transferred(prompt_len, output_len) if transferred else None
        uids.append(uid if uid is not None else server.submit(prompt_len, output_len))
    server.drain()
    note_coverage(server)
    assert set(uids) == set(server.finished) | set(server.rejected)


@settings(max_examples=SWITCH_EXAMPLES, **PROPERTY_SETTINGS)
@given(
    params=setup,
    long_requests=st.lists(st.tuples(st.booleans(), st.integers(24, 48), st.integers(10, 40)), min_size=1, max_size=2),
    head_start=st.integers(0, 6),
    burst=st.lists(st.tuples(st.integers(6, 24), st.integers(1, 6)), min_size=1, max_size=3),
)
def test_speculative_demotions_then_promotions(params, long_requests, head_start, burst):
    """Long requests verify resident, a burst of short prefills demotes them mid-speculation (the host
    possibly one verify behind), the burst ends and they are promoted back with their reserves."""
    params = dict(params, resident_first=True, promote_free_fraction=0.0, cooldown=params["cooldown"] % 2,
                  device_pages=16 + params["device_pages"] % 9)
    server = build(params)
    for transferred, prompt_len, output_len in long_requests:
        if not transferred or server.admit_transferred(prompt_len, output_len) is None:
            server.submit(prompt_len, output_len)
    for _ in range(head_start):
        server.readmit_retracted()
        server.admit_waiting()
        server.step()
        server.check_invariants()
    for prompt_len, output_len in burst:
        server.submit(prompt_len, output_len)
    server.drain()
    note_coverage(server)


# ---------------------------------------------------------------------------------------------- scenarios
def scenario(**overrides):
    params = dict(
        page_size=4, num_draft_tokens=3, buffer_pages=2, top_k_fraction=1.0, ratio=4, resident_first=True,
        cooldown=0, max_switches=1, promote_free_fraction=0.0, device_pages=12, event_delay=0, layers=2,
        host_lag=True, seed=0,
    )
    params.update(overrides)
    return params


@pytest.mark.parametrize("host_lag", [True, False], ids=["host-lags", "host-in-step"])
@pytest.mark.parametrize("resident_first", [True, False], ids=["resident-first", "always-offload"])
@pytest.mark.parametrize("script", ["reject-all", "accept-all", "alternate"])
def test_extreme_accept_lengths(script, resident_first, host_lag):
    """Scripted accept lengths at the ends of [0, T]: every draft rejected (the root only, or nothing),
    every draft accepted, and the two alternating, with demotions (a device pool of 11 pages for three
    requests) and with the host behind or not."""
    num_positions = 3
    accept = {
        "reject-all": lambda uid, i: 1 if i % 4 else 0,
        "accept-all": lambda uid, i: num_positions,
        "alternate": lambda uid, i: (0, num_positions, 1, num_positions - 1)[i % 4],
    }[script]
    server = build(scenario(resident_first=resident_first, host_lag=host_lag), accept=accept)
    uids = [server.submit(30, 20), server.submit(14, 25), server.admit_transferred(26, 12)]
    server.drain()
    assert set(server.finished) == set(uids)
    if resident_first:
        assert server.coordinator.telemetry.demotions > 0, "the scenario should demote under pressure"


def test_a_demotion_decided_behind_the_device_refreshes_slot_d():
    """With the host one verify behind, a request demoted between steps (a prefill's reclaim) is demoted
    at c < s: its slot D holds c - 1 and must be refreshed from the host before the next verify reads s - 1."""
    server = build(scenario(device_pages=14, host_lag=True), accept=lambda uid, i: 3)
    first = server.add_request(30, 40)
    for _ in range(3):
        server.step()
        server.check_invariants()
    request = server.requests[first]
    assert request.host_len < request.seq_len, "the host should be one verify behind"
    assert server.add_request(16, 4) is not None  # its prefill reclaims: the first request is demoted
    record = server.coordinator.requests[request.slot]
    assert record.mode == "offloaded" and record.spec.slot_d_stale
    server.check_invariants()
    server.step()  # the verify reads s - 1 from slot D (checked by the step)
    assert not record.spec.slot_d_stale
    server.check_invariants()
    server.drain()


def test_a_promotion_completes_with_the_reserve_mapped():
    """An offloaded request promoted back: its pages cover every allocated location (the reserve past
    s included) and it keeps verifying resident."""
    server = build(scenario(device_pages=14, max_switches=2), accept=lambda uid, i: 2)
    long_uid = server.add_request(30, 30)
    server.step()
    short_uid = server.add_request(24, 2)  # reclaims: the long request is demoted
    slot = server.requests[long_uid].slot
    assert server.coordinator.requests[slot].mode == "offloaded"
    for _ in range(6):
        server.step()
        server.check_invariants()
        if short_uid not in server.requests and server.coordinator.requests[slot].mode == "resident":
            break
    record = server.coordinator.requests[slot]
    assert record.mode == "resident" and server.coordinator.telemetry.promotions == 1
    locs = server.req_to_token[slot, : record.allocated_len].long()
    assert bool((server.allocator.translate(locs) > 0).all())
    server.drain()


@pytest.mark.parametrize("end", ["finish", "abort", "retract"])
@pytest.mark.parametrize("mode", ["resident", "offloaded"])
def test_ending_a_request_mid_speculation_returns_everything(end, mode):
    """A request ended between verifies, with a reserve past s and verify positions bound into its
    buffer (offloaded): every page, row, buffer and mapping comes back."""
    server = build(scenario(device_pages=24, resident_first=mode == "resident"), accept=lambda uid, i: i % 4)
    uid = server.add_request(30, 60)
    for _ in range(5):
        server.step()
    slot = server.requests[uid].slot
    record = server.coordinator.requests[slot]
    assert record.mode == mode and record.allocated_len > server.requests[uid].seq_len
    getattr(server, end)(uid)
    server.check_invariants()
    if end == "retract":
        server.retracted.clear()
    server.check_all_free()


def test_a_host_row_of_a_rejected_token_is_never_written():
    """Host rows past the committed length keep what they held: a sentinel written before the verifies."""
    server = build(scenario(device_pages=24), accept=lambda uid, i: (1, 0, 2)[i % 3])
    uid = server.add_request(30, 40)
    slot = server.requests[uid].slot
    server.step()
    request = server.requests[uid]
    locs = server.req_to_token[slot, request.seq_len : request.allocated_len].long()
    for layer in server.host_pool.layers:
        layer[locs] = 0x5A
    for _ in range(4):
        committed = request.seq_len
        server.step()
        for layer in server.host_pool.layers:
            past = server.req_to_token[slot, request.seq_len : request.allocated_len].long()
            untouched = past[torch.isin(past, locs)]
            assert bool((layer[untouched] == 0x5A).all()), "a host row past s was written"
        assert request.seq_len >= committed
    server.drain()
