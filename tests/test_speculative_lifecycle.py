"""Speculative decoding lifecycles (docs/speculative.md): random admit / PD admit / verify / finish / abort /
retract sequences with random accept lengths 0..T, in both modes (resident-first with demotions and
promotions, always-offload), the host learning accept lengths one verify late or at once.

After every operation the simulator (testing/sim.py, speculative mode) checks: every row the multi-position
swap-in returns for a valid top-k entry of every served verify position holds that token's KV (the committed
token's, or what this verify wrote for a verify position), every entry of a position the swap-in left out (its
request's positions named more history than its buffer holds) is -1, each layer's lookups, misses and verify
limits are those of a model of the grouped swap-in, the accept lengths are capped at the limits, no host row
ever holds a rejected draft token's KV (a position the cap drops is one), every committed token is on its host
row, slot D holds the newest committed token (unless flagged for refresh), no device row is owned twice; at
the end that every row, page, buffer and mapping is free. Part of the configurations (``top_k_of_buffer``) have a
top-k of half to all of the buffer, so that ``T x top_k`` exceeds it: positions are served in groups, some left out.

HISPARSE_SPEC_PROPERTY_EXAMPLES sets the number of random sequences (default 500 across the three property
tests: 60 %, 20 %, 20 %; 25-40 s on 2 cores). ``pytest --hypothesis-show-statistics`` shows how many
examples demoted, promoted, cancelled a promotion, verified offloaded requests, copied misses, left verify
positions out and capped accept lengths.
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
        # None: T x top_k fits the buffer; else top_k is this share of it (T x top_k > D from T = 2, at 0.5 from 3).
        "top_k_of_buffer": st.sampled_from([None, None, 0.5, 0.75, 1.0]),
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


def build(params, max_context: int = 160, accept=None, indexer=None) -> SimulatedServer:
    page = params["page_size"]
    buffer_size = page * params["buffer_pages"]
    num_positions = min(params["num_draft_tokens"], page - 1)
    if params["top_k_of_buffer"] is None:
        # the verify positions of a request fit its buffer together: T x top_k <= device_buffer_size
        top_k = max(1, int(buffer_size // num_positions * params["top_k_fraction"]))
    else:
        # they may not: served in groups of G with G x top_k <= device_buffer_size, the later ones left out
        top_k = max(1, int(buffer_size * params["top_k_of_buffer"]))
    config = HiSparseConfig(
        top_k=top_k,
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
        speculative=SpeculativeMode(num_positions, host_lag=params["host_lag"], accept=accept, indexer=indexer),
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
        ("copied misses", misses), ("left out positions", server.left_out_positions),
        ("capped accepts", server.capped_accepts),
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
        page_size=4, num_draft_tokens=3, buffer_pages=2, top_k_fraction=1.0, top_k_of_buffer=None, ratio=4,
        resident_first=True,
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


def scripted_indexer(layout):
    """A top-k naming, for layer ``l`` and verify position ``j``, the entries ``layout[l][j]``: an offset ``o``
    names the history token ``s - 2 - o`` (padding below 0), ``"newest"`` ``s - 1``, ``"own"`` the position's
    own verify token ``s + j`` and ``"past"`` the token after it (past its causal range: padding)."""

    def indexer(uid, layer_id, committed):
        def token(j, entry):
            if entry == "newest":
                return committed - 1
            if entry == "own":
                return committed + j
            if entry == "past":
                return committed + j + 1
            return max(committed - 2 - entry, -1)

        return torch.tensor([[token(j, entry) for entry in entries] for j, entries in enumerate(layout[layer_id])])

    return indexer


# Groups of two positions (top_k 4, D = 8, T = 3): layer 0's first group names eight distinct history tokens,
# every slot, so position 2's misses find none and it is left out (limit 2); layer 1's first group fits, and its
# position 2 (four new tokens, which four free slots would hold) is padding under the limit layer 0 left.
GROUPS_OF_TWO = (
    [[0, 1, 2, 3], [4, 5, 6, 7], ["newest", "own", 8, 9]],
    [["newest", 0, 1, 2], [0, 3, "own", "past"], [12, 13, 14, 15]],
)
# One position per group (top_k 8 = D, T = 3): layer 0 serves positions 0 and 1 (the same seven tokens) and
# leaves position 2 out (eight new ones, one slot free); layer 1 leaves position 1 out, lowering the limit to 1.
ONE_PER_GROUP = (
    [["newest", 0, 1, 2, 3, 4, 5, 6], [6, 5, 4, 3, 2, 1, 0, "own"], list(range(7, 15))],
    [["newest", 0, 1, 2, 3, 4, 5, 6], list(range(7, 15)), list(range(15, 23))],
)


@pytest.mark.parametrize("host_lag", [True, False], ids=["host-lags", "host-in-step"])
@pytest.mark.parametrize(
    "top_k_of_buffer,layout,limit", [(0.5, GROUPS_OF_TWO, 2), (1.0, ONE_PER_GROUP, 1)],
    ids=["groups-of-two", "one-per-group"],
)
def test_positions_left_out_by_a_small_buffer_cap_the_accepts(top_k_of_buffer, layout, limit, host_lag):
    """``T x top_k`` over ``D`` and an indexer naming more distinct history than a buffer holds: the offloaded
    requests' positions from 2 on are left out by layer 0 (every entry -1) and from ``limit`` on by the last
    layer, every accept of all three positions is capped at ``limit``, and every invariant holds from admission
    to the end (the simulator checks each layer's rows, counts and limits against its model, and the cap)."""
    server = build(
        scenario(top_k_of_buffer=top_k_of_buffer, resident_first=False, device_pages=24, host_lag=host_lag),
        accept=lambda uid, i: 3, indexer=scripted_indexer(layout),
    )
    assert server.config.top_k * 3 > server.config.device_buffer_size
    uids = [server.add_request(40, 12), server.add_request(36, 9)]
    requests = [server.requests[uid] for uid in uids]
    steps = 4
    for _ in range(steps):
        before = [request.seq_len for request in requests]
        server.step()
        server.check_invariants()
        assert all(server.coordinator.requests[request.slot].mode == "offloaded" for request in requests)
        first_layer, last_layer = server.last_rows[0], server.last_rows[-1]
        assert bool((first_layer[:, 2:] == -1).all()) and bool((first_layer[:, :2] >= 0).any(dim=2).all())
        assert bool((last_layer[:, limit:] == -1).all()) and bool((last_layer[:, :limit] >= 0).any(dim=2).all())
        assert [request.seq_len - s for request, s in zip(requests, before)] == [limit, limit], (
            "three accepted positions were not capped at the verify limit"
        )
    assert server.left_out_positions == steps * len(requests) * (3 - limit)
    assert server.capped_accepts == steps * len(requests)
    server.drain()
    assert set(server.finished) == set(uids)
