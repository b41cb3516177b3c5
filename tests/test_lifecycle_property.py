"""Lifecycle fuzzing: random admit / decode / finish / abort / retract sequences, with demotions and
promotions, checking every ownership and content invariant after every operation, and then that
every admitted request ends within the simulator's progress bound (no stall).

HISPARSE_PROPERTY_EXAMPLES sets the number of random sequences (default 10,000 across the tests).
"""

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hisparse_sglang.config import HiSparseConfig
from hisparse_sglang.testing.sim import SimulatedServer, SimulationStalled

TOTAL_EXAMPLES = int(os.environ.get("HISPARSE_PROPERTY_EXAMPLES", "10000"))

operation = st.one_of(
    st.tuples(st.just("add"), st.integers(1, 40), st.integers(0, 30)),
    st.tuples(st.just("step"), st.integers(1, 4)),
    st.tuples(st.just("finish"), st.integers(0, 7)),
    st.tuples(st.just("abort"), st.integers(0, 7)),
    st.tuples(st.just("retract"), st.integers(0, 7)),
    st.tuples(st.just("readmit")),
)

setup = st.fixed_dictionaries(
    {
        "page_size": st.sampled_from([1, 2, 4]),
        "buffer_pages": st.integers(2, 4),
        "top_k_fraction": st.sampled_from([0.25, 0.5, 1.0]),
        "ratio": st.integers(2, 4),
        "resident_first": st.booleans(),
        "cooldown": st.integers(0, 3),
        "max_switches": st.integers(1, 3),
        "promote_free_fraction": st.sampled_from([0.0, 0.2]),
        "device_pages": st.integers(8, 24),
        "event_delay": st.integers(0, 2),
        "layers": st.integers(1, 2),
        "seed": st.integers(0, 2**16),
    }
)


def build(params, max_context: int = 160) -> SimulatedServer:
    page = params["page_size"]
    buffer_size = page * params["buffer_pages"]
    config = HiSparseConfig(
        top_k=max(1, int(buffer_size * params["top_k_fraction"])),
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
    )


def run(params, operations) -> None:
    server = build(params)
    server.apply(operations)
    server.drain()


@settings(
    max_examples=TOTAL_EXAMPLES // 2,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(params=setup, operations=st.lists(operation, min_size=1, max_size=25))
def test_random_lifecycles_keep_every_invariant(params, operations):
    run(params, operations)


@settings(
    max_examples=TOTAL_EXAMPLES - TOTAL_EXAMPLES // 2,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    params=setup,
    prompts=st.lists(st.tuples(st.integers(8, 60), st.integers(0, 40)), min_size=1, max_size=6),
)
def test_decode_to_completion_under_memory_pressure(params, prompts):
    """Long decodes with more demand than device memory (demotions, promotions, retractions), run to
    the end: every submitted request finishes (or is rejected as too large for an idle server)."""
    params = dict(params, device_pages=min(params["device_pages"], 14))
    server = build(params)
    uids = [server.submit(prompt_len, output_len) for prompt_len, output_len in prompts]
    server.drain()
    assert set(uids) == set(server.finished) | set(server.rejected)
    for uid, (prompt_len, output_len) in zip(uids, prompts):
        # rejected at once exactly when too large; later only after a retraction made its prompt too long
        too_large = not server.fits_when_idle(prompt_len, output_len)
        assert (server.rejected.get(uid) == "too large") == too_large
        assert server.rejected.get(uid) in (None, "too large", "outgrew the GPU pool")


def regression_setup(**overrides):
    params = dict(
        page_size=4, buffer_pages=2, top_k_fraction=0.5, ratio=2, resident_first=True, cooldown=0, max_switches=1,
        promote_free_fraction=0.0, device_pages=12, event_delay=0, layers=1, seed=0,
    )
    params.update(overrides)
    return params


# The stalls of issue #18, each of which made the simulator wait (or fail) forever.
STALLS = {
    # a request that must be demoted at its first step waits for its staging copy, whose event
    # needs decode steps that never ran (nothing else was decoding)
    "staging_event_without_decode": (dict(resident_first=False, event_delay=2), 160, [(30, 5)]),
    # a zero-output request that exactly fills the host pool was retracted at its first step and
    # readmitted, forever
    "zero_output_fills_host_pool": (dict(device_pages=12, ratio=1), 160, [(44, 0)]),
    # a prompt of the full context with zero output decoded past the context (IndexError)
    "full_context_zero_output": (dict(device_pages=12), 32, [(32, 0), (31, 1)]),
    # page size 1: the second prefill chunk ended before the first
    "page_size_one_chunks": (dict(page_size=1, device_pages=24), 64, [(3, 2), (5, 1), (20, 3)]),
    # a retracted request whose prompt (prompt + its output so far) outgrew the GPU pool
    "retracted_past_the_gpu_pool": (dict(device_pages=9, ratio=4, event_delay=1), 160, [(28, 12), (28, 12)]),
}


@pytest.mark.parametrize("name", sorted(STALLS))
def test_issue_stalls_end_within_the_bound(name):
    overrides, max_context, prompts = STALLS[name]
    server = build(regression_setup(**overrides), max_context=max_context)
    uids = [server.submit(prompt_len, output_len) for prompt_len, output_len in prompts]
    server.drain()
    assert set(uids) == set(server.finished) | set(server.rejected)
    assert set(uids) & set(server.finished), "nothing finished"


def test_a_stalled_run_is_reported_with_what_is_left():
    """A request whose staging copy does not complete within the allowed steps is reported, not waited for."""
    server = build(regression_setup(resident_first=False, event_delay=1000))
    server.submit(30, 5)
    assert server.progress_bound() >= (5 + 3) * 1003
    with pytest.raises(SimulationStalled, match=r"requests did not end within 50 steps: live \[uid 1 staging 30/35\]"):
        server.run_until_idle(max_steps=50)
