"""Synthetic swap-in inputs for tests and benchmarks.

Every host row holds bytes unique to the row, device rows start poisoned, and each offloaded
request's top-k mixes hits, misses, the newest token, duplicates, padding and out-of-range
positions in proportions the caller chooses, so a misplaced byte cannot match by luck.
:func:`make_positions_case` builds the multi-position swap-in of a speculative verify step
(``swap_in_positions``) the same way.
"""

from __future__ import annotations

import dataclasses

import torch

from hisparse_sglang.ops.tables import SwapInTables

__all__ = ["SwapInCase", "make_case", "make_positions_case", "union_misses", "POISON"]

POISON = 0xCD


@dataclasses.dataclass
class SwapInCase:
    """Inputs of one swap-in call (one layer); see ops.reference.swap_in for the meaning."""

    top_k: torch.Tensor
    seq_lens: torch.Tensor
    req_pool_indices: torch.Tensor
    num_real_reqs: torch.Tensor
    req_to_token: torch.Tensor
    device_row_of_loc: torch.Tensor
    buffer_of_req: torch.Tensor
    slot_rows: torch.Tensor
    slot_tokens: torch.Tensor
    slot_stamps: torch.Tensor
    token_slot: torch.Tensor
    host_kv: torch.Tensor
    device_kv: torch.Tensor
    expected_misses: int

    @property
    def tables(self) -> SwapInTables:
        return SwapInTables(
            self.req_to_token, self.device_row_of_loc, self.buffer_of_req, self.slot_rows, self.slot_tokens,
            self.slot_stamps, self.token_slot, self.host_kv, self.device_kv,
        )

    def args(self) -> tuple:
        """The positional arguments of ``swap_in``: the batch, then the tables."""
        return self.top_k, self.seq_lens, self.req_pool_indices, self.num_real_reqs, self.tables

    def clone(self, device: torch.device | str | None = None, pin_host: bool = False) -> "SwapInCase":
        """Deep copy; with ``device``, every tensor but the host KV moves there.

        The host KV is copied into pinned memory with ``pin_host``, shared (not copied) when only
        ``device`` is given, and copied otherwise.
        """
        fields = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, torch.Tensor):
                if field.name == "host_kv":
                    if pin_host:
                        value = value.pin_memory()
                    elif device is None:
                        value = value.clone()
                else:
                    value = value.to(device) if device is not None else value.clone()
                    if device is not None and value.data_ptr() == getattr(self, field.name).data_ptr():
                        value = value.clone()
            fields[field.name] = value
        return SwapInCase(**fields)


def make_case(
    batch: int,
    top_k: int,
    buffer_size: int,
    row_bytes: int = 64,
    *,
    page_size: int = 64,
    miss_rate: float = 0.2,
    seq_len: int | None = None,
    resident_fraction: float = 0.0,
    num_real: int | None = None,
    newest_fraction: float = 0.01,
    duplicate_fraction: float = 0.0,
    padding_fraction: float = 0.0,
    out_of_range_fraction: float = 0.0,
    empty_slot_fraction: float = 0.0,
    stamp_spread: int = 48,
    old_stamp_fraction: float = 0.1,
    newest_count: int | None = None,
    extra_slots: int = 3,
    seed: int = 0,
    host_kv: torch.Tensor | None = None,
    context_slack: int = 16,
) -> SwapInCase:
    """Build a swap-in call of ``batch`` requests on the CPU.

    Args:
        miss_rate: share of an offloaded request's distinct non-newest tokens that no slot holds.
        seq_len: every request's length (default: 2 x buffer_size + 7).
        resident_fraction: share of requests that are resident (no buffer).
        num_real: batch rows that are real (the rest are CUDA-graph padding).
        newest_fraction, duplicate_fraction, padding_fraction, out_of_range_fraction: shares of top-k
            entries that are the newest position, repeats of an earlier entry, -1, or >= seq_len.
        empty_slot_fraction: share of LRU slots that hold no token.
        stamp_spread, old_stamp_fraction: a slot's last use is one of the ``stamp_spread`` steps
            before this one (many slots share a step: ties), or with ``old_stamp_fraction`` step 0.
        newest_count: if set, exactly this many entries per request are the newest position
            (replacing ``newest_fraction``), as a real indexer's distinct output has one.
        extra_slots: request slots beyond the batch (requests use a random subset of slots).
        host_kv: reuse this host KV tensor (it must have the rows and row size this case needs;
            its contents must be those make_case writes) instead of filling a new one.
        context_slack: positions per request slot beyond ``seq_len`` (``req_to_token``'s width is
            ``seq_len + context_slack``): room for verify positions and for lengths that grow.
    """
    generator = torch.Generator().manual_seed(seed)

    def rand() -> float:
        return float(torch.rand((), generator=generator))

    misses = torch.empty(0, dtype=torch.int64)
    seq_len = seq_len if seq_len is not None else 2 * buffer_size + 7
    if seq_len - 1 < 1:
        raise ValueError("seq_len must be >= 2")
    padded = buffer_size + page_size
    num_slots = batch + extra_slots
    context = seq_len + context_slack
    slots = torch.randperm(num_slots, generator=generator)[:batch]

    # Host rows: a random injective map (slot, position) -> host row; unique bytes per row.
    num_host_rows = num_slots * context + 1
    req_to_token = torch.randperm(num_host_rows - 1, generator=generator)[: num_slots * context]
    req_to_token = (req_to_token + 1).to(torch.int32).reshape(num_slots, context)
    if host_kv is None or tuple(host_kv.shape) != (num_host_rows, row_bytes):
        host_kv = torch.arange(num_host_rows * (row_bytes // 4), dtype=torch.int32).view(torch.uint8)
        host_kv = host_kv.reshape(num_host_rows, row_bytes)

    # Device rows: resident requests and buffers take disjoint random rows; the rest stay poisoned.
    num_buffers = batch
    resident_rows = batch * seq_len if resident_fraction > 0 else 0
    num_device_rows = page_size + num_buffers * padded + resident_rows
    device_rows = (torch.randperm(num_device_rows - page_size, generator=generator) + page_size).to(torch.int32)
    cursor = 0
    device_row_of_loc = torch.zeros(num_host_rows + 1, dtype=torch.int32)
    device_row_of_loc[-1] = -1
    buffer_of_req = torch.full((num_slots,), -1, dtype=torch.int32)
    slot_rows = torch.zeros((num_buffers, padded), dtype=torch.int32)
    slot_tokens = torch.full((num_buffers, buffer_size), -1, dtype=torch.int32)
    slot_stamps = torch.zeros((num_buffers, buffer_size), dtype=torch.int32)
    token_slot = torch.full((num_buffers, context), -1, dtype=torch.int16)
    device_kv = torch.full((num_device_rows, row_bytes), POISON, dtype=torch.uint8)
    top = torch.full((batch, top_k), -1, dtype=torch.int32)
    expected_misses = 0

    for b in range(batch):
        slot = int(slots[b])
        candidates = torch.randperm(seq_len - 1, generator=generator)  # non-newest positions
        if rand() < resident_fraction:
            rows = device_rows[cursor : cursor + seq_len]
            cursor += seq_len
            device_row_of_loc[req_to_token[slot, :seq_len].to(torch.int64)] = rows
            chosen = candidates[:top_k]
        else:
            buffer = b
            buffer_of_req[slot] = buffer
            slot_rows[buffer] = device_rows[cursor : cursor + padded]
            cursor += padded
            recent = seq_len - 1 - torch.randint(0, max(stamp_spread, 1), (buffer_size,), generator=generator)
            old = torch.rand(buffer_size, generator=generator) < old_stamp_fraction
            slot_stamps[buffer] = torch.where(old, torch.zeros_like(recent), recent.clamp(min=0)).to(torch.int32)
            distinct = min(top_k, seq_len - 1)
            num_miss = int(round(miss_rate * distinct))
            num_hit = distinct - num_miss
            held_count = min(buffer_size, seq_len - 1, num_hit + int((buffer_size - num_hit) * (1 - empty_slot_fraction)))
            held_count = max(held_count, num_hit)
            held = candidates[:held_count]
            misses = candidates[held_count : held_count + num_miss]
            hit_tokens = held[torch.randperm(held_count, generator=generator)[:num_hit]]
            slot_order = torch.randperm(buffer_size, generator=generator)[:held_count]
            slot_tokens[buffer, slot_order] = held.to(torch.int32)
            token_slot[buffer, held] = slot_order.to(torch.int16)
            held_rows = slot_rows[buffer, slot_order].to(torch.int64)
            device_kv[held_rows] = host_kv[req_to_token[slot, held].to(torch.int64)]
            chosen = torch.cat([hit_tokens, misses])
            chosen = chosen[torch.randperm(chosen.numel(), generator=generator)]
        entries = torch.full((top_k,), -1, dtype=torch.int64)
        entries[: chosen.numel()] = chosen
        roll = torch.rand(top_k, generator=generator)
        edges = torch.cumsum(torch.tensor([newest_fraction, padding_fraction, out_of_range_fraction, duplicate_fraction]), 0)
        index = torch.arange(top_k)
        earlier = (torch.rand(top_k, generator=generator) * index).to(torch.int64)
        duplicates = entries[earlier]
        entries = torch.where(roll < edges[0], torch.full_like(entries, seq_len - 1), entries)
        entries = torch.where((roll >= edges[0]) & (roll < edges[1]), torch.full_like(entries, -1), entries)
        beyond = seq_len + torch.randint(0, 9, (top_k,), generator=generator)
        entries = torch.where((roll >= edges[1]) & (roll < edges[2]), beyond, entries)
        entries = torch.where((roll >= edges[2]) & (roll < edges[3]) & (index > 0), duplicates, entries)
        if newest_count is not None:
            entries[entries == seq_len - 1] = -1
            where = torch.randperm(top_k, generator=generator)[:newest_count]
            entries[where] = seq_len - 1
        top[b] = entries.to(torch.int32)
        if buffer_of_req[slot] >= 0 and b < (num_real if num_real is not None else batch):
            expected_misses += int(torch.isin(misses, entries).sum())

    return SwapInCase(
        top_k=top,
        seq_lens=torch.full((batch,), seq_len, dtype=torch.int64),
        req_pool_indices=slots.to(torch.int64),
        num_real_reqs=torch.tensor([batch if num_real is None else num_real], dtype=torch.int32),
        req_to_token=req_to_token,
        device_row_of_loc=device_row_of_loc,
        buffer_of_req=buffer_of_req,
        slot_rows=slot_rows,
        slot_tokens=slot_tokens,
        slot_stamps=slot_stamps,
        token_slot=token_slot,
        host_kv=host_kv,
        device_kv=device_kv,
        expected_misses=expected_misses,
    )


def union_misses(case: SwapInCase) -> int:
    """Distinct history tokens (``0 <= t < s - 1``) of every real offloaded row of a
    ``swap_in_positions`` case (``top_k [B, T, K]``, ``seq_lens`` = ``s``) that no slot holds: the rows
    the call copies."""
    num_real = min(int(case.num_real_reqs[0]), case.top_k.shape[0])
    misses = 0
    for b in range(num_real):
        buffer = int(case.buffer_of_req[int(case.req_pool_indices[b])])
        if buffer < 0:
            continue
        tokens = case.top_k[b].reshape(-1).to(torch.int64)
        history = torch.unique(tokens[(tokens >= 0) & (tokens < int(case.seq_lens[b]) - 1)])
        misses += int((case.token_slot[buffer, history] < 0).sum())
    return misses


def make_positions_case(
    batch: int,
    num_positions: int,
    top_k: int,
    buffer_size: int,
    row_bytes: int = 64,
    *,
    overlap: float = 0.8,
    miss_rate: float = 0.2,
    verify_entries: bool = True,
    seed: int = 0,
    **case_options,
) -> SwapInCase:
    """Build a ``swap_in_positions`` call (one layer of a verify step) of ``batch`` requests with
    ``num_positions`` (``T``) query positions each, on the CPU; ``top_k`` is ``[B, T, K]`` and
    ``seq_lens`` the committed length ``s``.

    Position 0 is :func:`make_case`'s top-k row of the same arguments (its ``seq_len`` is ``s``: history,
    the newest accepted token ``s - 1``, misses at ``miss_rate``; its out-of-range entries ``s .. s + 8``
    are verify tokens for some positions and beyond the causal limit for others). Position ``j >= 1``
    keeps each of position 0's entries with probability ``overlap`` and replaces the others with history
    tokens: with probability ``miss_rate`` one no slot holds (a miss, possibly shared with another
    position), else one the buffer holds (a hit). With ``verify_entries`` position ``j`` also names the
    verify tokens ``s .. s + j`` (its own and the earlier positions', as a causal indexer may). Resident
    requests draw replacements from their whole history. ``expected_misses`` counts the union's distinct
    misses (:func:`union_misses`).

    Args:
        case_options: passed to :func:`make_case` (``page_size``, ``seq_len``, ``resident_fraction``,
            ``num_real``, ``newest_count``, ``duplicate_fraction``, ``context_slack``, ``host_kv``, ...).
    """
    base = make_case(batch, top_k, buffer_size, row_bytes, miss_rate=miss_rate, seed=seed, **case_options)
    generator = torch.Generator().manual_seed(seed + 7919)
    rows = torch.full((batch, num_positions, top_k), -1, dtype=torch.int32)
    for b in range(batch):
        committed = int(base.seq_lens[b])
        first = base.top_k[b].to(torch.int64)
        buffer = int(base.buffer_of_req[int(base.req_pool_indices[b])])
        history = max(committed - 1, 1)
        if buffer >= 0:
            held = base.slot_tokens[buffer].to(torch.int64)
            held = held[held >= 0]
            unheld = torch.nonzero(base.token_slot[buffer, :history] < 0).reshape(-1)
        for j in range(num_positions):
            entries = first.clone()
            if j > 0:
                replaced = torch.rand(top_k, generator=generator) >= overlap
                count = int(replaced.sum())
                if buffer >= 0 and held.numel() and unheld.numel():
                    hits = held[torch.randint(0, held.numel(), (count,), generator=generator)]
                    misses = unheld[torch.randint(0, unheld.numel(), (count,), generator=generator)]
                    missed = torch.rand(count, generator=generator) < miss_rate
                    fresh = torch.where(missed, misses, hits)
                else:
                    fresh = torch.randint(0, history, (count,), generator=generator)
                entries[replaced] = fresh
            if verify_entries:
                where = torch.randperm(top_k, generator=generator)[: min(j + 1, top_k)]
                entries[where] = committed + torch.arange(where.numel(), dtype=torch.int64)
            rows[b, j] = entries.to(torch.int32)
    base.top_k = rows
    base.expected_misses = union_misses(base)
    return base
