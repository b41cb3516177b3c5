"""The coordinator hands the configured launch parameters to the swap-in op."""

import types

import pytest

from hisparse_sglang.config import HiSparseConfig
from hisparse_sglang.ops import reference
from hisparse_sglang.testing.sim import SimulatedServer


def recording_ops(calls: list):
    def swap_in(*args, **kwargs):
        calls.append(kwargs.get("threads"))
        return reference.swap_in(*args, **kwargs)

    return types.SimpleNamespace(
        swap_in=swap_in, copy_rows=reference.copy_rows, copy_row_runs=reference.copy_row_runs,
        backup_newest=reference.backup_newest, bind_rows=reference.bind_rows,
    )


@pytest.mark.parametrize("block_size", [None, 256, 1024])
def test_swap_in_block_size_reaches_the_op(block_size):
    config = HiSparseConfig(top_k=8, device_buffer_size=16, page_size=4, swap_in_block_size=block_size)
    calls: list = []
    server = SimulatedServer(config, layer_num=2, device_pages=32, ops=recording_ops(calls))
    server.add_request(40, 3)
    for _ in range(3):
        server.step()
    assert calls, "the decode steps never called swap_in"
    assert set(calls) == {block_size}


def test_copies_beside_the_forward_take_a_capped_grid_and_the_ones_it_waits_for_do_not(row_off_the_gpu):
    """Staging a prefill to the host by ``copy_rows`` (a row not on the GPU, forced here) and promoting a
    request run on their own streams while the forward runs: they get ``max_blocks=BACKGROUND_COPY_BLOCKS``
    (uncapped, the CUDA copy would hold every SM for its whole length); no other copy is capped."""
    import inspect

    from hisparse_sglang.coordinator.core import BACKGROUND_COPY_BLOCKS

    calls: list = []

    def copy_rows(*args, max_blocks=0, **kwargs):
        calls.append((inspect.stack()[1].function, max_blocks))
        return reference.copy_rows(*args, max_blocks=max_blocks, **kwargs)

    ops = types.SimpleNamespace(swap_in=reference.swap_in, copy_rows=copy_rows, copy_row_runs=reference.copy_row_runs,
                                backup_newest=reference.backup_newest,
                                bind_rows=reference.bind_rows)
    config = HiSparseConfig(top_k=8, device_buffer_size=16, page_size=4, host_to_device_ratio=4,
                            switch_cooldown_steps=0, promote_free_fraction=0.0)
    server = SimulatedServer(config, layer_num=2, device_pages=24, ops=ops)
    uids = [server.add_request(40, 100) for _ in range(3)]  # the pool holds one of them resident
    for _ in range(3):
        server.step()
    server.finish(uids[2])  # the resident one: its pages let an offloaded one be promoted
    for _ in range(3):
        server.step()
    assert ("_enqueue", BACKGROUND_COPY_BLOCKS) in calls  # PrefillStaging._enqueue
    assert ("_start_promotions", BACKGROUND_COPY_BLOCKS) in calls, f"no promotion copy: {calls}"
    capped = {name for name, blocks in calls if blocks}
    assert capped == {"_enqueue", "_start_promotions"}, calls
    assert ("_complete_promotion", 0) in calls  # the tail decoded meanwhile: the next step reads it
