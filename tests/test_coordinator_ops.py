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
        swap_in=swap_in, copy_rows=reference.copy_rows, backup_newest=reference.backup_newest, bind_rows=reference.bind_rows
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
