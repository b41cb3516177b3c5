"""Lifecycle fuzzing: random admit / decode / finish / abort / retract sequences, with demotions and
promotions, checking every ownership and content invariant after every operation.

HISPARSE_PROPERTY_EXAMPLES sets the number of random sequences (default 10,000 across the tests).
"""

import os

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hisparse_sglang.config import HiSparseConfig
from hisparse_sglang.testing.sim import SimulatedServer

TOTAL_EXAMPLES = int(os.environ.get("HISPARSE_PROPERTY_EXAMPLES", "10000"))

operation = st.one_of(
    st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 30)),
    st.tuples(st.just("step"), st.integers(1, 4)),
    st.tuples(st.just("finish"), st.integers(0, 7)),
    st.tuples(st.just("abort"), st.integers(0, 7)),
    st.tuples(st.just("retract"), st.integers(0, 7)),
    st.tuples(st.just("readmit")),
)

setup = st.fixed_dictionaries(
    {
        "page_size": st.sampled_from([2, 4]),
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


def build(params) -> SimulatedServer:
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
        max_context=160,
        seed=params["seed"],
        cpu_event_delay_steps=params["event_delay"],
    )


def run(params, operations) -> None:
    server = build(params)
    for op in operations:
        live = sorted(server.requests)
        kind = op[0]
        if kind == "add":
            server.add_request(op[1], op[2])
        elif kind == "step":
            for _ in range(op[1]):
                server.step()
                server.check_invariants()
        elif kind == "readmit":
            server.readmit_retracted()
        elif live:
            uid = live[op[1] % len(live)]
            getattr(server, kind)(uid)
        server.check_invariants()
    server.retracted.clear()
    for uid in sorted(server.requests):
        server.abort(uid)
        server.check_invariants()
    server.check_all_free()


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
    prompts=st.lists(st.tuples(st.integers(8, 60), st.integers(5, 40)), min_size=1, max_size=6),
    steps=st.integers(5, 60),
)
def test_decode_to_completion_under_memory_pressure(params, prompts, steps):
    """Long decodes with more demand than device memory: demotions, promotions, retractions."""
    params = dict(params, device_pages=min(params["device_pages"], 14))
    server = build(params)
    for prompt_len, output_len in prompts:
        server.add_request(prompt_len, output_len)
    for _ in range(steps):
        server.step()
        server.check_invariants()
        server.readmit_retracted()
        server.check_invariants()
    server.retracted.clear()
    for uid in sorted(server.requests):
        server.finish(uid)
    server.check_all_free()
