"""The swap-in kernel's shared-memory plan and the launch limits that follow from it, owned here alone.

The kernel (``csrc/swap_in.cuh``) carves its dynamic shared memory at the byte offsets of
:func:`swap_in_plan`, which the op (``ops/swap_in.py``) passes with every launch; config
validation (``config.py``, at startup, before any GPU is touched) and the op (on the GPU it runs
on) check a shape with :func:`check_swap_in_fits`. A shape the kernel cannot run is therefore
rejected when the server starts, naming the key, the limit and the largest value that fits,
instead of failing inside ``cudaFuncSetAttribute`` at the first launch.

The multi-position swap-in of a speculative verify step (``swap_in_positions``) serves a request's ``T``
verify positions in consecutive groups of ``G`` positions, one launch of the same kernel per group on one row
of ``G x top_k`` entries per request (the union of the group's positions), so a launch's plan is
:func:`swap_in_plan` of ``G x top_k`` entries (:func:`swap_in_positions_plan`). ``G`` is the largest count
whose entries fit the launch and the buffer (:func:`positions_per_group`, the one choice both twins make,
``G x top_k <= device_buffer_size`` so that the first group always fits): on sm_90 (227 KiB per block) top_k
2048 gives ``G = 2`` with ``device_buffer_size`` 4096 to 5760 (``T = 4``: two launches) and ``G = 1`` from
6144 up (the plan of 4096 entries needs 236,160 B with 6144 slots). The positions need not fit the buffer
together: where a step's positions name more distinct tokens than it holds, the later positions are left out
and the step accepts fewer drafts (``reference.swap_in_positions``). A shape is refused
(:func:`check_swap_in_positions_fits`) only where one position does not fit, as for the decode swap-in.

Imports the standard library only (torch only inside :func:`shared_memory_per_block`, to query a
GPU), so ``import hisparse_sglang`` stays free of side effects.
"""

from __future__ import annotations

import dataclasses
import functools
import types

from hisparse_sglang.errors import HiSparseConfigError

__all__ = [
    "SwapInPlan",
    "PLAN_FIELDS",
    "SWAP_IN_BLOCK_SIZES",
    "DEFAULT_THREADS",
    "MAX_TOP_K",
    "MAX_DEVICE_BUFFER_SIZE",
    "MAX_VERIFY_POSITIONS",
    "SM90_SHARED_MEMORY_PER_BLOCK",
    "SYNC_COUNTERS_PER_ROW",
    "swap_in_plan",
    "shared_memory_per_block",
    "largest_device_buffer_size",
    "largest_top_k",
    "check_top_k_fits",
    "check_swap_in_fits",
    "swap_in_positions_plan",
    "positions_per_group",
    "check_swap_in_positions_fits",
]

# Thread counts the kernel is instantiated for (csrc/swap_in_binding.cu's switch).
SWAP_IN_BLOCK_SIZES = (256, 512, 1024)
# The op's block size when swap_in_block_size is null: the size the benchmark tables of docs/kernels.md were
# measured with. The sweep does not single it out (benchmarks/bench_swap_in.py sweep, H100,
# benchmarks/results/swap_in_sweep_H100_2026-11-23.json, each batch size's default CTAs per request): 512
# threads were faster in 7 of the 15 cells with misses (every bs 8 cell) and 1024 in 8, by more than 1.5 %
# only at bs 1 with 5 and 20 % misses (1024, ~8 %) and at bs 8 with 5 % (512, 3.3 %); 512 in every hit-only
# cell, by 0.1-0.35 us.
DEFAULT_THREADS = 1024
# Slot ids are int16 in the token -> slot map, the victim list and the slot ages.
MAX_DEVICE_BUFFER_SIZE = 32767
# The largest top_k the binding accepts (csrc/swap_in_config.h kMaxHashBits: the hash table of the
# misses, 2 x top_k entries rounded up to a power of two, is indexed by int16); on sm_90 the
# shared-memory plan caps top_k lower (4096, see largest_top_k).
MAX_TOP_K = 8192
# Verify positions T (--speculative-num-draft-tokens) the CUDA verify swap-in serves per request
# (docs/speculative.md 2.9): T <= 2 at top_k 2048 in one launch (the union of 4096 entries with a buffer of
# 4096 plans 215,424 B), T = 3, 4 in groups of positions (positions_per_group). 4 is the design's range
# (--speculative-num-steps 1 to 3); startup validation refuses a larger T naming this limit.
MAX_VERIFY_POSITIONS = 4
# 227 KiB: cudaDevAttrMaxSharedMemoryPerBlockOptin of every sm_90 GPU (H100, H200), the most
# shared memory one block may opt in to. Used where no GPU is at hand: config validation runs in
# SGLang's main process, which must not initialise CUDA (the schedulers it starts would inherit it).
SM90_SHARED_MEMORY_PER_BLOCK = 232448

# The two histograms of the slot ages (csrc/swap_in_config.h): coarse by age >> 7, fine by age & 127.
COARSE_BUCKETS = 256
FINE_BUCKETS = 128
# A copier's miss list: entry, host row and device row (int32 each) per entry of its chunk
# (csrc/swap_in_config.h kCopierListInts); its staged rows follow it, to the end of the plan.
COPIER_LIST_INTS = 3
_ROLE_ALIGN = 128  # the role's area starts on a 128-byte line (same bank mapping as at offset 0)
# The launch workspace: int32 per batch row through which a row's CTAs claim chunks and hand the plan
# over (the plan flag, the counter word and two uint64 claim words; csrc/swap_in_config.h
# kSyncCountersPerRow).
SYNC_COUNTERS_PER_ROW = 6

# Order of the plan as it travels to the binding (an int64 tensor): csrc/swap_in.cuh SwapInSmemPlan.
PLAN_FIELDS = (
    "hash_bits", "total_bytes", "warp_sums", "selection", "role", "keys", "first", "hash_host_row",
    "hash_device_row", "row_of_slot", "token_of_slot", "entry_state", "slot_hit", "coarse", "fine",
    "miss_hash", "victim_slot", "slot_age", "entry_hash",
)


@dataclasses.dataclass(frozen=True)
class SwapInPlan:
    """Dynamic shared memory of one swap-in CTA: byte offsets of its regions and the total.

    Every CTA has the block-scan scratch (``warp_sums``: uint64 ``[threads / 32 + 1]``) and the
    victim-selection scalars (``selection``: int32 ``[4]``); from ``role`` on, a planner CTA holds
    its tables (the regions below, each named as in the kernel) and a copier CTA its miss list
    (3 int32 per entry of its chunk) followed by staged host rows, as many as fit in ``total_bytes``.
    """

    top_k: int
    buffer_size: int
    threads: int
    hash_bits: int
    offsets: types.MappingProxyType
    total_bytes: int

    def as_ints(self) -> list[int]:
        """The plan in :data:`PLAN_FIELDS` order."""
        values = dict(self.offsets, hash_bits=self.hash_bits, total_bytes=self.total_bytes)
        return [values[name] for name in PLAN_FIELDS]


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@functools.lru_cache(maxsize=256)
def swap_in_plan(top_k: int, buffer_size: int, threads: int | None = None) -> SwapInPlan:
    """The shared-memory plan of a swap-in CTA for ``top_k`` entries, ``buffer_size`` LRU slots
    and ``threads`` per block (None: :data:`DEFAULT_THREADS`); no limit is checked here (see
    :func:`check_swap_in_fits`)."""
    threads = threads or DEFAULT_THREADS
    hash_bits = max(1, (2 * top_k - 1).bit_length())
    hash_size = 1 << hash_bits
    offsets: dict[str, int] = {}
    cursor = 0

    def region(name: str, count: int, element_bytes: int) -> None:
        nonlocal cursor
        cursor = _round_up(cursor, element_bytes)
        offsets[name] = cursor
        cursor += count * element_bytes

    region("warp_sums", threads // 32 + 1, 8)
    region("selection", 4, 4)
    cursor = _round_up(cursor, _ROLE_ALIGN)
    offsets["role"] = cursor
    for name in ("keys", "first", "hash_host_row", "hash_device_row"):
        region(name, hash_size, 4)
    region("row_of_slot", buffer_size, 4)
    region("token_of_slot", buffer_size, 4)
    region("entry_state", top_k, 4)
    region("slot_hit", -(-buffer_size // 32), 4)
    region("coarse", COARSE_BUCKETS, 4)
    region("fine", FINE_BUCKETS, 4)
    region("miss_hash", top_k, 2)
    region("victim_slot", top_k, 2)
    region("slot_age", buffer_size, 2)
    region("entry_hash", top_k, 2)
    # A copier's miss list (entry, host row, device row per entry of a chunk of at most top_k
    # entries rounded up to whole warps) must fit the same area.
    copier_list = offsets["role"] + COPIER_LIST_INTS * 4 * _round_up(top_k, 32)
    total = _round_up(max(cursor, copier_list), 16)
    return SwapInPlan(top_k, buffer_size, threads, hash_bits, types.MappingProxyType(offsets), total)


def shared_memory_per_block(device=None) -> int:
    """The most shared memory one block may use: the GPU's opt-in limit, or sm_90's without one."""
    if device is None:
        return SM90_SHARED_MEMORY_PER_BLOCK
    import torch

    return int(torch.cuda.get_device_properties(device).shared_memory_per_block_optin)


def largest_device_buffer_size(top_k: int, page_size: int, threads: int | None, limit: int) -> int | None:
    """The largest multiple of ``page_size`` that is >= ``top_k`` and whose plan fits ``limit``
    bytes, or None when not even the smallest one fits."""
    def fits(pages: int) -> bool:
        return swap_in_plan(top_k, pages * page_size, threads).total_bytes <= limit

    low, high = -(-top_k // page_size), MAX_DEVICE_BUFFER_SIZE // page_size
    if low > high or not fits(low):
        return None
    while low < high:  # the plan grows with the buffer: bisect over whole pages
        middle = (low + high + 1) // 2
        if fits(middle):
            low = middle
        else:
            high = middle - 1
    return low * page_size


@functools.lru_cache(maxsize=64)
def largest_top_k(page_size: int, threads: int | None, limit: int, buffer_size: int | None = None) -> int:
    """The largest top_k the kernel takes within ``limit`` bytes: with ``buffer_size`` LRU slots
    when given (0 when not even top_k 1 fits them), else with the smallest buffer it could have
    (top_k rounded up to a page). Never above :data:`MAX_TOP_K`, the binding's own limit."""
    if buffer_size is None:
        def fits(top_k: int) -> bool:
            return largest_device_buffer_size(top_k, page_size, threads, limit) is not None
    else:
        def fits(top_k: int) -> bool:
            return top_k <= buffer_size and swap_in_plan(top_k, buffer_size, threads).total_bytes <= limit

    low, high = 0, MAX_TOP_K
    while low < high:  # the plan grows with top_k: bisect
        middle = (low + high + 1) // 2
        if fits(middle):
            low = middle
        else:
            high = middle - 1
    return low


def _where(limit: int, device_name: str | None) -> str:
    if device_name is None:
        return f"the {limit:,} B (227 KiB) per block of an sm_90 GPU (H100, H200)"
    return f"the {limit:,} B per block of this GPU ({device_name})"


def check_top_k_fits(
    top_k: int,
    page_size: int,
    threads: int | None = None,
    buffer_size: int | None = None,
    *,
    limit: int | None = None,
    device_name: str | None = None,
    top_k_origin: str | None = None,
) -> None:
    """HiSparseConfigError, with the whole constraint and the fix, unless some device_buffer_size
    lets the kernel take ``top_k``.

    The message names the value, the largest top_k the kernel takes with this ``page_size`` and
    ``threads`` (and with ``buffer_size``, the device_buffer_size the user set, if given) and
    what to set; a top_k that is the model's index_topk (``top_k_origin``) cannot be lowered, so
    then it says HiSparse cannot serve the model.

    Args:
        threads: swap_in_block_size (None: :data:`DEFAULT_THREADS`).
        buffer_size: device_buffer_size if the user set it (None: its default adapts to top_k).
        limit: shared memory per block (default: sm_90's); ``device_name`` names the GPU it is of.
        top_k_origin: where top_k came from when it is not the user's to change ("the model's index_topk").
    """
    threads = threads or DEFAULT_THREADS
    limit = SM90_SHARED_MEMORY_PER_BLOCK if limit is None else limit
    largest = largest_top_k(page_size, threads, limit)
    if top_k <= largest:
        return
    if largest == 0:
        raise HiSparseConfigError(
            f"the swap-in kernel cannot run on {_where(limit, device_name)}: not even top_k 1 fits its shared memory "
            f"with page_size {page_size} and swap_in_block_size {threads}; serve without HiSparse on this GPU."
        )
    if largest == MAX_TOP_K:
        bound = "the binding's limit: its hash table of misses is indexed by int16"
    else:
        bound = f"the most whose shared memory fits {_where(limit, device_name)}"
    largest_buffer = largest_device_buffer_size(largest, page_size, threads, limit)
    takes = (
        f"with page_size {page_size} and swap_in_block_size {threads}, top_k <= {largest} with "
        f"device_buffer_size <= {largest_buffer} ({bound})"
    )
    if top_k_origin is not None:
        raise HiSparseConfigError(
            f"top_k {_shown_int(top_k)} ({top_k_origin}) is more than the swap-in kernel takes: {takes}. HiSparse "
            f"cannot serve a model that selects more than {largest} tokens per layer and step; serve it without "
            f"HiSparse."
        )
    with_buffer = ""
    if buffer_size is not None and 1 <= buffer_size <= MAX_DEVICE_BUFFER_SIZE:
        fitting = largest_top_k(page_size, threads, limit, buffer_size)
        with_buffer = f"; with device_buffer_size {buffer_size}, " + (f"top_k <= {fitting}" if fitting else "no top_k")
    raise HiSparseConfigError(
        f"top_k ({_shown_int(top_k)}) is more than the swap-in kernel takes: {takes}{with_buffer}. Set top_k <= "
        f"{largest} and remove device_buffer_size (its default fits) or set it <= {largest_buffer}; or remove "
        f"top_k (it defaults to the model's index_topk, which it must equal)."
    )


def _shown_int(value: int) -> str:
    """An integer as a message shows it: its digits, or their count past 30 of them."""
    return str(value) if value < 10**30 else "an integer of more than 30 digits"


def check_swap_in_fits(
    top_k: int,
    buffer_size: int,
    page_size: int,
    threads: int | None = None,
    *,
    limit: int | None = None,
    device_name: str | None = None,
    top_k_origin: str | None = None,
) -> SwapInPlan:
    """The plan of this shape, or HiSparseConfigError naming the key, the limit and the fix: top_k
    (:func:`check_top_k_fits`) when no buffer lets the kernel take it, else device_buffer_size.

    Args:
        threads: swap_in_block_size (None: :data:`DEFAULT_THREADS`).
        limit: shared memory per block (default: sm_90's); ``device_name`` names the GPU it is of.
        top_k_origin: where top_k came from when the user did not set it ("the model's index_topk").
    """
    threads = threads or DEFAULT_THREADS
    limit = SM90_SHARED_MEMORY_PER_BLOCK if limit is None else limit
    check_top_k_fits(top_k, page_size, threads, limit=limit, device_name=device_name, top_k_origin=top_k_origin)
    plan = swap_in_plan(top_k, buffer_size, threads)
    if plan.total_bytes <= limit:
        return plan
    largest = largest_device_buffer_size(top_k, page_size, threads, limit)
    top_k_text = f"top_k {top_k}" + (f" ({top_k_origin})" if top_k_origin else "")
    raise HiSparseConfigError(
        f"device_buffer_size ({buffer_size}) is too large for the swap-in kernel: with {top_k_text} and "
        f"swap_in_block_size {threads} it needs {plan.total_bytes:,} B of GPU shared memory per block, more than "
        f"{_where(limit, device_name)}; use device_buffer_size <= {largest} (the largest multiple of page_size "
        f"{page_size} that fits with this top_k)."
    )


# ---------------------------------------------------------------------------------------------------
# swap_in_positions: the T verify positions of a request, served in consecutive groups of G positions, each
# group as one row of G x top_k entries (one launch per group).


def swap_in_positions_plan(num_positions: int, top_k: int, buffer_size: int, threads: int | None = None) -> SwapInPlan:
    """The shared-memory plan of one ``swap_in_positions`` launch serving ``num_positions`` consecutive verify
    positions of each request (a group of ``G``): the kernel plans their union as one row of ``G x top_k``
    entries, so this is :func:`swap_in_plan` of ``G x top_k`` entries; no limit is checked here."""
    return swap_in_plan(num_positions * top_k, buffer_size, threads)


@functools.lru_cache(maxsize=256)
def positions_per_group(num_positions: int, top_k: int, buffer_size: int, limit: int | None = None) -> int:
    """``G``: how many consecutive verify positions one ``swap_in_positions`` launch serves, the choice both
    twins make when the caller passes no group (``reference.swap_in_positions``, ``CudaOps.swap_in_positions``).

    The largest ``G`` in ``[1, T]`` whose ``G x top_k`` entries fit the ``buffer_size`` (``D``) LRU slots and
    one launch with them: the plan (:func:`swap_in_positions_plan`) within ``limit`` bytes (default: sm_90's
    227 KiB) and ``G x top_k <= MAX_TOP_K``; 1 when not even two positions do. The first group fitting the
    buffer is what makes position 0 always served. The plan is taken with the largest block size
    (:data:`SWAP_IN_BLOCK_SIZES`), whose scan scratch is the largest, so ``G`` fits every block size and
    ``swap_in_block_size`` never changes a result. A pure function of ``(T, top_k, D, limit)``: the CPU
    reference (sm_90's limit) and the CUDA op on an H100 or H200 (the same 232,448 B) choose the same ``G``.
    On sm_90 top_k 2048 gives ``G = 2`` for ``T >= 2`` with ``D`` 4096 to 5760 and ``G = 1`` with ``D``
    from 6144 (the plan of 4096 entries needs 236,160 B there) or below 4096.
    """
    limit = SM90_SHARED_MEMORY_PER_BLOCK if limit is None else limit
    threads = max(SWAP_IN_BLOCK_SIZES)
    group = 1
    for candidate in range(2, num_positions + 1):  # the plan grows with the entries
        entries = candidate * top_k
        if entries > min(MAX_TOP_K, buffer_size) or swap_in_plan(entries, buffer_size, threads).total_bytes > limit:
            break
        group = candidate
    return group


def check_swap_in_positions_fits(
    num_positions: int,
    top_k: int,
    buffer_size: int,
    page_size: int,
    threads: int | None = None,
    *,
    limit: int | None = None,
    device_name: str | None = None,
    group: int | None = None,
) -> SwapInPlan:
    """The plan of one ``swap_in_positions`` launch for ``num_positions`` (``T``) verify positions served in
    groups of ``group`` (``G``; None: :func:`positions_per_group` with this ``limit``): :func:`swap_in_plan` of
    ``G x top_k`` entries; or a typed error naming the values, the limit and the fix.

    One position must fit a launch, which is the decode swap-in's rule (:func:`check_swap_in_fits`: top_k
    within the buffer, the plan within the limit); the verify positions are served one group after another,
    so ``T`` itself is bounded only by a buffer's reserved page (checked with the verify slots).

    Raises:
        HiSparseConfigError: what :func:`check_swap_in_fits` raises for ``top_k`` and ``device_buffer_size``.
        ValueError: an explicit ``group`` outside ``[1, T]`` or whose ``G x top_k`` entries do not fit the
            buffer or a launch with it (naming the largest that does).

    Args:
        threads: swap_in_block_size (None: :data:`DEFAULT_THREADS`).
        limit: shared memory per block (default: sm_90's); ``device_name`` names the GPU it is of.
    """
    threads = threads or DEFAULT_THREADS
    limit = SM90_SHARED_MEMORY_PER_BLOCK if limit is None else limit
    if top_k > buffer_size:
        raise HiSparseConfigError(
            f"device_buffer_size ({buffer_size}) must be at least top_k ({top_k}): a verify position's top-k must fit "
            f"its buffer; set device_buffer_size >= {_round_up(top_k, page_size)}."
        )
    check_swap_in_fits(top_k, buffer_size, page_size, threads, limit=limit, device_name=device_name)
    fitting = positions_per_group(num_positions, top_k, buffer_size, limit)
    if group is None:
        group = fitting
    plan = swap_in_positions_plan(group, top_k, buffer_size, threads)
    if (not 1 <= group <= num_positions or group * top_k > min(MAX_TOP_K, buffer_size)
            or plan.total_bytes > limit):
        raise ValueError(
            f"swap_in_positions: groups of {group} verify positions do not fit: 1 <= group <= {num_positions} "
            f"(num_draft_tokens), group x top_k entries <= device_buffer_size ({buffer_size}), and the plan of "
            f"group x top_k entries must fit {_where(limit, device_name)} with swap_in_block_size {threads}; the "
            f"largest group that fits is {fitting} (positions_per_group)."
        )
    return plan
