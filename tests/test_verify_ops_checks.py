"""What the CUDA verify ops (ops/swap_in.py, CudaOps.swap_in_positions / commit_accepted) check before any
launch, on the CPU: the same refusals, with the same messages, as their reference twins, and the same
default group of positions; the CUDA-only refusals (the shared-memory plan of a group's G x top_k entries)
are in tests/test_swap_in_plan.py, the launches in tests/gpu/test_swap_in_positions.py."""

import dataclasses

import pytest
import torch

from hisparse_sglang.ops import reference
from hisparse_sglang.ops.swap_in import commit_row_bytes, verify_top_k_shape
from hisparse_sglang.testing.cases import make_positions_case


def case(positions, page_size=8, top_k=16, buffer_size=64, seed=0):
    return make_positions_case(2, positions, top_k, buffer_size, 16, page_size=page_size, miss_rate=0.5, seed=seed)


def test_the_top_k_shape_is_batch_positions_entries():
    built = case(3)
    assert verify_top_k_shape(built.top_k, built.tables) == (2, 3, 16)
    for bad in (built.top_k[:, 0], built.top_k[:, :0], built.top_k[:, :, :0], built.top_k.unsqueeze(0)):
        with pytest.raises(ValueError, match=r"swap_in_positions: top_k must be int32 \[B, T, K\]"):
            verify_top_k_shape(bad, built.tables)


@pytest.mark.parametrize("positions", [8, 9])
def test_more_positions_than_the_reserved_page_holds_are_refused_like_the_reference(positions):
    built = case(positions, page_size=8)
    with pytest.raises(ValueError) as twin:
        reference.swap_in_positions(*built.clone().args())
    with pytest.raises(ValueError) as cuda:
        verify_top_k_shape(built.top_k, built.tables)
    assert str(cuda.value) == str(twin.value)
    assert f"{positions} verify positions per request, but a buffer's reserved page holds 7" in str(cuda.value)


def test_without_buffers_any_number_of_positions_passes_the_shape_check():
    """The reference twin checks the verify slots only when there are buffers (no offloaded request
    reads them otherwise); so does the CUDA op."""
    built = case(9, page_size=8)
    no_buffers = dataclasses.replace(built.tables, slot_rows=built.tables.slot_rows[:0])
    assert verify_top_k_shape(built.top_k, no_buffers) == (2, 9, 16)


def layers(count, rows, row_bytes):
    return [torch.zeros((rows, row_bytes), dtype=torch.uint8) for _ in range(count)]


def test_commit_row_bytes_and_its_refusals():
    slot_rows = torch.zeros((2, 64 + 8), dtype=torch.int32)
    assert commit_row_bytes(2, slot_rows, 64, layers(3, 10, 656), layers(3, 20, 656)) == 656
    assert commit_row_bytes(7, slot_rows, 64, [], []) is None  # no layers: nothing to launch
    with pytest.raises(ValueError, match="8 verify positions per request, but a buffer's reserved page holds 7"):
        commit_row_bytes(8, slot_rows, 64, layers(1, 10, 656), layers(1, 10, 656))
    with pytest.raises(ValueError, match="2 device layers but 3 host layers"):
        commit_row_bytes(2, slot_rows, 64, layers(2, 10, 656), layers(3, 10, 656))
    with pytest.raises(ValueError, match="device rows of 1152 B but host rows of 656 B"):
        commit_row_bytes(2, slot_rows, 64, layers(1, 10, 1152), layers(1, 10, 656))
    with pytest.raises(ValueError, match="device rows of 40 B but host rows of 40 B; both must be the same multiple"):
        commit_row_bytes(2, slot_rows, 64, layers(1, 10, 40), layers(1, 10, 40))


def test_the_same_layer_mismatch_message_as_the_reference():
    slot_rows = torch.zeros((1, 64 + 8), dtype=torch.int32)
    args = (torch.zeros(1, dtype=torch.int64), torch.ones(1, dtype=torch.int64), torch.ones(1, dtype=torch.int64),
            torch.ones(1, dtype=torch.int32), 2, torch.zeros((1, 8), dtype=torch.int32),
            torch.zeros(9, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), slot_rows, 64)
    with pytest.raises(ValueError) as twin:
        reference.commit_accepted(*args, layers(2, 4, 16), layers(1, 4, 16))
    with pytest.raises(ValueError) as cuda:
        commit_row_bytes(2, slot_rows, 64, layers(2, 4, 16), layers(1, 4, 16))
    assert str(cuda.value) == str(twin.value)


def test_both_twins_choose_the_same_group_of_positions_by_default(monkeypatch):
    """The CUDA op's default group is swap_in_plan.positions_per_group with its GPU's shared memory per block;
    on an H100 or H200 (232,448 B, sm_90's) that is the reference twin's default, so the coordinator passes
    no group and both give the same result."""
    from hisparse_sglang.ops import swap_in as cuda_module
    from hisparse_sglang.ops.swap_in_plan import SM90_SHARED_MEMORY_PER_BLOCK, positions_per_group

    monkeypatch.setattr(cuda_module, "shared_memory_per_block", lambda index=None: SM90_SHARED_MEMORY_PER_BLOCK)
    ops = cuda_module.CudaOps.__new__(cuda_module.CudaOps)  # no GPU here: only the group choice is exercised
    ops.device = torch.device("cuda", 0)
    shapes = [(1, 2048, 4096), (2, 2048, 4096), (2, 2048, 8192), (3, 2048, 6144), (4, 2048, 8192), (4, 1024, 4096),
              (8, 1024, 8192), (4, 16, 64)]
    for positions, top_k, buffer_size in shapes:
        assert ops.positions_group(positions, top_k, buffer_size) == positions_per_group(positions, top_k, buffer_size)
    assert [ops.positions_group(*shape) for shape in shapes] == [1, 2, 1, 1, 1, 4, 2, 4]


@pytest.mark.parametrize("positions", [2, 3])
def test_the_reference_default_group_is_positions_per_group(positions):
    """reference.swap_in_positions without a group == with positions_per_group's (here T: 16 entries fit)."""
    from hisparse_sglang.ops.swap_in_plan import positions_per_group

    built = case(positions, buffer_size=64)
    group = positions_per_group(positions, 16, 64)
    assert group == positions
    default, explicit = built.clone(), built.clone()
    out = reference.swap_in_positions(*default.args())
    assert torch.equal(out, reference.swap_in_positions(*explicit.args(), group=group))
    assert torch.equal(default.slot_tokens, explicit.slot_tokens) and torch.equal(default.device_kv, explicit.device_kv)
