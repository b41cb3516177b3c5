"""The benchmark's cells: one (batch, miss rate, row size) swap-in case on the GPU, in our tables and
in SGLang's, with the calls that run, reset and check both kernels on it.

The shape is the one every swap-in benchmark uses (top_k 2048, device buffer 4096, seq_len 8192,
page 64); the inputs come from ``hisparse_sglang.testing.cases.make_case``, so a cell holds exactly
what the GPU tests check bit for bit. :class:`PositionsCell` is the same cell verifying ``T`` positions
per request (``swap_in_positions``; ``make_positions_case``): its position 0 is the cell's top-k row while
``T x top_k`` fits the benchmark's buffer (``T <= 2``); beyond, the buffer is ``T x top_k`` slots and the
length grows by as much (:func:`positions_shape`), so position 0 is drawn anew.
"""

from __future__ import annotations

import torch

from hisparse_sglang.ops.reference import VERIFY_SLOT_BASE
from hisparse_sglang.ops.swap_in import DEFAULT_THREADS, CudaOps
from hisparse_sglang.testing.cases import make_case, make_positions_case
from swap_in import baseline

__all__ = [
    "TOP_K", "BUFFER", "PAGE", "SEQ_LEN", "SGLANG_BLOCK_SIZE", "Cell", "PositionsCell", "cell_seed", "load_sglang",
    "unique_first", "positions_shape",
]

TOP_K = 2048
BUFFER = 4096
PAGE = 64
SEQ_LEN = 8192
SGLANG_BLOCK_SIZE = 960  # the in-tree default swap_in_block_size of SGLang 0.5.17 (build_baseline reads it)


def positions_shape(num_positions: int) -> tuple[int, int]:
    """``(device_buffer_size, committed length s)`` of a ``T``-position cell: the buffer must hold the union of
    a request's positions (``T x TOP_K``, at least :data:`BUFFER`), and ``s`` exceeds it by as much as the
    one-position cell's ``SEQ_LEN`` exceeds ``BUFFER``, so as many history tokens lie outside the buffer
    (misses are drawn from them). ``T <= 2``: the one-position cell's shape."""
    buffer_size = max(BUFFER, -(-num_positions * TOP_K // PAGE) * PAGE)
    return buffer_size, SEQ_LEN + buffer_size - BUFFER


def cell_seed(batch: int, miss_percent: float) -> int:
    """The seed of the cell (batch, miss %) in the table, the trace and the profile: the same inputs in each."""
    return batch * 1000 + int(miss_percent)


def load_sglang(row_bytes: int) -> baseline.SGLangSwapIn:
    """SGLang's kernel for this row size at the benchmark's shape (prebuilt by ``build-baseline``)."""
    return baseline.load(row_bytes, TOP_K, BUFFER, SGLANG_BLOCK_SIZE)


def unique_first(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct values and the index of each one's first occurrence."""
    distinct, inverse = torch.unique(values, return_inverse=True)
    order = torch.arange(values.numel(), device=values.device)
    first = torch.full((distinct.numel(),), values.numel(), dtype=torch.int64, device=values.device)
    first.scatter_reduce_(0, inverse, order, reduce="amin")
    return distinct, first


class Cell:
    """One (batch, miss rate, row size) case on the GPU, in both layouts.

    ``module``: the kernel library our calls launch (``hisparse_sglang.ops.jit.load_module(defines)``
    for a variant build); None runs the production build exactly as the coordinator calls it.
    """

    def __init__(self, batch: int, miss_rate: float, row_bytes: int, seed: int, host_cache: dict, module=None):
        key = (batch, row_bytes)
        case = make_case(
            batch, TOP_K, BUFFER, row_bytes, page_size=PAGE, miss_rate=miss_rate, seq_len=SEQ_LEN,
            newest_fraction=0.0, newest_count=1, seed=seed, extra_slots=0, host_kv=host_cache.get(key),
        )
        if key not in host_cache:
            host_cache[key] = case.host_kv
        self.ops = CudaOps(module=module)
        self.misses = case.expected_misses
        self.bytes = self.misses * row_bytes
        self.gpu = case.clone(device="cuda")
        pinned = host_cache.get(("pinned", batch, row_bytes))
        if pinned is None:
            pinned = case.host_kv.pin_memory()
            host_cache[("pinned", batch, row_bytes)] = pinned
        self.gpu.host_kv = pinned
        self.saved = [t.clone() for t in (self.gpu.slot_tokens, self.gpu.slot_stamps, self.gpu.token_slot)]
        self.out = torch.empty((batch, TOP_K), dtype=torch.int32, device="cuda")
        self.counters = torch.zeros(2, dtype=torch.int64, device="cuda")
        self._sglang_layout(case)

    def _sglang_layout(self, case) -> None:
        """The same state in SGLang's in-tree tables (indexed by request slot)."""
        slots = case.buffer_of_req.numel()
        padded = BUFFER + PAGE
        tokens = torch.full((slots, padded), -1, dtype=torch.int32)
        locs = torch.zeros((slots, padded), dtype=torch.int32)
        lru = torch.zeros((slots, BUFFER), dtype=torch.int16)
        for slot in range(slots):
            buffer = int(case.buffer_of_req[slot])
            if buffer >= 0:
                tokens[slot, :BUFFER] = case.slot_tokens[buffer]
                locs[slot] = case.slot_rows[buffer]
                # SGLang keeps an explicit order, least recently used first: ours by (stamp, slot).
                key = case.slot_stamps[buffer].to(torch.int64) * BUFFER + torch.arange(BUFFER)
                lru[slot] = torch.argsort(key).to(torch.int16)
        self.sg_tokens0, self.sg_lru0 = tokens.cuda(), lru.cuda()
        self.sg_tokens, self.sg_lru = tokens.cuda(), lru.cuda()
        self.sg_locs = locs.cuda()
        self.sg_host_locs = case.req_to_token.to(torch.int64).cuda()
        self.sg_out = torch.empty((case.top_k.shape[0], TOP_K), dtype=torch.int32, device="cuda")

    def default_splits(self, threads: int = DEFAULT_THREADS) -> int:
        """The CTAs per request ``swap_in`` picks for this cell when given none."""
        return self.ops.choose_splits(self.gpu.top_k.shape[0], TOP_K, BUFFER, threads)

    def resident_ctas(self, threads: int) -> int:
        """How many CTAs of our kernel at this shape and ``threads`` the GPU holds at once."""
        return self.ops.resident_ctas(TOP_K, BUFFER, threads)

    def reset_ours(self) -> None:
        for table, saved in zip((self.gpu.slot_tokens, self.gpu.slot_stamps, self.gpu.token_slot), self.saved):
            table.copy_(saved)

    def run_ours(self, splits=None, threads=None, ops: CudaOps | None = None) -> None:
        """Our kernel on this cell, through ``ops`` (default the cell's), with the hit/miss counters
        as the coordinator calls it in production."""
        (ops or self.ops).swap_in(*self.gpu.args(), out=self.out, counters=self.counters, splits=splits,
                                  threads=threads)

    def copy_only(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Host and device rows of this cell's misses, from a call's outputs (run after one call).

        Copying exactly these rows with ``copy_rows`` (rows known in advance, one launch) is what
        the swap-in's data movement alone costs at this size: no lookups, no planning.
        """
        top_k = self.gpu.top_k.to(torch.int64)
        seq = self.gpu.seq_lens.reshape(-1, 1).to(torch.int64)
        slots = self.gpu.req_pool_indices.to(torch.int64)
        buffers = self.gpu.buffer_of_req[slots].to(torch.int64)
        token_slot0 = self.saved[2]
        src, dst = [], []
        for b in range(top_k.shape[0]):
            if int(buffers[b]) < 0:
                continue
            entries = top_k[b]
            valid = (entries >= 0) & (entries < seq[b] - 1)
            positions = entries.clamp(min=0)
            missed = valid & (token_slot0[buffers[b], positions] < 0)
            index = torch.nonzero(missed).flatten()
            tokens, first = unique_first(entries[index])
            src.append(self.gpu.req_to_token[slots[b], tokens])
            dst.append(self.out[b, index[first]])
        src = torch.cat(src).to(torch.int64) if src else torch.empty(0, dtype=torch.int64, device=top_k.device)
        dst = torch.cat(dst).to(torch.int64) if dst else torch.empty(0, dtype=torch.int64, device=top_k.device)
        if src.numel() != self.misses:
            raise AssertionError(f"copy-only rows {src.numel()} != the cell's misses {self.misses}")
        return src, dst

    def run_copy_only(self, src: torch.Tensor, dst: torch.Tensor, max_blocks: int) -> None:
        """``copy_rows`` of the rows ``copy_only`` listed, in one launch of at most ``max_blocks`` blocks."""
        self.ops.copy_rows([self.gpu.host_kv], [self.gpu.device_kv], src, dst, max_blocks=max_blocks)

    def reset_sglang(self) -> None:
        self.sg_tokens.copy_(self.sg_tokens0)
        self.sg_lru.copy_(self.sg_lru0)

    def run_sglang(self, kernel) -> None:
        empty = torch.empty(0)
        kernel(
            self.gpu.top_k, self.sg_tokens, self.sg_host_locs, self.sg_locs, self.gpu.host_kv, empty,
            self.gpu.device_kv, empty, self.sg_out, self.gpu.req_pool_indices, self.gpu.seq_lens, self.sg_lru,
            self.gpu.num_real_reqs, 1, self.gpu.host_kv.shape[1],
        )

    def verify(self, out: torch.Tensor) -> None:
        """Every valid entry's row must hold its token's host bytes."""
        top_k = self.gpu.top_k
        valid = (top_k >= 0) & (top_k < self.gpu.seq_lens.reshape(-1, 1))
        rows = out[valid].to(torch.int64)
        slots = self.gpu.req_pool_indices.reshape(-1, 1).expand_as(top_k)[valid]
        host_rows = self.gpu.req_to_token[slots, top_k[valid].to(torch.int64)].to(torch.int64)
        newest = (top_k == self.gpu.seq_lens.reshape(-1, 1) - 1)[valid]
        got = self.gpu.device_kv[rows[~newest]].cpu()
        want = self.gpu.host_kv[host_rows[~newest].cpu()]
        if not torch.equal(got, want):
            raise AssertionError("a swap-in returned a row with the wrong KV")


class PositionsCell:
    """The (batch, miss rate, row size) cell verifying ``num_positions`` positions per request at once
    (one layer of a target-verify forward, ``swap_in_positions``), with the cell's seed: position 0 of
    each request is :class:`Cell`'s top-k row (``T <= 2``; beyond, the shape of :func:`positions_shape` and
    its own draws), position ``j`` keeps a share ``overlap`` of its entries and replaces the rest with history
    tokens (misses at the cell's miss rate) and names the verify tokens ``s .. s + j``
    (``make_positions_case``). The op serves the positions in groups of :attr:`group`
    (``swap_in_plan.positions_per_group``: 2 at ``T = 2``, 1 at ``T = 3, 4`` on sm_90), one launch each.
    """

    def __init__(self, num_positions: int, batch: int, miss_rate: float, row_bytes: int, seed: int, host_cache: dict,
                 overlap: float, module=None):
        self.buffer_size, seq_len = positions_shape(num_positions)
        host_key = (batch, row_bytes) if seq_len == SEQ_LEN else (batch, row_bytes, seq_len)
        case = make_positions_case(
            batch, num_positions, TOP_K, self.buffer_size, row_bytes, page_size=PAGE, miss_rate=miss_rate,
            overlap=overlap, seq_len=seq_len, newest_fraction=0.0, newest_count=1, seed=seed, extra_slots=0,
            host_kv=host_cache.get(host_key),
        )
        host_cache.setdefault(host_key, case.host_kv)
        self.num_positions = num_positions
        self.ops = CudaOps(module=module)
        self.group = self.ops.positions_group(num_positions, TOP_K, self.buffer_size)
        self.misses = case.expected_misses  # the union's distinct misses: one group copies exactly these
        self.copies = None  # rows a call copies (counted by verify): the union's misses, more with groups
        self.gpu = case.clone(device="cuda")
        pinned = host_cache.get(("pinned",) + host_key)
        if pinned is None:
            pinned = case.host_kv.pin_memory()
            host_cache[("pinned",) + host_key] = pinned
        self.gpu.host_kv = pinned
        self.saved = [t.clone() for t in (self.gpu.slot_tokens, self.gpu.slot_stamps, self.gpu.token_slot)]
        self.out = torch.empty((batch, num_positions, TOP_K), dtype=torch.int32, device="cuda")
        self.counters = torch.zeros(2, dtype=torch.int64, device="cuda")

    def default_splits(self, threads: int = DEFAULT_THREADS) -> int:
        return self.ops.choose_splits(self.gpu.top_k.shape[0], TOP_K, self.buffer_size, threads,
                                      num_positions=self.num_positions)

    def reset(self) -> None:
        for table, saved in zip((self.gpu.slot_tokens, self.gpu.slot_stamps, self.gpu.token_slot), self.saved):
            table.copy_(saved)

    def run(self) -> None:
        """``swap_in_positions`` on this cell with the hit/miss counters, as the coordinator calls it."""
        self.ops.swap_in_positions(*self.gpu.args(), out=self.out, counters=self.counters)

    def verify(self) -> None:
        """After a call from the saved state: every history entry's row holds its token's host bytes, every
        verify token's row is its verify slot's, and the call copied exactly the cell's misses (in one group;
        in groups at least those: a later group re-copies what an earlier group's misses evicted)."""
        self.counters.zero_()
        self.reset()
        self.run()
        torch.cuda.synchronize()
        self.copies = int(self.counters[1])
        one_group = self.group >= self.num_positions
        if (self.copies != self.misses) if one_group else (self.copies < self.misses):
            raise AssertionError(
                f"swap_in_positions in groups of {self.group} copied {self.copies} rows, the cell has {self.misses} "
                f"misses"
            )
        top_k = self.gpu.top_k.to(torch.int64)
        committed = self.gpu.seq_lens.to(torch.int64).reshape(-1, 1, 1)
        slots = self.gpu.req_pool_indices.to(torch.int64).reshape(-1, 1, 1).expand_as(top_k)
        history = (top_k >= 0) & (top_k < committed - 1)
        rows = self.out[history].to(torch.int64)
        host_rows = self.gpu.req_to_token[slots[history], top_k[history]].to(torch.int64)
        if not torch.equal(self.gpu.device_kv[rows].cpu(), self.gpu.host_kv[host_rows.cpu()]):
            raise AssertionError("swap_in_positions returned a row with the wrong KV")
        limit = committed + torch.arange(self.num_positions, device=top_k.device).reshape(1, -1, 1)
        verify = (top_k >= committed) & (top_k <= limit)
        buffers = self.gpu.buffer_of_req[slots[verify]].to(torch.int64)
        want = self.gpu.slot_rows[buffers, self.buffer_size + VERIFY_SLOT_BASE + (top_k - committed)[verify]]
        if not torch.equal(self.out[verify], want):
            raise AssertionError("a verify token did not map to its verify slot")
