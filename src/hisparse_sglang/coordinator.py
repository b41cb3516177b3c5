"""Request lifecycle of HiSparse: resident and offloaded requests, swap-in, eager backup.

Framework-free: requests are SGLang request-pool slots (ints) and token positions; the SGLang
adapter in ``integration/sglang`` translates SGLang's calls into these.

Modes of a decoding request:

* **resident**: every token has a device row (``KVAllocator.device_row_of_loc``); the swap-in op
  only translates positions to rows. Its KV is written through to the host pool (staging after
  prefill, then each new token by the forward that writes it), so it can be demoted at any step.
* **offloaded**: the request owns a device buffer (``DeviceBufferPool``) of ``D`` LRU slots plus a
  page whose first slot holds the newest token; the swap-in op copies missed tokens from host.

Policy (see docs/resident-first.md):

* ``resident_first`` on: requests stay resident while device pages last. When an allocation
  (a prefill, or resident requests starting new pages) lacks pages, in-flight promotions are
  cancelled and then resident requests are demoted, longest context first, preferring requests
  out of their cooldown, until enough pages are free. An offloaded request is promoted back
  (shortest first, at most ``max_switches_per_step`` per step) when, after the promotion,
  ``promote_free_fraction`` of the device pool stays free and its cooldown has passed.
  Promotion copies the KV host -> device on a side stream while the request keeps decoding
  offloaded, then switches at a later step.
* ``resident_first`` off: a request is demoted as soon as it outgrows its buffer (SGLang's
  in-tree behaviour) and never promoted.

Demotion needs no copy: the request keeps ``D`` of its resident rows (the most recent whole pages)
as LRU slots and the page of its newest token as the reserved page; the other pages are freed.

Host work per decode step (``prepare_decode``, on the scheduler's critical path): none for a
resident request whose new token continues a page (its page was mapped whole when it started);
one entry of one bind launch for a resident request starting a page and for every offloaded
request (its new token goes to slot ``D``). The eager backup of every new token runs inside the
forward: the swap-in of each layer first copies each request's newest token, which the layer
has just written, to its host row (``backup_newest``), so it is CUDA-graph captured and costs the
host nothing.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable, Sequence

import torch

from hisparse_sglang.config import HiSparseConfig
from hisparse_sglang.errors import HiSparseMemoryError, PoolExhaustedError
from hisparse_sglang.memory.allocator import KVAllocator, PoolStats
from hisparse_sglang.memory.device_buffers import DeviceBufferPool
from hisparse_sglang.memory.host_pool import HostKVPool
from hisparse_sglang.memory.paged import upload_ints
from hisparse_sglang.ops import reference
from hisparse_sglang.ops.layers import LayerSet
from hisparse_sglang.ops.reference import BIND_BUFFER_SLOT
from hisparse_sglang.ops.tables import SwapInTables
from hisparse_sglang.streams import CopyEvent, StreamSet

__all__ = ["Coordinator", "RequestRecord", "RESIDENT", "OFFLOADED", "CoordinatorStats"]

logger = logging.getLogger(__name__)

RESIDENT = "resident"
OFFLOADED = "offloaded"
# A scheduler step that spends longer than this switching modes is logged with its counts and the
# time of each part (what it waited on).
SLOW_SWITCH_SECONDS = 0.005


@dataclasses.dataclass
class _Promotion:
    pages: torch.Tensor  # device pages, page k holds positions [k * P, (k + 1) * P)
    covered: int  # positions [0, covered) are being copied host -> device
    event: CopyEvent


class SlotTable:
    """What the decode step reads and writes of every request, in lists indexed by request slot.

    The decode step checks and advances each request of the batch with two list loads and a
    compare (no dict lookup, no attribute access, no numpy call: in the scheduler's loop, between
    the model's launches, numpy's per-call overhead measured several times that of these loops).

    Attributes:
        seq_len: the length of each admitted request.
        next_len: ``seq_len + 1`` for a request released for decoding, else :data:`NOT_DECODING`
            (unknown, staging or finished), so that one comparison with a batch's length checks
            both. Twice as long as the slots: a negative slot (Python indexes from the end) lands
            in the second half, which is never decoding.
        bind_at: the smallest length at which a request's new token must be bound: 0 for an
            offloaded request (every step, to slot ``D``), the length whose new token starts its
            next page for a resident one.
        offloaded: whether each request is offloaded.
        num_offloaded: how many are.
    """

    NOT_DECODING = -1

    def __init__(self, num_slots: int, page_size: int) -> None:
        self.page_size = page_size
        self.seq_len = [0] * num_slots
        self.next_len = [self.NOT_DECODING] * (2 * num_slots)
        self.bind_at = [0] * num_slots
        self.offloaded = [False] * num_slots
        self.num_offloaded = 0

    def admit(self, slot: int, seq_len: int, decoding: bool) -> None:
        self.set_offloaded(slot, False)
        self.seq_len[slot] = seq_len
        self.next_len[slot] = seq_len + 1 if decoding else self.NOT_DECODING
        self._update_bind_at(slot)

    def release_for_decoding(self, slots: list[int]) -> None:
        for slot in slots:
            self.next_len[slot] = self.seq_len[slot] + 1

    def forget(self, slot: int) -> None:
        self.set_offloaded(slot, False)
        self.next_len[slot] = self.NOT_DECODING

    def set_len(self, slot: int, seq_len: int) -> None:
        self.seq_len[slot] = seq_len
        if self.next_len[slot] != self.NOT_DECODING:
            self.next_len[slot] = seq_len + 1
        self._update_bind_at(slot)

    def set_offloaded(self, slot: int, offloaded: bool) -> None:
        if self.offloaded[slot] != offloaded:
            self.offloaded[slot] = offloaded
            self.num_offloaded += 1 if offloaded else -1
            self._update_bind_at(slot)

    def next_page_start_len(self, seq_len: int) -> int:
        """The length at which a resident request's next new token (position >= seq_len) starts a page."""
        return -(-seq_len // self.page_size) * self.page_size + 1

    def _update_bind_at(self, slot: int) -> None:
        self.bind_at[slot] = 0 if self.offloaded[slot] else self.next_page_start_len(self.seq_len[slot])


class RequestRecord:
    """The coordinator's view of one request (CPU only); its length and mode live in the
    coordinator's :class:`SlotTable`.

    Attributes:
        slot: SGLang request-pool slot.
        seq_len: positions ``[0, seq_len)`` have KV (the last one may be written by the forward in
            flight). All of them are on the host once the prefill's staging copy and the forward
            that wrote the newest one are done.
        mode: RESIDENT or OFFLOADED.
        staging: copy of the prefill KV to the host, while it may be in flight.
        promotion: an offloaded request's promotion in flight.
        mode_step: coordinator step of the last mode switch.
    """

    __slots__ = ("slot", "staging", "promotion", "mode_step", "_table")

    def __init__(self, table: SlotTable, slot: int, seq_len: int, decoding: bool,
                 staging: CopyEvent | None = None, mode_step: int = 0) -> None:
        self._table = table
        self.slot = slot
        self.staging = staging
        self.promotion: _Promotion | None = None
        self.mode_step = mode_step
        table.admit(slot, seq_len, decoding)

    @property
    def seq_len(self) -> int:
        return self._table.seq_len[self.slot]

    @seq_len.setter
    def seq_len(self, value: int) -> None:
        self._table.set_len(self.slot, value)

    @property
    def mode(self) -> str:
        return OFFLOADED if self._table.offloaded[self.slot] else RESIDENT

    @mode.setter
    def mode(self, value: str) -> None:
        self._table.set_offloaded(self.slot, value == OFFLOADED)

    def __repr__(self) -> str:
        return f"RequestRecord(slot={self.slot}, seq_len={self.seq_len}, mode={self.mode})"


@dataclasses.dataclass(frozen=True)
class CoordinatorStats:
    pools: PoolStats
    resident_requests: int
    offloaded_requests: int
    promoting_requests: int
    demotions: int
    promotions: int
    promotion_cancels: int
    swap_in_lookups: int
    swap_in_misses: int
    bytes_swapped_in: int


class Coordinator:
    """Owns the per-request state of HiSparse on one GPU (one TP rank).

    Args:
        config: HiSparse settings.
        allocator: logical/host and device rows (shared with SGLang's allocator adapter).
        buffers: device buffers of offloaded requests.
        host_pool: host KV rows, indexed by logical location.
        device_layers: one device KV tensor per layer, rows along dim 0.
        req_to_token: int32 ``[R, C]`` logical location of each position of each request slot
            (SGLang's ``ReqToTokenPool.req_to_token``).
        ops: module with ``swap_in``, ``copy_rows``, ``backup_newest`` and ``bind_rows`` (the CUDA ops
            or their reference twins).
        streams: side streams and events (CPU stand-in by default).
        agree: makes event-dependent decisions identical across TP ranks (all-reduce MIN of a
            list of booleans); identity on one rank.
    """

    def __init__(
        self,
        config: HiSparseConfig,
        allocator: KVAllocator,
        buffers: DeviceBufferPool,
        host_pool: HostKVPool,
        device_layers: Sequence[torch.Tensor],
        req_to_token: torch.Tensor,
        ops=reference,
        streams: StreamSet | None = None,
        agree: Callable[[list[bool]], list[bool]] | None = None,
    ) -> None:
        if allocator.page_size != config.page_size or buffers.page_size != config.page_size:
            raise HiSparseMemoryError(
                f"page sizes disagree: config {config.page_size}, allocator {allocator.page_size}, "
                f"buffers {buffers.page_size}."
            )
        if len(device_layers) != host_pool.layer_num or buffers.layer_num != host_pool.layer_num:
            raise HiSparseMemoryError(
                f"layer counts disagree: device {len(device_layers)}, host {host_pool.layer_num}, "
                f"buffers {buffers.layer_num}."
            )
        self.config = config
        self.allocator = allocator
        self.buffers = buffers
        self.host_pool = host_pool
        self.device_layers = LayerSet(device_layers)
        self.host_layers = LayerSet(host_pool.layers)
        self.req_to_token = req_to_token
        self.ops = ops
        self.device = allocator.device
        self.streams = streams or StreamSet(self.device)
        self.agree = agree or (lambda flags: flags)
        self.page_size = config.page_size
        self.buffer_size = config.device_buffer_size
        self.buffer_pages = (config.device_buffer_size + config.page_size) // config.page_size
        self.requests: dict[int, RequestRecord] = {}
        self.pending: list[int] = []
        self.num_real_reqs = torch.zeros(1, dtype=torch.int32, device=self.device)
        # One layer's swap-in tables per layer, built once (fixed tensors and views of them).
        self.layer_tables = [
            SwapInTables(
                req_to_token, allocator.device_row_of_loc, buffers.buffer_of_req, buffers.slot_rows,
                buffers.slot_tokens[layer], buffers.slot_stamps[layer], buffers.token_slot[layer],
                self.host_layers[layer], self.device_layers[layer],
            )
            for layer in range(host_pool.layer_num)
        ]
        self.top_k_rows = torch.full(
            (buffers.num_req_slots, config.top_k), -1, dtype=torch.int32, device=self.device
        )
        self.swap_counters = torch.zeros(2, dtype=torch.int64, device=self.device)
        self._no_pages = torch.zeros(0, dtype=torch.int64, device=self.device)
        # The last copy enqueued on the backup stream (the tail of a completed promotion): frees
        # of device rows are ordered after it.
        self._last_backup: CopyEvent | None = None
        self.slots = SlotTable(buffers.num_req_slots, config.page_size)
        # Slots with a promotion in flight: with none, and no offloaded request, the common decode
        # step skips the mode-switch scans.
        self._promoting: set[int] = set()
        self._counter_mirror = torch.zeros(2, dtype=torch.int64, pin_memory=self.streams.is_cuda)
        self._counter_event: CopyEvent | None = None
        self._counter_values = [0, 0]
        self.demotions = 0
        self.promotions = 0
        self.promotion_cancels = 0
        self.switch_seconds_max = 0.0
        self._step_host = (0.0, 0.0, 0)  # prepare_decode host time: sum, max, steps since last taken
        self._marks: list[tuple[str, float]] = []

    # ================================================================== admission
    def admit_prefilled(self, slot: int, prefill_len: int) -> None:
        """A request finished prefill: its ``prefill_len`` tokens are resident; stage them to host."""
        self._check_new(slot)
        self._check_length(slot, prefill_len, "prefill_len")
        locs = self.req_to_token[slot, :prefill_len].to(torch.int64)
        rows = self.allocator.translate(locs)
        with self.streams.on(self.streams.staging):
            self.ops.copy_rows(self.device_layers, self.host_layers, rows, locs)
            staging = self.streams.record(self.streams.staging)
            self.streams.keep_alive(locs, self.streams.staging)
            self.streams.keep_alive(rows, self.streams.staging)
        self.requests[slot] = RequestRecord(
            self.slots, slot, prefill_len, decoding=False, staging=staging, mode_step=self.streams.step
        )
        self.pending.append(slot)

    def collect_ready(self) -> list[int]:
        """Requests admitted by :meth:`admit_prefilled` that may start decoding (FIFO prefix).

        With ``resident_first`` every staged request is ready at once (it decodes resident while
        its KV streams to the host). Otherwise a request that must be demoted at its first decode
        step waits until its staging copy is done.
        """
        if not self.pending:
            return []
        flags = []
        for slot in self.pending:
            record = self.requests[slot]
            must_demote = not self.config.resident_first and record.seq_len - 1 >= self.buffer_size
            flags.append(not must_demote or record.staging is None or record.staging.query())
        flags = self.agree(flags)
        count = 0
        while count < len(flags) and flags[count]:
            count += 1
        ready, self.pending = self.pending[:count], self.pending[count:]
        self.slots.release_for_decoding(ready)
        return ready

    def has_pending(self) -> bool:
        return bool(self.pending)

    def admit_direct(self, slot: int, kv_len: int) -> None:
        """PD disaggregation: positions ``[0, kv_len)`` were written to the host pool directly.

        A short request (its KV fits in a buffer) becomes resident by copying its KV to fresh
        device pages; a long one starts offloaded with an empty buffer (every first lookup
        misses) and may be promoted later.
        """
        self._check_new(slot)
        self._check_length(slot, kv_len, "kv_len")
        record = RequestRecord(self.slots, slot, kv_len, decoding=True, mode_step=self.streams.step)
        locs = self.req_to_token[slot, :kv_len].to(torch.int64)
        pages = self._alloc_pages_with_reclaim(self.direct_admission_pages(kv_len))
        if kv_len - 1 < self.buffer_size:
            rows = self.allocator.device_rows.page_rows(pages)[:kv_len]
            self.ops.copy_rows(self.host_layers, self.device_layers, locs, rows)
            self.allocator.map_request_pages_(locs, pages)
        else:
            self.buffers.acquire(slot, self.allocator.device_rows.page_rows(pages), first_token=None)
            self.allocator.unmap_(locs)
            record.mode = OFFLOADED
        self.requests[slot] = record

    def direct_admission_pages(self, kv_len: int) -> int:
        """Device pages :meth:`admit_direct` takes for a request of ``kv_len`` tokens: every page of
        its KV when it fits a buffer (it becomes resident), else one buffer (it starts offloaded)."""
        if kv_len - 1 < self.buffer_size:
            return -(-kv_len // self.page_size)
        return self.buffer_pages

    def obtainable_pages(self) -> int:
        """Device pages free now or freeable by :meth:`reclaim` (promotion cancels, demotions)."""
        return self.allocator.device_rows.free_pages + self.reclaimable_pages()

    # ================================================================== decode step
    def prepare_decode(self, slots: Sequence[int], seq_lens: Sequence[int], new_locs: torch.Tensor) -> None:
        """Bind the new token of every request of a decode batch to a device row.

        The common step (every request resident, none starting a page) checks and advances the
        batch in two short loops over Python lists and launches nothing.

        Args:
            slots: request slots of the batch (Python ints), distinct.
            seq_lens: lengths including the new token (its position is ``seq_len - 1``), one per slot.
            new_locs: int64 ``[B]`` on ``device``: logical location of each new token.

        Raises:
            HiSparseMemoryError: a slot is unknown, still staging or repeated, the lengths do not
                match the slots, or a request would advance by other than one token.
        """
        entered = time.perf_counter()
        bound = self._check_decode_batch(slots, seq_lens, new_locs)
        self.streams.step += 1
        switched = False
        if self._promoting or self.slots.num_offloaded or not self.config.resident_first or (
            len(bound) > self.allocator.device_rows.free_pages
        ):
            before = self._switch_counts()
            started = time.perf_counter()
            self._marks = [("start", started)]
            self._switch_modes([self.requests[slot] for slot in slots])
            switched = self._switch_counts() != before
            if switched:
                self._note_switch_time("decode step", time.perf_counter() - started, before)
                bind_at = self.slots.bind_at
                bound = [row for row, (slot, length) in enumerate(zip(slots, seq_lens)) if length >= bind_at[slot]]
        self._assign_new_rows(slots, bound, new_locs)
        self._advance(slots, seq_lens, bound)
        if switched:
            # Rows freed this step may still be read by copies in flight: order everything later
            # (every forward waits for the schedule stream) after them.
            self._fence_copies()
        spent = time.perf_counter() - entered
        self._step_host = (self._step_host[0] + spent, max(self._step_host[1], spent), self._step_host[2] + 1)

    def _check_decode_batch(self, slots: Sequence[int], seq_lens: Sequence[int], new_locs: torch.Tensor) -> list[int]:
        """Typed errors for a decode call that does not describe one step of admitted requests;
        returns the batch rows whose new token needs binding (``SlotTable.bind_at``).

        One comparison per request covers the common case: ``SlotTable.next_len`` holds
        ``seq_len + 1`` for exactly the requests released for decoding."""
        count = len(slots)
        if len(seq_lens) != count or new_locs.shape[0] != count:
            raise HiSparseMemoryError(
                f"decode step of {count} request slots with {len(seq_lens)} seq_lens and "
                f"{new_locs.shape[0]} new locations; pass one of each per slot."
            )
        next_len, bind_at = self.slots.next_len, self.slots.bind_at
        bound = []
        try:
            for row, (slot, length) in enumerate(zip(slots, seq_lens)):
                if next_len[slot] != length:
                    raise LookupError
                if length >= bind_at[slot]:
                    bound.append(row)
        except (LookupError, TypeError):
            for slot, length in zip(slots, seq_lens):
                record = self._record(slot)  # raises for an unknown or staging slot
                if length != record.seq_len + 1:
                    raise HiSparseMemoryError(
                        f"request slot {slot}: decode step to length {length} but the coordinator has "
                        f"{record.seq_len} tokens (one step at a time)."
                    ) from None
        if count > 1 and len(set(slots)) != count:
            repeated = sorted({slot for slot in slots if list(slots).count(slot) > 1})
            raise HiSparseMemoryError(
                f"decode step lists request slot(s) {repeated[:8]} more than once; each request decodes one "
                f"token per step."
            )
        return bound

    def _advance(self, slots: Sequence[int], seq_lens: Sequence[int], bound: list[int]) -> None:
        """The batch now has ``seq_lens``; a resident request that started a page binds next at
        its next page start."""
        table = self.slots
        seq_len, next_len = table.seq_len, table.next_len
        for slot, length in zip(slots, seq_lens):
            seq_len[slot] = length
            next_len[slot] = length + 1
        for row in bound:
            slot = slots[row]
            if not table.offloaded[slot]:
                table.bind_at[slot] = table.next_page_start_len(seq_lens[row])

    def swap_in(
        self, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, top_k: torch.Tensor, layer_id: int
    ) -> torch.Tensor:
        """Device rows of one layer's top-k tokens (int32 ``[B, K]``, -1 for padding)."""
        batch = top_k.shape[0]
        tables = self.layer_tables[layer_id]
        # The layer's new KV is written: back it up before this layer's swap-in reuses any row.
        self.ops.backup_newest(
            req_pool_indices, seq_lens, self.num_real_reqs, tables.req_to_token, tables.device_row_of_loc,
            tables.device_kv, tables.host_kv,
        )
        return self.ops.swap_in(
            top_k,
            seq_lens,
            req_pool_indices,
            self.num_real_reqs,
            tables,
            out=self.top_k_rows[:batch],
            counters=self.swap_counters,
            threads=self.config.swap_in_block_size,
        )

    def wait_for_pending_backup(self) -> None:
        """SGLang calls this before each decode forward. Nothing to wait for: the forward backs up
        its own new tokens (``backup_newest``), so no copy of an earlier step is in flight that
        the forward could overwrite."""

    def _fence_copies(self) -> None:
        """Order later work of the current stream (and every forward) after the copies in flight,
        before device rows they read are freed and handed out again."""
        if self._last_backup is not None:
            self._last_backup.wait_on_current_stream()

    def swap_counter_values(self, exact: bool = True) -> list[int]:
        """(lookups, misses) so far; ``exact=False`` does not wait for the GPU and returns
        the values of the previous call on CUDA (for periodic metrics on the scheduler's hot path)."""
        if exact or not self.streams.is_cuda:
            return self.swap_counters.tolist()
        if self._counter_event is None or self._counter_event.query():
            if self._counter_event is not None:
                self._counter_values = self._counter_mirror.tolist()
            self._counter_mirror.copy_(self.swap_counters, non_blocking=True)
            self._counter_event = self._record_current()
        return list(self._counter_values)

    def _record_current(self) -> CopyEvent:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return CopyEvent(self.streams, event)

    # ================================================================== request end
    def finish(self, slot: int) -> None:
        """Release what the coordinator holds for a request that ends (finish, abort, retract).

        Resident rows are freed afterwards by ``KVAllocator.free`` of the request's locations
        (SGLang's ``release_kv_cache``); the coordinator frees buffers and promotion pages and
        unmaps every location of an offloaded request so that free does not see buffer rows.
        Unknown slots are ignored (a request that never reached decoding).
        """
        if slot in self.pending:
            self.pending.remove(slot)
        record = self.requests.pop(slot, None)
        if record is None:
            return
        self.streams.wait_for_producer()
        self._fence_copies()
        if record.staging is not None:
            record.staging.wait_on_current_stream()
        if record.promotion is not None:
            self._cancel_promotion(record)
        if record.mode == OFFLOADED:
            self._free_buffer(slot)
            self.allocator.unmap_(self.req_to_token[slot, : record.seq_len])
        self.slots.forget(slot)

    def retract(self, slot: int) -> None:
        """End a request whose KV the scheduler keeps to resume it later (PD decode retraction).

        Its host rows hold positions ``[0, seq_len)`` once the forward that wrote the newest token
        is done (it backs the token up itself); SGLang reads them after synchronizing the device
        (``HiSparseTokenAllocator.get_cpu_copy``). Released like :meth:`finish`.
        """
        self.finish(slot)

    # ================================================================== capacity
    def reclaimable_pages(self) -> int:
        """Device pages demotions and promotion cancels could free now."""
        total = 0
        for record in self.requests.values():
            if record.promotion is not None:
                total += record.promotion.pages.numel()
            if self._demotable(record):
                total += self._pages_held(record) - self.buffer_pages
        return total

    def can_decode(self, slots: Sequence[int]) -> bool:
        """Whether the next decode step of ``slots`` can bind every new token to a device row.

        Offloaded requests need no device row for a new token; a resident request needs a new
        page when its new token starts one, unless it can be demoted instead. The scheduler
        retracts requests while this is False (SGLang's ``check_decode_mem``).
        """
        free = self.allocator.device_rows.free_pages
        if len(slots) <= free:  # even if every request started a page (the common case: no scan)
            return True
        records = [self._record(slot) for slot in slots]
        needing = [r for r in records if self._starts_page(r)]
        if len(needing) <= free:
            return True
        return sum(not self._demotable(r) for r in needing) <= free + self.reclaimable_pages()

    def reclaim(self, pages_needed: int) -> bool:
        """Free device pages until ``pages_needed`` are free; returns whether that succeeded."""
        if self.allocator.device_rows.free_pages >= pages_needed:
            return True
        before = self._switch_counts()
        started = time.perf_counter()
        self._marks = [("start", started)]
        try:
            return self._reclaim(pages_needed)
        finally:
            self._note_switch_time("reclaim", time.perf_counter() - started, before)

    def take_switch_time_max(self) -> float:
        """Longest time (s) one step spent switching modes since the previous call; resets it.

        Host wall time of the switching code of ``prepare_decode`` or ``reclaim``: what a demotion
        storm adds to the scheduler's step (the GPU work it enqueues is a few table updates).
        """
        value, self.switch_seconds_max = self.switch_seconds_max, 0.0
        return value

    def take_step_host_time(self) -> tuple[float, float]:
        """Mean and longest host time (s) of ``prepare_decode`` since the previous call; resets them.

        The bookkeeping HiSparse adds to every decode step of the scheduler (backup and bind
        launches, mode switches): with SGLang's overlap scheduler it is hidden behind the forward
        pass only while shorter than it.
        """
        total, longest, steps = self._step_host
        self._step_host = (0.0, 0.0, 0)
        return (total / steps if steps else 0.0), longest

    def _switch_counts(self) -> tuple[int, int, int]:
        return self.demotions, self.promotions, self.promotion_cancels

    def _note_switch_time(self, where: str, seconds: float, before: tuple[int, int, int]) -> None:
        self.switch_seconds_max = max(self.switch_seconds_max, seconds)
        if seconds > SLOW_SWITCH_SECONDS:
            demoted, promoted, cancelled = (a - b for a, b in zip(self._switch_counts(), before))
            steps = ", ".join(
                f"{label} {1e3 * (t - t0):.1f}" for (_, t0), (label, t) in zip(self._marks, self._marks[1:])
            )
            logger.warning(
                "HiSparse: %s spent %.1f ms switching modes (%d demotions, %d promotions completed, "
                "%d promotions cancelled, %d requests; ms per part: %s).",
                where, 1e3 * seconds, demoted, promoted, cancelled, len(self.requests), steps or "-",
            )

    def _mark(self, label: str) -> None:
        """Time stamp for the slow-switch log line (what a slow step waited on)."""
        self._marks.append((label, time.perf_counter()))

    def _reclaim(self, pages_needed: int) -> bool:
        self.streams.wait_for_producer()
        self._fence_copies()
        self._mark("fence")
        for record in sorted(self.requests.values(), key=lambda r: -r.seq_len):
            if self.allocator.device_rows.free_pages >= pages_needed:
                break
            if record.promotion is not None:
                self._cancel_promotion(record)
        for record in self._demotion_order():
            if self.allocator.device_rows.free_pages >= pages_needed:
                break
            self._order_after_staging(record)
            self._demote(record, record.seq_len)
        return self.allocator.device_rows.free_pages >= pages_needed

    def stats(self, exact: bool = True) -> CoordinatorStats:
        counters = self.swap_counter_values(exact)
        modes = [record.mode for record in self.requests.values()]
        return CoordinatorStats(
            pools=self.allocator.stats(self.buffers.num_buffers, self.buffers.used_buffers),
            resident_requests=modes.count(RESIDENT),
            offloaded_requests=modes.count(OFFLOADED),
            promoting_requests=sum(r.promotion is not None for r in self.requests.values()),
            demotions=self.demotions,
            promotions=self.promotions,
            promotion_cancels=self.promotion_cancels,
            swap_in_lookups=counters[0],
            swap_in_misses=counters[1],
            bytes_swapped_in=counters[1] * self.host_pool.item_bytes,
        )

    # ================================================================== internals: decode step
    def _switch_modes(self, records: list[RequestRecord]) -> None:
        """Finish promotions, force or relieve demotions, start promotions (bounded per step)."""
        step = self.streams.step
        switching = False

        promoting = [self.requests[slot] for slot in sorted(self._promoting)]
        done = self.agree([r.promotion.event.query() for r in promoting]) if promoting else []
        for record, finished in zip(promoting, done):
            if finished:
                if not switching:
                    self.streams.wait_for_producer()
                    switching = True
                self._complete_promotion(record)

        if not self.config.resident_first:
            for record in records:
                # The request will hold seq_len + 1 tokens: demote once its older tokens exceed the buffer.
                if record.mode == RESIDENT and record.seq_len - 1 >= self.buffer_size:
                    if not switching:
                        self.streams.wait_for_producer()
                        switching = True
                    self._demote(record, record.seq_len)

        needed = self._relieve_pressure(records)

        if self.config.resident_first and self.slots.num_offloaded:
            self._start_promotions(needed, step)

    def _relieve_pressure(self, records: list[RequestRecord]) -> int:
        """Cancel promotions, then demote, until the batch's new tokens fit; returns pages needed.

        Demoting a request that would start a new page this step also removes its need.
        """
        synced = False
        while True:
            needed = self._pages_needed_for_new_tokens(records)
            if needed <= self.allocator.device_rows.free_pages:
                return needed
            if not synced:
                self.streams.wait_for_producer()
                self._fence_copies()
                synced = True
            if self._promoting:
                promoting = [self.requests[slot] for slot in sorted(self._promoting)]
                self._cancel_promotion(max(promoting, key=lambda r: r.promotion.pages.numel()))
                continue
            needing = {r.slot for r in records if self._starts_page(r)}
            order = self._demotion_order(needing)
            if not order:
                raise PoolExhaustedError(
                    f"device KV pool exhausted: {needed} page(s) needed for new tokens, "
                    f"{self.allocator.device_rows.free_pages} free and nothing left to demote; "
                    f"the scheduler should have retracted a request (can_decode() was False)."
                )
            victim = order[0]
            self._order_after_staging(victim)
            self._demote(victim, victim.seq_len)

    def _starts_page(self, record: RequestRecord) -> bool:
        return record.mode == RESIDENT and record.promotion is None and record.seq_len % self.page_size == 0

    def _pages_needed_for_new_tokens(self, records: list[RequestRecord]) -> int:
        return sum(1 for r in records if self._starts_page(r))

    def _assign_new_rows(self, slots: Sequence[int], bound: list[int], new_locs: torch.Tensor) -> None:
        """Bind the new tokens of the ``bound`` batch rows, in one launch: an offloaded request's
        goes to its buffer's slot ``D``; a resident request starting a page gets a fresh device
        page, mapped whole. (A resident request continuing its page is not bound: the page was
        mapped whole.)"""
        if not bound:
            return
        offloaded = self.slots.offloaded
        bound_slots, kinds = [], []
        num_pages = 0
        for row in bound:
            slot = slots[row]
            bound_slots.append(slot)
            if offloaded[slot]:
                kinds.append(BIND_BUFFER_SLOT)
            else:
                kinds.append(num_pages)
                num_pages += 1
        if num_pages > self.allocator.device_rows.free_pages:
            raise PoolExhaustedError(
                f"device KV pool exhausted while binding new tokens: {num_pages} resident request(s) start a "
                f"page, {self.allocator.device_rows.free_pages} page(s) free."
            )
        pages = self.allocator.device_rows.alloc_pages(num_pages) if num_pages else self._no_pages
        self.ops.bind_rows(
            upload_ints([bound, bound_slots, kinds], self.device),
            new_locs.to(torch.int64),
            pages,
            self.allocator.device_row_of_loc,
            self.buffers.buffer_of_req,
            self.buffers.slot_rows,
            self.buffer_size,
            self.page_size,
        )

    # ================================================================== internals: transitions
    def _pages_held(self, record: RequestRecord) -> int:
        if record.mode == OFFLOADED:
            return self.buffer_pages
        return -(-record.seq_len // self.page_size)

    def _demotable(self, record: RequestRecord) -> bool:
        return record.mode == RESIDENT and record.promotion is None and record.seq_len - 1 >= self.buffer_size

    def _demotion_order(self, needing: set[int] = frozenset()) -> list[RequestRecord]:
        """Demotion candidates: out of cooldown first, then most pages gained, then longest context.

        The gain of a demotion is the pages it frees plus one if the request would otherwise start
        a new page this step (``needing``).
        """
        step = self.streams.step
        cooldown = self.config.switch_cooldown_steps

        def key(record: RequestRecord):
            gain = self._pages_held(record) - self.buffer_pages + (record.slot in needing)
            return (step - record.mode_step < cooldown, -gain, -record.seq_len, record.slot)

        return sorted((r for r in self.requests.values() if self._demotable(r)), key=key)

    def _free_buffer(self, slot: int) -> None:
        """Free the device pages of a request's buffer without waiting for the GPU.

        A buffer is whole pages: every group of ``page_size`` slots (the LRU slots, then the reserved
        page whose slot ``D`` holds the newest token) lies in one page, so the first slot of each
        group names it and no ``unique()`` (a host sync) is needed.
        """
        rows = self.buffers.release(slot)
        self.allocator.free_device_pages(rows[:: self.page_size] // self.page_size)

    def _order_after_staging(self, record: RequestRecord) -> None:
        """Before demoting a request whose prefill KV may still be streaming to the host: order
        later work of the current stream (every forward that could reuse the freed pages or read
        the host rows) after that copy. A GPU-side wait: a storm of demotions of fresh prefills
        must not block the scheduler on their copies."""
        if record.staging is not None and not record.staging.query():
            record.staging.wait_on_current_stream()

    def _demote(self, record: RequestRecord, num_tokens: int) -> None:
        """Turn a resident request with ``num_tokens`` resident tokens into an offloaded one.

        The last whole pages before the newest token's page become the LRU slots (slot ``i`` holds
        token ``first + i``), the newest token's page becomes the reserved page with the newest
        token's row in slot ``D``; every other page is freed.
        """
        page = self.page_size
        newest = num_tokens - 1
        newest_page = newest // page
        first = (newest_page - self.buffer_size // page) * page
        if first < 0:
            raise HiSparseMemoryError(
                f"request slot {record.slot}: {num_tokens} tokens do not fill a buffer of {self.buffer_size}."
            )
        self._mark("plan")
        locs = self.req_to_token[record.slot, :num_tokens].to(torch.int64)
        rows = self.allocator.translate(locs).to(torch.int64)
        self._mark("rows")
        lru_rows = rows[first : first + self.buffer_size]
        newest_row = rows[newest : newest + 1]
        page_base = newest_row - newest % page
        # The page's other offsets, in order, without a boolean mask (which would wait for the GPU).
        other_offsets = torch.arange(page - 1, dtype=torch.int64, device=self.device)
        other_offsets += (other_offsets >= newest % page).to(torch.int64)
        buffer_rows = torch.cat([lru_rows, newest_row, page_base + other_offsets])
        if first > 0:
            # Resident rows are page-aligned with positions: rows[0], rows[page], ... lie in distinct
            # pages, so no unique() (and no GPU sync) is needed.
            self.allocator.free_device_pages(rows[:first:page] // page)
        self._mark("free")
        # The newest token keeps its row, which is now the reserved slot.
        self.allocator.unmap_(locs[:newest])
        self._mark("unmap")
        self.buffers.acquire(record.slot, buffer_rows, first_token=first)
        self._mark("buffer")
        record.mode = OFFLOADED
        record.mode_step = self.streams.step
        self.demotions += 1

    def _start_promotions(self, pages_reserved: int, step: int) -> None:
        capacity = self.allocator.device_rows.capacity_pages
        keep_free = int(self.config.promote_free_fraction * capacity)
        started = 0
        candidates = sorted(
            (
                r
                for r in self.requests.values()
                if r.mode == OFFLOADED
                and r.promotion is None
                and step - r.mode_step >= self.config.switch_cooldown_steps
                and r.slot not in self.pending
            ),
            key=lambda r: (r.seq_len, r.slot),
        )
        for record in candidates:
            if started >= self.config.max_switches_per_step:
                break
            # Positions [0, seq_len) are on the host once this step's backup lands.
            covered = record.seq_len
            pages_needed = -(-covered // self.page_size)
            free_after = self.allocator.device_rows.free_pages - pages_reserved - pages_needed
            if free_after < keep_free:
                break
            pages = self.allocator.device_rows.alloc_pages(pages_needed)
            locs = self.req_to_token[record.slot, :covered].to(torch.int64)
            rows = self.allocator.device_rows.page_rows(pages)[:covered]
            # Positions up to the newest are on the host once the forward in flight (the producer,
            # which backs its new tokens up) is done: streams.on orders the copy after it.
            with self.streams.on(self.streams.promotion):
                self.ops.copy_rows(self.host_layers, self.device_layers, locs, rows)
                event = self.streams.record(self.streams.promotion)
                self.streams.keep_alive(locs, self.streams.promotion)
                self.streams.keep_alive(rows, self.streams.promotion)
            record.promotion = _Promotion(pages=pages, covered=covered, event=event)
            self._promoting.add(record.slot)
            started += 1

    def _complete_promotion(self, record: RequestRecord) -> None:
        """Switch an offloaded request whose promotion copy is done to resident."""
        promotion = record.promotion
        total = record.seq_len  # positions [0, seq_len) are on host once this step's backup lands
        extra_pages = -(-total // self.page_size) - promotion.pages.numel()
        if extra_pages > 0:
            if self.allocator.device_rows.free_pages < extra_pages:
                self._cancel_promotion(record)
                return
            pages = torch.cat([promotion.pages, self.allocator.device_rows.alloc_pages(extra_pages)])
        else:
            pages = promotion.pages
        rows = self.allocator.device_rows.page_rows(pages)[:total]
        locs = self.req_to_token[record.slot, :total].to(torch.int64)
        if total > promotion.covered:
            # Tokens decoded while the promotion copy ran (on the host once the forward in flight
            # is done: streams.on orders the copy after it).
            with self.streams.on(self.streams.backup):
                self.ops.copy_rows(
                    self.host_layers, self.device_layers, locs[promotion.covered :], rows[promotion.covered :]
                )
                self._last_backup = self.streams.record(self.streams.backup)
                self.streams.keep_alive(locs, self.streams.backup)
                self.streams.keep_alive(rows, self.streams.backup)
        self._free_buffer(record.slot)
        self.allocator.map_request_pages_(locs, pages)
        record.mode = RESIDENT
        record.promotion = None
        self._promoting.discard(record.slot)
        record.mode_step = self.streams.step
        self.promotions += 1

    def _cancel_promotion(self, record: RequestRecord) -> None:
        promotion = record.promotion
        promotion.event.wait_on_current_stream()
        self.allocator.device_rows.free_pages_(promotion.pages)
        record.promotion = None
        self._promoting.discard(record.slot)
        self.promotion_cancels += 1

    def _alloc_pages_with_reclaim(self, count: int) -> torch.Tensor:
        if not self.reclaim(count):
            raise PoolExhaustedError(
                f"device KV pool exhausted: {count} page(s) needed, {self.allocator.device_rows.free_pages} "
                f"free after demoting every eligible request."
            )
        return self.allocator.device_rows.alloc_pages(count)

    # ================================================================== helpers
    def _record(self, slot: int) -> RequestRecord:
        record = self.requests.get(slot)
        if record is None:
            raise HiSparseMemoryError(f"request slot {slot} is not admitted to the HiSparse coordinator.")
        if slot in self.pending:
            raise HiSparseMemoryError(f"request slot {slot} is still staging; collect_ready() has not released it.")
        return record

    def _check_new(self, slot: int) -> None:
        if slot in self.requests:
            raise HiSparseMemoryError(f"request slot {slot} is already admitted.")
        if not 0 <= slot < self.buffers.num_req_slots:
            raise HiSparseMemoryError(f"request slot {slot} is outside [0, {self.buffers.num_req_slots}).")

    def _check_length(self, slot: int, length: int, name: str) -> None:
        """A new request's KV length: at least one token, within its slot's context."""
        context = self.req_to_token.shape[1]
        if not 1 <= length <= context:
            raise HiSparseMemoryError(
                f"request slot {slot}: {name} must be in [1, {context}] (the request slot's context), got {length}."
            )
