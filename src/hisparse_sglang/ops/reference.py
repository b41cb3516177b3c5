"""Pure-PyTorch reference twins of the CUDA kernels: the executable specification.

The CUDA kernels in ``csrc/`` must produce bit-identical outputs and table updates for every
input that satisfies the documented preconditions. The code favours clarity over speed.

Names used below: ``B`` batch rows, ``K`` top-k, ``R`` request slots, ``C`` context capacity per
request slot, ``NB`` device buffers, ``D`` LRU slots per buffer, ``P`` page size.
"""

from __future__ import annotations

from typing import Sequence

import torch

from hisparse_sglang.ops.swap_in_plan import positions_per_group
from hisparse_sglang.ops.tables import SwapInTables

__all__ = ["swap_in", "copy_rows", "copy_row_runs", "backup_newest", "bind_rows", "AGE_CAP", "BIND_BUFFER_SLOT"]


AGE_CAP = 32767
"""Ages (steps since a slot's last use) are capped here: older slots count as this old."""

BIND_BUFFER_SLOT = -2
"""Bind kind of an offloaded request's new token: slot ``D`` of its buffer."""


def swap_in(
    top_k: torch.Tensor,
    seq_lens: torch.Tensor,
    req_pool_indices: torch.Tensor,
    num_real_reqs: torch.Tensor,
    tables: SwapInTables,
    out: torch.Tensor | None = None,
    counters: torch.Tensor | None = None,
    *,
    splits: int | None = None,
    threads: int | None = None,
) -> torch.Tensor:
    """Make one layer's top-k tokens resident on the GPU and return their device rows.

    Args:
        top_k: int32 ``[B, K]``, token positions chosen by the indexer; -1 is padding. Entries
            outside ``[0, seq_len)`` are treated as padding too.
        seq_lens: int32/int64 ``[B]``, tokens of each request including the one being decoded,
            so the newest token is at position ``seq_len - 1``.
        req_pool_indices: int32/int64 ``[B]``, the request slot ``r`` of each batch row.
        num_real_reqs: int32 ``[1]``, batch rows ``>= num_real_reqs[0]`` are CUDA-graph padding:
            their output row is all -1 and nothing else changes.
        tables: the layer's :class:`SwapInTables`. ``req_to_token`` gives each position's logical
            location, which is also its host row; ``buffer_of_req`` -1 means the request is resident
            (every token has a device row in ``device_row_of_loc``); ``slot_tokens``, ``slot_stamps``
            (the ``seq_len`` of the request's last call that used each slot: its LRU clock) and
            ``token_slot`` (the inverse of ``slot_tokens``) are updated in place; missed tokens are
            copied from ``host_kv`` (read only) into ``device_kv``.
        out: optional int32 ``[B, K]`` to write into.
        counters: optional int64 ``[2]``, incremented in place for offloaded rows by the number of
            valid non-newest entries looked up (``[0]``) and of distinct misses copied (``[1]``).
        splits, threads: launch parameters of the CUDA twin (CTAs per request, threads per
            block); they do not change the result and are ignored here.

    Returns:
        int32 ``[B, K]``: the device row of every top-k entry, -1 for padding.

    Semantics of a real batch row ``b`` with request ``r``, length ``s``, buffer ``buf``:

    * Resident (``buf == -1``): entry ``t`` maps to ``device_row_of_loc[req_to_token[r, t]]``.
      Nothing is copied or updated.
    * Offloaded: entries equal to the newest position ``s - 1`` map to ``slot_rows[buf, D]``.
      Every other valid entry ``t`` is looked up in ``token_slot[buf, t]``:

      - Hits: the slot keeps its token, its stamp becomes ``s``; the entry maps to the slot's row.
      - Misses: the distinct tokens no slot holds, ordered by their first occurrence in ``top_k``;
        ``m`` of them.
      - Victims: of the slots no entry hit, the ``m`` with the largest key
        ``(min(max(s - stamp, 0), AGE_CAP), -slot)``: the least recently used, lower slot first
        among equals. Let ``A`` be the smallest age among them. The victims older than ``A``
        come first, by slot; then those of age ``A``, by slot.
      - The ``k``-th miss goes to the ``k``-th victim: the victim's old token leaves
        ``token_slot``, its host row ``req_to_token[r, t]`` is copied to the victim's device
        row, and the victim's token, stamp and ``token_slot`` entry become ``t``, ``s``, victim.

    Preconditions (not checked by the kernel): ``K <= D``; ``token_slot[buf]`` is the inverse of
    ``slot_tokens[buf]`` (``token_slot[buf, t] == j`` iff ``slot_tokens[buf, j] == t``); every
    position ``< s - 1`` of an offloaded request has been written to its host row; slot rows are
    distinct; requests in a batch are distinct.
    """
    req_to_token, device_row_of_loc, buffer_of_req, slot_rows = (
        tables.req_to_token, tables.device_row_of_loc, tables.buffer_of_req, tables.slot_rows
    )
    slot_tokens, slot_stamps, token_slot = tables.slot_tokens, tables.slot_stamps, tables.token_slot
    batch, num_top_k = top_k.shape
    buffer_size = slot_tokens.shape[1]
    if out is None:
        out = torch.empty((batch, num_top_k), dtype=torch.int32, device=top_k.device)
    out.fill_(-1)
    num_real = int(num_real_reqs.reshape(-1)[0])
    for b in range(min(batch, num_real)):
        req = int(req_pool_indices[b])
        seq_len = int(seq_lens[b])
        tokens = top_k[b].to(torch.int64)
        valid = (tokens >= 0) & (tokens < seq_len)
        buf = int(buffer_of_req[req])
        if buf < 0:
            locs = req_to_token[req, tokens[valid]].to(torch.int64)
            out[b, valid] = device_row_of_loc[locs].to(torch.int32)
            continue

        newest = seq_len - 1
        is_newest = valid & (tokens == newest)
        out[b, is_newest] = slot_rows[buf, buffer_size]
        other_index = torch.nonzero(valid & ~is_newest).reshape(-1)
        if counters is not None:
            counters[0] += other_index.numel()
        if other_index.numel() == 0:
            continue
        other_tokens = tokens[other_index]
        found = token_slot[buf, other_tokens].to(torch.int64)
        hit_slots = torch.unique(found[found >= 0])
        slot_stamps[buf, hit_slots] = seq_len

        missed = other_tokens[found < 0]
        missed_index = other_index[found < 0]
        if missed.numel() > 0:
            distinct, inverse = torch.unique(missed, return_inverse=True)
            first_seen = torch.full((distinct.numel(),), num_top_k, dtype=torch.int64, device=tokens.device)
            first_seen.scatter_reduce_(0, inverse, missed_index, reduce="amin")
            misses = distinct[torch.argsort(first_seen)]  # first-occurrence order
            num_miss = misses.numel()
            if counters is not None:
                counters[1] += num_miss
            candidate = torch.ones(buffer_size, dtype=torch.bool, device=tokens.device)
            candidate[hit_slots] = False
            slots = torch.nonzero(candidate).reshape(-1)
            if num_miss > slots.numel():
                raise ValueError(
                    f"request slot {req}: {num_miss} misses but only {slots.numel()} slots not hit "
                    f"(top_k must not exceed device_buffer_size)."
                )
            _place_misses(tables, buf, req, seq_len, misses, slots)

        rows = slot_rows[buf, token_slot[buf, other_tokens].to(torch.int64)]
        out[b, other_index] = rows
    out[min(batch, num_real) :] = -1
    return out


def copy_rows(
    src_layers: Sequence[torch.Tensor],
    dst_layers: Sequence[torch.Tensor],
    src_rows: torch.Tensor,
    dst_rows: torch.Tensor,
    *,
    max_blocks: int = 0,
) -> None:
    """For every layer ``l``: ``dst_layers[l][dst_rows[i]] = src_layers[l][src_rows[i]]``.

    Args:
        src_layers, dst_layers: one tensor per layer, rows along dim 0, identical row layout
            (host tensors pinned, device tensors on the GPU; any direction).
        src_rows, dst_rows: integer ``[n]``; ``dst_rows`` distinct.
        max_blocks: the CUDA twin's cap on its grid (how much of the GPU the copy may occupy; 0: its default,
            four CTAs per SM);
            the result does not depend on it.
    """
    if len(src_layers) != len(dst_layers):
        raise ValueError(f"{len(src_layers)} source layers but {len(dst_layers)} destination layers.")
    if src_rows.numel() != dst_rows.numel():
        raise ValueError(f"{src_rows.numel()} source rows but {dst_rows.numel()} destination rows.")
    if src_rows.numel() == 0:
        return
    for src, dst in zip(src_layers, dst_layers):
        src_index = src_rows.to(device=src.device, dtype=torch.int64)
        dst_index = dst_rows.to(device=dst.device, dtype=torch.int64)
        dst[dst_index] = src[src_index].to(dst.device)


def copy_row_runs(src_layers: Sequence[torch.Tensor], dst_layers: Sequence[torch.Tensor], runs: torch.Tensor) -> None:
    """For every run ``(s, d, n)`` of ``runs`` and every layer: rows ``[s, s + n)`` of the source layer to rows
    ``[d, d + n)`` of its destination layer (the CUDA twin: by the copy engines, one ``cudaMemcpyAsync`` each).

    Args:
        src_layers, dst_layers: as :func:`copy_rows`'s (between the GPU and pinned host memory on a GPU).
        runs: int64 ``[R, 3]`` on the CPU (first source row, first destination row, rows), each run non-empty
            and within both layers; destination runs do not overlap.

    Raises:
        ValueError: the layer lists differ in length, ``runs`` is not ``[R, 3]``, or a run is empty or leaves
            a layer (naming the run).
    """
    if len(src_layers) != len(dst_layers):
        raise ValueError(f"{len(src_layers)} source layers but {len(dst_layers)} destination layers.")
    if runs.dim() != 2 or runs.shape[1] != 3:
        raise ValueError(f"runs must be int64 [R, 3] (first source row, first destination row, rows); got {list(runs.shape)}.")
    if not src_layers:
        return
    src_capacity, dst_capacity = src_layers[0].shape[0], dst_layers[0].shape[0]
    spans = runs.tolist()
    for index, (src_row, dst_row, count) in enumerate(spans):
        if count <= 0 or src_row < 0 or dst_row < 0 or src_row + count > src_capacity or dst_row + count > dst_capacity:
            raise ValueError(
                f"run {index} (first source row {src_row}, first destination row {dst_row}, rows {count}) must be "
                f"non-empty and within {src_capacity} source and {dst_capacity} destination rows."
            )
    for src_row, dst_row, count in spans:
        for src, dst in zip(src_layers, dst_layers):
            dst.narrow(0, dst_row, count).copy_(src.narrow(0, src_row, count), non_blocking=True)


def backup_newest(
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    num_real_reqs: torch.Tensor,
    req_to_token: torch.Tensor,
    device_row_of_loc: torch.Tensor,
    device_kv: torch.Tensor,
    host_kv: torch.Tensor,
    *,
    fence_system: bool = False,
) -> None:
    """Back up one layer's newest token of every request: ``host_kv[loc] = device_kv[row]``.

    For each real batch row ``b`` (``b < num_real_reqs[0]``) the newest token is at position
    ``seq_lens[b] - 1`` of request slot ``req_pool_indices[b]``; its host row is its logical
    location ``loc = req_to_token[slot, position]`` and its device row ``device_row_of_loc[loc]``.
    Tokens without a device row (0) are skipped. The forward calls this per layer after it wrote
    the layer's new KV, so the host pool holds every token a step has written once the step ends.

    Args:
        req_pool_indices: int32/int64 ``[B]``.
        seq_lens: int32/int64 ``[B]``, lengths including the newest token.
        num_real_reqs: int32 ``[1]``.
        req_to_token, device_row_of_loc: as in :class:`SwapInTables`.
        device_kv: ``[rows, ...]`` one layer's device rows.
        host_kv: ``[N, ...]`` the same layer's host rows, same row layout (written).
        fence_system: the CUDA twin makes its stores visible system-wide before the kernel ends
            (the writer of a host pool other processes read, memory/shared_host_pool.py); the
            stores here are the host's own, so there is nothing to do.
    """
    real = min(int(num_real_reqs.reshape(-1)[0]), req_pool_indices.numel())
    if real <= 0:
        return
    slots = req_pool_indices[:real].to(torch.int64)
    positions = seq_lens[:real].to(torch.int64) - 1
    valid = positions >= 0
    locs = req_to_token[slots[valid], positions[valid]].to(torch.int64)
    rows = device_row_of_loc[locs].to(torch.int64)
    on_device = rows > 0
    locs, rows = locs[on_device], rows[on_device]
    host_kv[locs.to(host_kv.device)] = device_kv[rows.to(device_kv.device)].to(host_kv.device)


def bind_rows(
    plan: torch.Tensor,
    new_locs: torch.Tensor,
    new_pages: torch.Tensor,
    device_row_of_loc: torch.Tensor,
    buffer_of_req: torch.Tensor,
    slot_rows: torch.Tensor,
    buffer_size: int,
    page_size: int,
) -> None:
    """Bind the new tokens of a decode step that need it to the device rows their KV goes to.

    Entry ``i`` is the new token of batch row ``b = plan[0, i]`` (request slot ``plan[1, i]``),
    at location ``loc = new_locs[b]``. By kind ``plan[2, i]``:

    * ``k >= 0``: the new token starts a page of a resident request: every location of its
      logical page, ``loc + j`` for ``j < page_size``, is mapped to row ``j`` of device page
      ``new_pages[k]``, so the page's later tokens need no binding;
    * :data:`BIND_BUFFER_SLOT`: ``device_row_of_loc[loc]`` becomes slot ``D`` of the request's
      buffer (an offloaded request).

    A resident request's token that continues its page is not in the plan: its location was
    mapped when the page started (or when the request became resident).

    Args:
        plan: int64 ``[3, n]``: batch row, request slot, kind; batch rows distinct.
        new_locs: int64 ``[B]``, the logical location of each batch row's new token; page starts
            for the rows of kind ``>= 0``.
        new_pages: int64 ``[pages]``, device page ids the kinds ``>= 0`` index.
        device_row_of_loc, buffer_of_req, slot_rows: as in :func:`swap_in`.
        buffer_size: ``D``.
        page_size: ``P``.
    """
    batch_rows, slots, kinds = plan.to(torch.int64)
    locs = new_locs.to(torch.int64)[batch_rows]
    on_buffer = kinds == BIND_BUFFER_SLOT
    if bool(on_buffer.any()):
        newest_rows = _newest_slot_rows(slots[on_buffer], buffer_of_req, slot_rows, buffer_size)
        device_row_of_loc[locs[on_buffer]] = newest_rows.to(device_row_of_loc.dtype)
    starts = kinds >= 0
    if bool(starts.any()):
        offsets = torch.arange(page_size, dtype=torch.int64, device=locs.device)
        page_locs = (locs[starts].reshape(-1, 1) + offsets).reshape(-1)
        first_rows = new_pages.to(torch.int64)[kinds[starts]] * page_size
        page_rows = (first_rows.reshape(-1, 1) + offsets).reshape(-1)
        device_row_of_loc[page_locs] = page_rows.to(device_row_of_loc.dtype)


def _newest_slot_rows(
    slots: torch.Tensor, buffer_of_req: torch.Tensor, slot_rows: torch.Tensor, buffer_size: int
) -> torch.Tensor | None:
    """Row of slot ``D`` (the newest token) of each request's buffer, int64; any row for a request
    without a buffer; None when there are no buffers at all."""
    if not slot_rows.shape[0]:
        return None
    buffer_ids = buffer_of_req[slots].to(torch.int64).clamp(min=0)
    return slot_rows[buffer_ids, buffer_size].to(torch.int64)


# ---------------------------------------------------------------------------------------------------
# Speculative decoding (EAGLE / NextN MTP, linear drafts): one target-verify forward asks, per request,
# for the top-k of ``T`` query positions at once (docs/speculative.md). Names used below besides the
# ones of the module docstring: ``T`` verify positions per request (``--speculative-num-draft-tokens``),
# ``s`` a request's committed length: positions ``[0, s)`` hold accepted KV, ``s - 1`` is the newest
# accepted token, and the verify writes the KV of positions ``s .. s + T - 1``.

__all__ += ["swap_in_positions", "bind_verify_slots", "verify_page_table", "commit_accepted", "cap_accepted",
            "VERIFY_SLOT_BASE", "NO_VERIFY_LIMIT"]

VERIFY_SLOT_BASE = 1
"""Verify position ``j`` of an offloaded request lives in buffer slot ``D + VERIFY_SLOT_BASE + j``:
slot ``D`` keeps the newest accepted token, the reserved page's other ``P - 1`` slots take the
verify positions, so ``T <= P - 1``."""


NO_VERIFY_LIMIT = 2**31 - 1
"""``verify_limit`` of a batch row whose every verify position is served (csrc ``kNoVerifyLimit``)."""


def _verify_slots_available(slot_rows: torch.Tensor, buffer_size: int) -> int:
    """How many verify positions the reserved page of a buffer holds (``P - 1``)."""
    return slot_rows.shape[1] - buffer_size - VERIFY_SLOT_BASE


def _check_verify_positions(num_positions: int, slot_rows: torch.Tensor, buffer_size: int) -> None:
    available = _verify_slots_available(slot_rows, buffer_size)
    if not 1 <= num_positions <= max(available, 0):
        raise ValueError(
            f"{num_positions} verify positions per request, but a buffer's reserved page holds {available} "
            f"(page size - 1); speculative decoding with HiSparse needs 1 <= --speculative-num-draft-tokens "
            f"<= {available}."
        )


def swap_in_positions(
    top_k: torch.Tensor,
    seq_lens: torch.Tensor,
    req_pool_indices: torch.Tensor,
    num_real_reqs: torch.Tensor,
    tables: SwapInTables,
    out: torch.Tensor | None = None,
    counters: torch.Tensor | None = None,
    verify_limit: torch.Tensor | None = None,
    *,
    group: int | None = None,
    resident_rows: bool = False,
    splits: int | None = None,
    threads: int | None = None,
) -> torch.Tensor:
    """One layer's swap-in for a target-verify forward: every request asks for ``T`` query positions.

    Args:
        top_k: int32 ``[B, T, K]``: row ``[b, j]`` holds the token positions the indexer chose for
            query position ``j`` of batch row ``b`` (the token at position ``s + j``); -1 is padding.
            Entries outside ``[0, s + j]`` (the causal range of that query) are padding too.
        seq_lens: int32/int64 ``[B]``: each request's committed length ``s`` (not the per-query
            lengths ``s + j + 1`` SGLang's attention metadata holds).
        req_pool_indices: int32/int64 ``[B]``: the request slot of each batch row; distinct.
        num_real_reqs: int32 ``[1]``: batch rows ``>= num_real_reqs[0]`` are CUDA-graph padding: all
            of their outputs are -1 and nothing else changes.
        tables: the layer's :class:`SwapInTables`, as for :func:`swap_in`; ``slot_rows`` must have room
            for ``T`` verify slots after slot ``D`` (``T <= P - 1``).
        out: optional int32 ``[B, T, K]`` to write into.
        counters: optional int64 ``[2]``: incremented for offloaded rows by the number of history
            entries looked up (``[0]``, every served position counted) and of misses copied (``[1]``:
            each group's distinct placed misses, so a token is copied once however many positions of a
            group missed it, and a token an earlier group copied is a later group's hit).
        verify_limit: optional int32 ``[>= B]``, read and lowered in place: per batch row, the first
            query position not served this step (:data:`NO_VERIFY_LIMIT` when every one is; the verify
            step keeps one per batch row across the layers of a forward and :func:`cap_accepted` resets
            it). None: every position may be served (a local tensor).
        group: ``G``, positions per group (below); None: ``swap_in_plan.positions_per_group(T, K, D)``,
            the largest group whose ``G x K`` entries fit one launch of the CUDA twin on sm_90 and the
            ``D`` LRU slots, which is what the CUDA twin chooses by default too (top_k 2048: ``G = 2``
            with ``D`` 4096 to 5760, ``G = 1`` with ``D`` of 6144 and more).
        resident_rows: a resident request's entries are its device rows already (SGLang's fused top-k
            mapped the positions through :func:`verify_page_table`): they are passed through unchanged, -1
            included. An offloaded request's entries are positions either way.
        splits, threads: launch parameters of the CUDA twin; they never change the result (ignored here).

    Returns:
        int32 ``[B, T, K]``: the device row of every entry, -1 for padding and for every entry of a
        position that was not served. Entries of one request that name the same token get the same
        row in every served position.

    Semantics of a real batch row ``b`` with request ``r``, committed length ``s``, buffer ``buf``:

    * Resident (``buf == -1``): every valid entry ``t`` maps to
      ``device_row_of_loc[req_to_token[r, t]]``, the verify positions ``t >= s`` included (their
      pages are bound before the forward); with ``resident_rows`` every entry is its own output. Nothing
      is copied or updated; ``verify_limit`` is not read.
    * Offloaded: the positions are served in consecutive groups of ``G`` positions (``0 .. G - 1``,
      ``G .. 2G - 1``, ...; the last may be shorter), one group after another. A group's positions at
      or past the row's limit (``verify_limit[b]`` when the group starts) are padding. For the others,
      by the entry's token ``t`` (valid for position ``j``: ``0 <= t <= s + j``):

      - verify tokens ``t >= s``: ``slot_rows[buf, D + 1 + (t - s)]`` (:func:`bind_verify_slots`
        bound their locations there, so the forward wrote their KV into these rows);
      - the newest accepted token ``t == s - 1``: ``slot_rows[buf, D]``;
      - history ``t < s - 1``, the group's entries together in position-major order (its first
        position's entries first): hits keep their slot and take stamp ``s``; the misses are the
        distinct tokens no slot holds, in first occurrence order, each copied once from its host row.
        The slots a miss may take (evictable) are those no entry of the group hit and, for every group
        but the first, whose stamp is not ``s``: a later group never evicts a row an earlier group of
        the call returned (those carry stamp ``s``). Of the evictable slots, the misses take the least
        recently used, as :func:`swap_in` chooses them.
      - **When the misses outnumber the evictable slots** (the positions' history holds more distinct
        tokens than ``D``): let ``j*`` be the position of the first miss beyond them (of rank
        ``evictable``, counting from 0). Only the misses first seen at positions before ``j*`` are
        placed; position ``j*`` and every later position are not served: every entry of them is -1
        (their hits keep stamp ``s``), and ``verify_limit[b]`` becomes ``min(verify_limit[b], j*)``,
        so later groups and later layers of the forward serve none of them. The first group always
        fits (``G x K <= D``): position 0 is always served. The caller caps the step's accepted
        positions at the limit (:func:`cap_accepted`): a position not served in some layer has no
        valid attention output, and a later position may read its KV.

      A token an earlier group copied is a hit for a later group (copied once overall); a token the
      buffer held that an earlier group's misses evicted (no position of that group named it) is a later
      group's miss. With ``G = T`` (one group) this is the union of every position at once.

    Preconditions (as :func:`swap_in`'s, plus): slot ``D`` holds position ``s - 1``; every position
    ``< s - 1`` is on its host row. A stamp equal to ``s`` before the call (a previous call of the same
    committed length, which a verify that accepts its root never leaves) only makes fewer slots evictable.

    Raises:
        ValueError: ``T`` exceeds the verify slots of a buffer, ``group`` is outside ``[1, T]``, or the first
            group's history does not fit the buffer (a precondition ``G x K <= D`` guarantees; the CUDA twin
            refuses ``G x K > D`` before any launch).
    """
    batch, num_positions, num_top_k = top_k.shape
    buffer_size = tables.slot_tokens.shape[1]
    if tables.slot_rows.shape[0]:
        _check_verify_positions(num_positions, tables.slot_rows, buffer_size)
    if group is None:
        group = positions_per_group(num_positions, num_top_k, buffer_size)
    elif not 1 <= group <= num_positions:
        raise ValueError(f"swap_in_positions: group {group} outside [1, {num_positions}] (the verify positions).")
    if out is None:
        out = torch.empty((batch, num_positions, num_top_k), dtype=torch.int32, device=top_k.device)
    if verify_limit is None:
        verify_limit = torch.full((batch,), NO_VERIFY_LIMIT, dtype=torch.int32, device=top_k.device)
    out.fill_(-1)
    num_real = min(int(num_real_reqs.reshape(-1)[0]), batch)
    # Position j of the request attends to positions [0, s + j]: its causal limit.
    offsets = torch.arange(num_positions, dtype=torch.int64, device=top_k.device).reshape(-1, 1)
    for b in range(num_real):
        req = int(req_pool_indices[b])
        committed = int(seq_lens[b])
        tokens = top_k[b].to(torch.int64)  # [T, K]
        valid = (tokens >= 0) & (tokens <= committed + offsets)
        buf = int(tables.buffer_of_req[req])
        if buf < 0 and resident_rows:
            out[b] = top_k[b]
            continue
        if buf < 0:
            locs = tables.req_to_token[req, tokens[valid]].to(torch.int64)
            out[b][valid] = tables.device_row_of_loc[locs].to(torch.int32)
            continue
        for first in range(0, num_positions, group):
            last = min(first + group, num_positions)
            served = min(last, max(first, int(verify_limit[b])))
            if served > first:
                failed = _serve_group(tokens[first:served], valid[first:served], first, committed, buf, req, tables,
                                      counters)
                if failed is not None:
                    verify_limit[b] = min(int(verify_limit[b]), failed)
        limit = max(0, min(int(verify_limit[b]), num_positions))
        history = valid[:limit] & (tokens[:limit] < committed - 1)
        slots = tables.token_slot[buf, tokens[:limit][history]].to(torch.int64)
        out[b, :limit][history] = tables.slot_rows[buf, slots]
        newest = valid[:limit] & (tokens[:limit] == committed - 1)
        out[b, :limit][newest] = tables.slot_rows[buf, buffer_size]
        verify = valid[:limit] & (tokens[:limit] >= committed)
        verify_slots = buffer_size + VERIFY_SLOT_BASE + (tokens[:limit][verify] - committed)
        out[b, :limit][verify] = tables.slot_rows[buf, verify_slots]
    return out


def _serve_group(
    tokens: torch.Tensor,
    valid: torch.Tensor,
    first: int,
    committed: int,
    buf: int,
    req: int,
    tables: SwapInTables,
    counters: torch.Tensor | None,
) -> int | None:
    """The history entries of one group's served positions (``[G', K]``, position ``first`` first) of an
    offloaded request, as :func:`swap_in_positions` states: lookups, hits stamped, misses placed in
    the evictable slots and copied. Returns the first position left out, or None."""
    buffer_size = tables.slot_tokens.shape[1]
    num_top_k = tokens.shape[1]
    history = (valid & (tokens < committed - 1)).reshape(-1)
    index = torch.nonzero(history).reshape(-1)  # entries in position-major order
    if counters is not None:
        counters[0] += index.numel()
    if index.numel() == 0:
        return None
    named = tokens.reshape(-1)[index]
    found = tables.token_slot[buf, named].to(torch.int64)
    hit_slots = torch.unique(found[found >= 0])
    tables.slot_stamps[buf, hit_slots] = committed
    missed, missed_index = named[found < 0], index[found < 0]
    if missed.numel() == 0:
        return None
    distinct, inverse = torch.unique(missed, return_inverse=True)
    first_seen = torch.full((distinct.numel(),), tokens.numel(), dtype=torch.int64, device=tokens.device)
    first_seen.scatter_reduce_(0, inverse, missed_index, reduce="amin")
    order = torch.argsort(first_seen)
    misses, miss_positions = distinct[order], first + first_seen[order] // num_top_k
    evictable = torch.ones(buffer_size, dtype=torch.bool, device=tokens.device)
    evictable[hit_slots] = False
    if first > 0:
        evictable &= tables.slot_stamps[buf] != committed
    slots = torch.nonzero(evictable).reshape(-1)
    failed = None
    if misses.numel() > slots.numel():
        failed = int(miss_positions[slots.numel()])
        if first == 0:
            raise ValueError(
                f"request slot {req}: the first group's positions select {misses.numel() + hit_slots.numel()} distinct "
                f"history tokens but its buffer has {buffer_size} slots; device_buffer_size must be at least the "
                f"group's entries (group x top_k = {tokens.numel()}), so that position 0 is always served."
            )
        misses = misses[miss_positions < failed]
    num_miss = misses.numel()
    if counters is not None:
        counters[1] += num_miss
    if num_miss:
        _place_misses(tables, buf, req, committed, misses, slots)
    return failed


def _place_misses(
    tables: SwapInTables, buf: int, req: int, seq_len: int, misses: torch.Tensor, slots: torch.Tensor
) -> None:
    """The ``k``-th of ``misses`` (distinct tokens, first-occurrence order, at least one) takes the ``k``-th
    victim among the candidate ``slots`` (ascending, at least as many): the largest key
    ``(min(max(seq_len - stamp, 0), AGE_CAP), -slot)``, then ordered older ones by slot and those of the
    youngest chosen age by slot (:func:`swap_in`'s rule). The victim's old token leaves ``token_slot``, the
    miss's host row is copied to the victim's device row, and the victim's token, stamp and ``token_slot``
    entry become the miss, ``seq_len``, the victim."""
    ages = (seq_len - tables.slot_stamps[buf, slots].to(torch.int64)).clamp(0, AGE_CAP)
    # Largest age first, lower slot first among equal ages (argsort is stable).
    by_key = torch.argsort(-ages, stable=True)[: misses.numel()]
    chosen, chosen_ages = slots[by_key], ages[by_key]
    youngest = chosen_ages.min()
    victims = torch.cat([torch.sort(chosen[chosen_ages > youngest]).values,
                         torch.sort(chosen[chosen_ages == youngest]).values])
    old_tokens = tables.slot_tokens[buf, victims].to(torch.int64)
    tables.token_slot[buf, old_tokens[old_tokens >= 0]] = -1
    host_rows = tables.req_to_token[req, misses].to(torch.int64)
    device_rows = tables.slot_rows[buf, victims].to(torch.int64)
    tables.device_kv[device_rows] = tables.host_kv[host_rows].to(tables.device_kv.device)
    tables.slot_tokens[buf, victims] = misses.to(tables.slot_tokens.dtype)
    tables.slot_stamps[buf, victims] = seq_len
    tables.token_slot[buf, misses] = victims.to(tables.token_slot.dtype)


def bind_verify_slots(
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    num_real_reqs: torch.Tensor,
    num_positions: int,
    req_to_token: torch.Tensor,
    device_row_of_loc: torch.Tensor,
    buffer_of_req: torch.Tensor,
    slot_rows: torch.Tensor,
    buffer_size: int,
) -> None:
    """Before a target-verify forward: bind the verify positions of offloaded requests to their slots.

    For each real batch row ``b`` (``b < num_real_reqs[0]``) whose request ``r`` is offloaded, the
    locations of positions ``s + j`` (``j < T``) become ``slot_rows[buf, D + 1 + j]``, so the
    forward writes their KV there (the KV pool translates every write through
    ``device_row_of_loc``). Resident requests are left alone: their verify positions lie in pages
    bound when their locations were allocated.

    Args:
        req_pool_indices, seq_lens: int32/int64 ``[B]``: request slots and committed lengths ``s``.
        num_real_reqs: int32 ``[1]``.
        num_positions: ``T``.
        req_to_token, device_row_of_loc, buffer_of_req, slot_rows: as in :class:`SwapInTables`
            (``device_row_of_loc`` is written).
        buffer_size: ``D``.
    """
    _check_verify_positions(num_positions, slot_rows, buffer_size)
    real = min(int(num_real_reqs.reshape(-1)[0]), req_pool_indices.numel())
    for b in range(real):
        req = int(req_pool_indices[b])
        buf = int(buffer_of_req[req])
        if buf < 0:
            continue
        committed = int(seq_lens[b])
        locs = req_to_token[req, committed : committed + num_positions].to(torch.int64)
        slots = buffer_size + VERIFY_SLOT_BASE + torch.arange(num_positions, dtype=torch.int64, device=locs.device)
        device_row_of_loc[locs] = slot_rows[buf, slots].to(device_row_of_loc.dtype)


def verify_page_table(
    page_table: torch.Tensor,
    req_pool_indices: torch.Tensor,
    num_positions: int,
    buffer_of_req: torch.Tensor,
    device_row_of_loc: torch.Tensor,
    page_size: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The page table SGLang's fused top-k maps the selected positions of a target-verify forward through.

    The fused top-k turns a selected position ``p`` of row ``i`` into ``table[i, p // P] * P + p % P``. Given
    SGLang's logical page table, a resident request's rows map to device rows (its logical pages are mapped
    whole onto device pages, page starts to page starts) and an offloaded request's rows stay positions, which
    :func:`swap_in_positions` with ``resident_rows`` expects.

    Args:
        page_table: int32 ``[B * T, W]``: logical page ids; row ``i`` belongs to batch row ``i // T``
            (SGLang's ``real_page_table`` of the verify forward, one row per query).
        req_pool_indices: int32/int64 ``[B]``: the request slot of each batch row (CUDA-graph padding rows
            included; their top-k has no entry, so their table is never read).
        num_positions: ``T``.
        buffer_of_req: int32 ``[R]``: -1 for a resident request.
        device_row_of_loc: int32 ``[N + 1]``, ``N`` a multiple of ``page_size``.
        page_size: ``P``.
        out: optional int32 ``[B * T, W]`` to write into.

    Returns:
        int32 ``[B * T, W]``: for a resident request's rows ``device_row_of_loc[page * P] // P`` of each
        logical ``page`` (0 for an id outside ``[0, N / P)``, as for an unmapped page); for an offloaded
        request's rows the column index ``w``.
    """
    rows, width = page_table.shape
    if out is None:
        out = torch.empty((rows, width), dtype=torch.int32, device=page_table.device)
    num_pages = (device_row_of_loc.shape[0] - 1) // page_size
    pages = page_table.to(torch.int64)
    inside = (pages >= 0) & (pages < num_pages)
    device_pages = device_row_of_loc[torch.where(inside, pages, 0) * page_size].to(torch.int64) // page_size
    device_pages = torch.where(inside, device_pages, 0)
    resident = buffer_of_req[req_pool_indices.to(torch.int64)] < 0
    resident = resident.repeat_interleave(num_positions).reshape(-1, 1)
    columns = torch.arange(width, dtype=torch.int64, device=page_table.device).expand(rows, width)
    out.copy_(torch.where(resident, device_pages, columns).to(torch.int32))
    return out


def commit_accepted(
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    accept_lens: torch.Tensor,
    num_real_reqs: torch.Tensor,
    num_positions: int,
    req_to_token: torch.Tensor,
    device_row_of_loc: torch.Tensor,
    buffer_of_req: torch.Tensor,
    slot_rows: torch.Tensor,
    buffer_size: int,
    device_layers: Sequence[torch.Tensor],
    host_layers: Sequence[torch.Tensor],
) -> None:
    """After the verify's acceptance: the accepted tokens' KV, and only theirs, becomes host truth.

    For each real batch row ``b`` with request ``r``, committed length ``s`` (before this verify)
    and ``a = accept_lens[b]`` accepted positions (``0 <= a <= T``; SGLang's accept length counts
    the verify's root token, so a real row has ``a >= 1``; 0 commits nothing):

    * every layer's row of positions ``s .. s + a - 1`` is copied from its device row
      (``device_row_of_loc`` of its location) to its host row (the location);
    * an offloaded request's newest accepted token, position ``s + a - 1``, is also copied from its
      verify slot ``D + 1 + (a - 1)`` into slot ``D`` of every layer, where the next verify (with
      committed length ``s + a``) expects it.

    Host rows of the rejected positions ``s + a .. s + T - 1`` are never written: their locations
    stay allocated and the next verify writes them again before anything reads them as accepted.

    Args:
        req_pool_indices, seq_lens: int32/int64 ``[B]``: request slots and committed lengths ``s``.
        accept_lens: int32/int64 ``[B]``: accepted positions ``a`` of each row.
        num_real_reqs: int32 ``[1]``: rows ``>= num_real_reqs[0]`` are skipped.
        num_positions: ``T``.
        req_to_token, device_row_of_loc, buffer_of_req, slot_rows: as in :class:`SwapInTables`.
        buffer_size: ``D``.
        device_layers, host_layers: one KV tensor per layer (rows along dim 0, the same row layout).

    Raises:
        ValueError: an accept length outside ``[0, T]``, or layer lists of different lengths.
    """
    _check_verify_positions(num_positions, slot_rows, buffer_size)
    if len(device_layers) != len(host_layers):
        raise ValueError(f"{len(device_layers)} device layers but {len(host_layers)} host layers.")
    real = min(int(num_real_reqs.reshape(-1)[0]), req_pool_indices.numel())
    for b in range(real):
        accepted = int(accept_lens[b])
        if not 0 <= accepted <= num_positions:
            raise ValueError(
                f"batch row {b}: accept length {accepted} outside [0, {num_positions}] (the verify positions)."
            )
        if accepted == 0:
            continue
        req = int(req_pool_indices[b])
        committed = int(seq_lens[b])
        locs = req_to_token[req, committed : committed + accepted].to(torch.int64)
        rows = device_row_of_loc[locs].to(torch.int64)
        for device, host in zip(device_layers, host_layers):
            host[locs.to(host.device)] = device[rows.to(device.device)].to(host.device)
        buf = int(buffer_of_req[req])
        if buf >= 0:
            newest_verify_slot = buffer_size + VERIFY_SLOT_BASE + accepted - 1
            source = int(slot_rows[buf, newest_verify_slot])
            target = int(slot_rows[buf, buffer_size])
            for device in device_layers:
                device[target] = device[source]


def cap_accepted(
    verify_limit: torch.Tensor,
    accept_lens: torch.Tensor,
    accept_index: torch.Tensor,
    counters: torch.Tensor | None = None,
) -> None:
    """After acceptance, before anything uses the accept lengths: accept no position the verify's swap-in
    did not serve, and reset the limits for the next step.

    For each batch row ``b < B`` with ``a = accept_lens[b]`` accepted positions (the root included) and
    ``l = max(verify_limit[b], 1)``: if ``a > l``, the row accepts the first ``l`` positions only:
    ``accept_lens[b] = l`` and ``accept_index[b, l:] = -1`` (SGLang's accepted entries in order, -1
    after the last). The tokens it emits are then those of positions ``0 .. l - 1``, each the target's
    own choice there (greedy: the target's prediction; sampled: an accepted draft or the bonus), so
    the output is what SGLang would emit had the drafts after ``l - 1`` been rejected. Then
    ``verify_limit[:B] = NO_VERIFY_LIMIT``.

    Args:
        verify_limit: int32 ``[>= B]``, written by :func:`swap_in_positions`; reset here.
        accept_lens: int32/int64 ``[B]``, changed in place.
        accept_index: int32 ``[B, W]``, changed in place.
        counters: optional int64 ``[2]``: incremented by the rows capped (``[0]``) and the positions
            they no longer accept (``[1]``).
    """
    batch = accept_lens.shape[0]
    limit = verify_limit[:batch].to(torch.int64, copy=True).clamp(min=1)
    accepted = accept_lens.to(torch.int64, copy=True)
    capped = accepted > limit
    kept = torch.where(capped, limit, accepted)
    columns = torch.arange(accept_index.shape[1], dtype=torch.int64, device=accept_index.device)
    accept_index[capped.reshape(-1, 1) & (columns.reshape(1, -1) >= kept.reshape(-1, 1))] = -1
    accept_lens.copy_(kept.to(accept_lens.dtype))
    if counters is not None:
        counters[0] += int(capped.sum())
        counters[1] += int((accepted - kept).sum())
    verify_limit[:batch] = NO_VERIFY_LIMIT
