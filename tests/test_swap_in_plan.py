"""The swap-in kernel's shared-memory plan and limits: one function, used by config validation (CPU)."""

import pytest

from hisparse_sglang.config import HiSparseConfig
from hisparse_sglang.errors import HiSparseConfigError
from hisparse_sglang.ops.swap_in_plan import (
    PLAN_FIELDS,
    SM90_SHARED_MEMORY_PER_BLOCK,
    SWAP_IN_BLOCK_SIZES,
    check_swap_in_fits,
    check_swap_in_positions_fits,
    largest_device_buffer_size,
    largest_top_k,
    positions_per_group,
    swap_in_plan,
    swap_in_positions_plan,
)


# What each region of the planner must hold (elements, bytes each), independent of the plan's code.
def required_regions(top_k, buffer_size, threads):
    hash_size = 1
    while hash_size < 2 * top_k:
        hash_size *= 2
    hash_size = max(hash_size, 2)
    return {
        "warp_sums": (threads // 32 + 1, 8), "selection": (4, 4),
        "keys": (hash_size, 4), "first": (hash_size, 4), "hash_host_row": (hash_size, 4), "hash_device_row": (hash_size, 4),
        "row_of_slot": (buffer_size, 4), "token_of_slot": (buffer_size, 4), "entry_state": (top_k, 4),
        "slot_hit": ((buffer_size + 31) // 32, 4), "coarse": (256, 4), "fine": (128, 4),
        "miss_hash": (top_k, 2), "victim_slot": (top_k, 2), "slot_age": (buffer_size, 2), "entry_hash": (top_k, 2),
    }


SHAPES = [(1, 1, 256), (7, 64, 512), (100, 256, 1024), (2048, 4096, 1024), (2048, 14272, 256), (4096, 5760, 512),
          (3000, 3008, 1024)]


@pytest.mark.parametrize("top_k,buffer_size,threads", SHAPES)
def test_plan_regions_are_aligned_disjoint_and_inside_the_total(top_k, buffer_size, threads):
    plan = swap_in_plan(top_k, buffer_size, threads)
    spans = []
    for name, (count, element_bytes) in required_regions(top_k, buffer_size, threads).items():
        offset = plan.offsets[name]
        assert offset % element_bytes == 0, f"{name} at {offset} is not {element_bytes}-byte aligned"
        spans.append((offset, offset + count * element_bytes, name))
    spans.sort()
    for (_, end, name), (start, _, following) in zip(spans, spans[1:]):
        assert end <= start, f"{name} overlaps {following}"
    assert spans[-1][1] <= plan.total_bytes and plan.total_bytes % 16 == 0
    assert plan.offsets["role"] % 128 == 0 and plan.offsets["role"] >= plan.offsets["selection"] + 16
    # A copier's miss list (3 int32 per entry of a chunk of up to top_k entries, whole warps) fits too.
    assert plan.offsets["role"] + 12 * (-(-top_k // 32) * 32) <= plan.total_bytes
    assert (1 << plan.hash_bits) >= 2 * top_k
    ints = plan.as_ints()
    assert len(ints) == len(PLAN_FIELDS) and ints[:2] == [plan.hash_bits, plan.total_bytes]


@pytest.mark.parametrize("buffer_size", [14336, 16384])
def test_issue_buffer_sizes_are_rejected_at_config_time_with_the_largest_that_fits(buffer_size):
    with pytest.raises(HiSparseConfigError) as info:
        HiSparseConfig.from_json(f'{{"top_k": 2048, "device_buffer_size": {buffer_size}}}')
    message = str(info.value)
    for fragment in (f"device_buffer_size ({buffer_size})", "232,448 B", "sm_90", "device_buffer_size <= 14272"):
        assert fragment in message, message
    assert len(message) < 500


def test_the_largest_buffer_reported_is_the_largest_that_fits():
    for top_k, threads in [(2048, 1024), (2048, 256), (1024, 512), (4096, 1024), (100, 1024)]:
        largest = largest_device_buffer_size(top_k, 64, threads, SM90_SHARED_MEMORY_PER_BLOCK)
        assert largest % 64 == 0 and largest >= top_k
        assert swap_in_plan(top_k, largest, threads).total_bytes <= SM90_SHARED_MEMORY_PER_BLOCK
        if largest + 64 <= 32767:
            assert swap_in_plan(top_k, largest + 64, threads).total_bytes > SM90_SHARED_MEMORY_PER_BLOCK
        HiSparseConfig(top_k=top_k, device_buffer_size=largest, swap_in_block_size=threads)
    assert largest_device_buffer_size(2048, 64, 1024, SM90_SHARED_MEMORY_PER_BLOCK) == 14272
    assert largest_device_buffer_size(8192, 64, 1024, SM90_SHARED_MEMORY_PER_BLOCK) is None


def test_the_block_size_changes_the_plan_only_by_the_scan_scratch():
    sizes = {threads: swap_in_plan(2048, 4096, threads).offsets["selection"] for threads in SWAP_IN_BLOCK_SIZES}
    assert sizes == {256: 9 * 8, 512: 17 * 8, 1024: 33 * 8}


def test_a_smaller_gpu_is_named_with_its_limit():
    with pytest.raises(HiSparseConfigError) as info:
        check_swap_in_fits(2048, 4096, 64, 1024, limit=101376, device_name="NVIDIA L40S")
    message = str(info.value)
    assert "NVIDIA L40S" in message and "101,376 B" in message and "top_k (2048)" in message
    assert f"top_k <= {largest_top_k(64, 1024, 101376)}" in message


def test_default_buffer_of_a_large_top_k_is_capped_to_what_fits():
    """Nobody set device_buffer_size: its default must not make the config fail."""
    for text, model_topk in [('{"top_k": 4096}', None), ("{}", 4096), ('{"top_k": 3000}', None)]:
        config = HiSparseConfig.from_json(text, model_index_topk=model_topk)
        assert config.top_k <= config.device_buffer_size <= 2 * config.top_k + 64
        assert swap_in_plan(config.top_k, config.device_buffer_size).total_bytes <= SM90_SHARED_MEMORY_PER_BLOCK
    assert HiSparseConfig.from_json('{"top_k": 4096}').device_buffer_size == 5760
    assert HiSparseConfig.from_json('{"top_k": 1024}').device_buffer_size == 2048  # uncapped: 2 x top_k


def test_a_top_k_the_kernel_cannot_run_blames_top_k_and_its_origin():
    with pytest.raises(HiSparseConfigError) as info:
        HiSparseConfig.from_json("{}", model_index_topk=8192)
    message = str(info.value)
    assert "top_k 8192 (the model's index_topk)" in message and "top_k <= 4096" in message
    assert message.startswith("top_k 8192"), message  # not "device_buffer_size (...)", which nobody set
    with pytest.raises(HiSparseConfigError, match=r"top_k \(20000\) is more than the swap-in kernel takes"):
        HiSparseConfig.from_json('{"top_k": 20000}')


def kernel_constants() -> dict[str, int]:
    """The namespace-level ``constexpr`` integers of csrc/primitives.cuh (the warp size, which the
    kernels take to be 32) and csrc/swap_in_config.h, evaluated in order."""
    import re
    from pathlib import Path

    csrc = Path(__file__).resolve().parents[1] / "csrc"
    values: dict[str, int] = {}
    for header in ("primitives.cuh", "swap_in_config.h"):
        text = (csrc / header).read_text()
        for name, expression in re.findall(r"^constexpr\s+[\w ]+?\s+(k\w+)\s*=\s*([^;]+);", text, re.MULTILINE):
            expression = re.sub(r"\b(\d+)(?:ull|ULL|ll|LL|u|U)\b", r"\1", expression)  # C integer suffixes
            values[name] = eval(expression, {}, dict(values))  # integer literals, names above, + - * / << >>
    return values


def test_the_kernel_header_and_python_agree_on_shared_constants():
    """A limit or table size stated on both sides of the binding is the same number on both."""
    from hisparse_sglang.ops import reference
    from hisparse_sglang.ops import swap_in_plan as plan_module

    k = kernel_constants()
    assert k["kAgeCap"] == reference.AGE_CAP
    assert k["kMaxBufferSize"] == plan_module.MAX_DEVICE_BUFFER_SIZE
    assert (k["kCoarseBuckets"], k["kFineBuckets"]) == (plan_module.COARSE_BUCKETS, plan_module.FINE_BUCKETS)
    assert k["kCoarseBuckets"] * k["kFineBuckets"] == k["kAgeCap"] + 1  # every capped age has one bucket pair
    # the hash set of the misses (2 x top_k, a power of two) is indexed by int16
    assert 2 * plan_module.MAX_TOP_K <= 1 << k["kMaxHashBits"] and k["kMaxHashBits"] <= 15
    assert k["kBitmapWordBits"] == 32 and k["kWarpSize"] == 32
    assert k["kCopierListInts"] == plan_module.COPIER_LIST_INTS
    assert k["kSyncCountersPerRow"] == plan_module.SYNC_COUNTERS_PER_ROW
    # The row's workspace: the claim words hold a bit per copier below the close bit, the counter word's
    # fields hold every CTA of a row, and every split the op may choose is one the binding accepts.
    from hisparse_sglang.ops.swap_in import MAX_SPLITS

    bits = k["kCounterBits"]
    assert k["kSyncCountersPerRow"] == 2 + 2 * k["kClaimWords"]
    assert k["kClaimsClosed"] == 1 << k["kCopiersPerClaimWord"] and k["kCopiersPerClaimWord"] <= 63
    assert MAX_SPLITS <= k["kMaxSplits"] == 1 + k["kClaimWords"] * k["kCopiersPerClaimWord"]
    assert k["kMaxSplits"] <= k["kCounterMask"] == (1 << bits) - 1
    assert (k["kLooked"], k["kFinished"], k["kPlannerStarted"]) == (1, 1 << bits, 1 << 30) and 2 * bits < 30
    plan = swap_in_plan(2048, 4096)
    assert plan.offsets["fine"] - plan.offsets["coarse"] == 4 * k["kCoarseBuckets"]
    # A verify position's buffer slot (swap_in_positions, bind_verify_slots, commit_accepted).
    assert k["kVerifySlotBase"] == reference.VERIFY_SLOT_BASE


# --- swap_in_positions: the T verify positions of a request in groups of G, each one row of G x top_k entries --

def test_the_positions_plan_is_the_plan_of_the_union_of_a_group():
    for positions, top_k, buffer_size in [(1, 2048, 4096), (2, 2048, 4096), (4, 1024, 4096), (3, 100, 512)]:
        assert swap_in_positions_plan(positions, top_k, buffer_size, 512) == swap_in_plan(positions * top_k,
                                                                                        buffer_size, 512)
    # docs/speculative.md 2.9: on sm_90's 227 KiB, 2 positions of top_k 2048 fit one launch with D = 4096; with
    # D = 6144 and 8192 (T = 3, 4) only one position does.
    assert swap_in_positions_plan(2, 2048, 4096).total_bytes == 215_424 <= SM90_SHARED_MEMORY_PER_BLOCK
    assert swap_in_positions_plan(1, 2048, 6144).total_bytes == 150_144 <= SM90_SHARED_MEMORY_PER_BLOCK
    assert swap_in_positions_plan(1, 2048, 8192).total_bytes == 170_880 <= SM90_SHARED_MEMORY_PER_BLOCK
    assert swap_in_positions_plan(2, 2048, 6144).total_bytes == 236_160 > SM90_SHARED_MEMORY_PER_BLOCK
    assert swap_in_positions_plan(2, 2048, 8192).total_bytes == 256_896 > SM90_SHARED_MEMORY_PER_BLOCK


def test_positions_per_group_is_the_largest_group_that_fits_the_buffer_and_one_launch():
    # top_k 2048 on sm_90: two positions per launch with D 4096 to 5760 (T = 4: two launches), one from 6144 up.
    assert [positions_per_group(t, 2048, d) for t, d in [(1, 4096), (2, 4096), (2, 5760), (3, 6144), (4, 8192)]] == [
        1, 2, 2, 1, 1]
    assert [positions_per_group(t, 2048, 4096) for t in (3, 4)] == [2, 2]
    assert positions_per_group(2, 2048, 5824) == 1  # 4096 entries need more with a buffer of 5824 slots
    assert [positions_per_group(t, 1024, 4096) for t in (1, 2, 3, 4)] == [1, 2, 3, 4]
    assert positions_per_group(8, 1024, 8192) == 2  # 3072 entries need 246,656 B with 8192 slots
    assert positions_per_group(3, 512, 4096) == 3
    # A group's entries never exceed the buffer (the first group must always fit it) nor MAX_TOP_K.
    assert positions_per_group(4, 2048, 2048) == 1 and positions_per_group(4, 1024, 3072) == 3
    assert positions_per_group(8, 4096, 8192, limit=10**9) == 2
    assert positions_per_group(8, 4096, 32767, limit=10**9) == 2
    assert positions_per_group(4, 2048, 8192, limit=1000) == 1
    for threads in SWAP_IN_BLOCK_SIZES:  # G fits every block size: the block size never changes a result
        for positions, top_k, buffer_size in [(4, 1024, 4096), (8, 1024, 8192), (2, 2048, 5760), (4, 2048, 8192)]:
            group = positions_per_group(positions, top_k, buffer_size)
            plan = swap_in_positions_plan(group, top_k, buffer_size, threads)
            assert plan.total_bytes <= SM90_SHARED_MEMORY_PER_BLOCK and group * top_k <= buffer_size
    # The largest that fits: one more position does not (unless the group is every position).
    for positions, top_k, buffer_size in [(8, 1024, 8192), (4, 2048, 8192), (3, 2048, 6144), (6, 700, 8192),
                                          (4, 2048, 4096)]:
        group = positions_per_group(positions, top_k, buffer_size)
        assert group == positions or (group + 1) * top_k > buffer_size or swap_in_positions_plan(
            group + 1, top_k, buffer_size, 1024).total_bytes > SM90_SHARED_MEMORY_PER_BLOCK


def test_any_number_of_positions_is_served_where_one_position_fits():
    # The positions go group after group and need not fit the buffer together: T = 3, 4 at top_k 2048 take the
    # default buffer of 4096 slots (two launches of two positions) or a larger one (one position per launch).
    for positions in (3, 4):
        assert check_swap_in_positions_fits(positions, 2048, 4096, 64, 1024) == swap_in_plan(4096, 4096, 1024)
        for buffer_size in (positions * 2048, 14272):
            for threads in SWAP_IN_BLOCK_SIZES:
                plan = check_swap_in_positions_fits(positions, 2048, buffer_size, 64, threads)
                assert plan == swap_in_plan(2048, buffer_size, threads) and plan.total_bytes <= SM90_SHARED_MEMORY_PER_BLOCK
    assert check_swap_in_positions_fits(7, 2048, 2048, 64, 1024) == swap_in_plan(2048, 2048, 1024)
    assert check_swap_in_positions_fits(4, 1024, 4096, 64, 256) == swap_in_plan(4096, 4096, 256)
    # An explicit group: the same check, or a ValueError naming the largest that fits.
    assert check_swap_in_positions_fits(4, 1024, 4096, 64, 1024, group=3) == swap_in_plan(3072, 4096, 1024)
    for group, (positions, top_k, buffer_size) in [(0, (4, 1024, 4096)), (5, (4, 1024, 4096)), (2, (4, 2048, 8192)),
                                                   (2, (4, 2048, 2048))]:
        with pytest.raises(ValueError, match="groups of .* positions do not fit.*the largest group that fits is"):
            check_swap_in_positions_fits(positions, top_k, buffer_size, 64, 1024, group=group)


def test_a_buffer_below_top_k_or_beyond_one_position_blames_device_buffer_size():
    with pytest.raises(HiSparseConfigError) as info:
        check_swap_in_positions_fits(2, 2048, 1984, 64, 1024)
    assert "device_buffer_size (1984) must be at least top_k (2048)" in str(info.value)
    assert "device_buffer_size >= 2048" in str(info.value)
    with pytest.raises(HiSparseConfigError) as info:
        check_swap_in_positions_fits(2, 2048, 16384, 64, 1024)
    needed = swap_in_plan(2048, 16384, 1024).total_bytes
    assert "device_buffer_size (16384) is too large for the swap-in kernel" in str(info.value)
    assert f"{needed:,} B" in str(info.value) and "device_buffer_size <= 14272" in str(info.value)
    assert check_swap_in_positions_fits(2, 2048, 14272, 64, 1024).total_bytes <= SM90_SHARED_MEMORY_PER_BLOCK
    with pytest.raises(HiSparseConfigError, match="NVIDIA L40S"):
        check_swap_in_positions_fits(1, 2048, 4096, 64, 1024, limit=101_376, device_name="NVIDIA L40S")
