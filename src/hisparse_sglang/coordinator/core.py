"""The coordinator's mechanism: state transitions of requests and the tables behind them.

Admission (after prefill, or PD transfer), the decode step's bindings, each layer's swap-in,
demotion, promotion, cancel and release. Whom to switch is decided by :class:`ModePolicy`
(``policy.py``); what is counted and logged lives in :class:`Telemetry` (``telemetry.py``).

Host pool shared by the TP ranks of a node (``ranks_share_host_pool``, memory/shared_host_pool.py):
only its writer (``host_pool.writable``) backs up new tokens and stages prefills; the readers skip
both and read what it wrote. Where the writer's stores and a reader's loads are not ordered by the
collectives inside every layer's forward (docs/shared-host-pool.md, "Ordering"), the ranks wait for
each other on the host: before demoting a request whose prefill may still be staging.
``rank_check`` compares the ranks' allocation state every few hundred decode steps.
"""

from __future__ import annotations

import operator
import time
from typing import Callable, Sequence

import torch

from hisparse_sglang.config import HiSparseConfig
from hisparse_sglang.coordinator.policy import ModePolicy
from hisparse_sglang.coordinator.speculative import VerifySteps
from hisparse_sglang.coordinator.staging import BACKGROUND_COPY_BLOCKS, PrefillStaging
from hisparse_sglang.coordinator.state import (
    DECODE_STEPS,
    OFFLOADED,
    RESIDENT,
    VERIFY_STEPS,
    Promotion,
    RequestRecord,
    SlotTable,
)
from hisparse_sglang.coordinator.telemetry import CoordinatorStats, SwapCounters, Telemetry
from hisparse_sglang.errors import HiSparseMemoryError, PoolExhaustedError
from hisparse_sglang.memory.allocator import KVAllocator
from hisparse_sglang.memory.consistency import RankStateCheck, allocator_fingerprint
from hisparse_sglang.memory.device_buffers import DeviceBufferPool
from hisparse_sglang.memory.host_pool import HostKVPool
from hisparse_sglang.memory.paged import upload_ints
from hisparse_sglang.ops import reference
from hisparse_sglang.ops.layers import LayerSet
from hisparse_sglang.ops.reference import BIND_BUFFER_SLOT
from hisparse_sglang.ops.tables import SwapInTables
from hisparse_sglang.streams import CopyEvent, StreamSet

__all__ = ["Coordinator", "BACKGROUND_COPY_BLOCKS"]


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
        ops: module with ``swap_in``, ``copy_rows``, ``copy_row_runs``, ``backup_newest`` and ``bind_rows``
            (the CUDA ops or their reference twins).
        streams: side streams and events (CPU stand-in by default).
        agree: makes event-dependent decisions identical across TP ranks (all-reduce MIN of a
            list of booleans); identity on one rank.
        rank_check: compares the allocation state of the TP ranks that share ``host_pool``
            (:class:`~hisparse_sglang.memory.consistency.RankStateCheck`) every few hundred decode
            steps; None: no check.
        ranks_share_host_pool: the ranks of ``agree`` share their nodes' host pools
            (``memory.shared_host_pool.open_host_pool`` with their group): a wait for another rank's
            host writes becomes a collective. The same on every rank, also on one alone on its node.
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
        rank_check: RankStateCheck | None = None,
        ranks_share_host_pool: bool = False,
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
        self.rank_check = rank_check
        self.ranks_share_host_pool = ranks_share_host_pool
        # Only the writer of a shared pool (and every private pool) writes host rows; its backups
        # are fenced system-wide when other processes read them (ops: backup_newest).
        self._writes_host = host_pool.writable
        self._fence_backups = host_pool.writable and host_pool.shared
        self.page_size = config.page_size
        self.buffer_size = config.device_buffer_size
        self.policy = ModePolicy(config)
        self.telemetry = Telemetry()
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
        self.counters = SwapCounters(self.streams)
        self.swap_counters = self.counters.swap_in
        self._no_pages = torch.zeros(0, dtype=torch.int64, device=self.device)
        # The last copy enqueued on the backup stream (the tail of a completed promotion): frees
        # of device rows are ordered after it.
        self._last_backup: CopyEvent | None = None
        self.slots = SlotTable(buffers.num_req_slots, config.page_size)
        # Slots with a promotion in flight: with none, and no offloaded request, the common decode
        # step skips the mode-switch scans.
        self._promoting: set[int] = set()
        # Speculative decoding's verify steps (coordinator/speculative.py). A coordinator serves
        # either plain decode steps or verify steps, whichever comes first.
        self.speculative = VerifySteps(self)
        self._step_kind: str | None = None
        # Prefills' KV on its way to the host by the copy engines (coordinator/staging.py).
        self.prefill_staging = PrefillStaging(self)

    # ================================================================== admission
    def admit_prefilled(self, slot: int, prefill_len: int) -> None:
        """A request finished prefill: its ``prefill_len`` tokens are resident; stage them to host (by the
        copy engines once its rows reached the host: :class:`~hisparse_sglang.coordinator.staging.PrefillStaging`)."""
        self._check_new(slot)
        self._check_length(slot, prefill_len, "prefill_len")
        if self._writes_host and not self.host_pool.shared:
            staging = self.prefill_staging.stage(slot, prefill_len)
        else:  # a shared pool (coordinator/staging.py): its writer copies at once, a reader's event completes at once
            locs = self.req_to_token[slot, :prefill_len].to(torch.int64)
            rows = self.allocator.translate(locs)
            with self.streams.on(self.streams.staging):
                if self._writes_host:
                    self.ops.copy_rows(self.device_layers, self.host_layers, rows, locs, max_blocks=BACKGROUND_COPY_BLOCKS)
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
        self.prefill_staging.issue_ready()
        if not self.pending:
            return []
        flags = []
        for slot in self.pending:
            record = self.requests[slot]
            flags.append(not self.policy.waits_for_staging(record) or record.staging is None or record.staging.query())
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
        pages = self._alloc_pages_with_reclaim(self.policy.direct_admission_pages(kv_len))
        if self.policy.fits_a_buffer(kv_len):
            rows = self.allocator.device_rows.page_rows(pages)[:kv_len]
            self.ops.copy_rows(self.host_layers, self.device_layers, locs, rows)
            self.allocator.map_request_pages_(locs, pages)
        else:
            self.buffers.acquire(slot, self.allocator.device_rows.page_rows(pages), first_token=None)
            self.allocator.unmap_(locs)
            record.mode = OFFLOADED
        self.requests[slot] = record

    def direct_admission_pages(self, kv_len: int) -> int:
        """Device pages :meth:`admit_direct` takes for a request of ``kv_len`` tokens."""
        return self.policy.direct_admission_pages(kv_len)

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
        if self._step_kind is not DECODE_STEPS:
            self._enter_step_kind(DECODE_STEPS)
        bound = self._check_decode_batch(slots, seq_lens, new_locs)
        self.streams.step += 1
        self.prefill_staging.issue_ready()
        switched = False
        if self._promoting or self.slots.num_offloaded or not self.config.resident_first or (
            len(bound) > self.allocator.device_rows.free_pages
        ):
            started, before = self.telemetry.start_switching()
            self._switch_modes([self.requests[slot] for slot in slots])
            switched = self.telemetry.end_switching("decode step", started, before, len(self.requests))
            if switched:
                bind_at = self.slots.bind_at
                bound = [row for row, (slot, length) in enumerate(zip(slots, seq_lens)) if length >= bind_at[slot]]
        self._assign_new_rows(slots, bound, new_locs)
        self.slots.advance(slots, seq_lens, bound)
        if self.rank_check is not None and self.rank_check.due(self.streams.step):
            self.rank_check.check(self.streams.step, self.rank_state())
        if switched:
            # Rows freed this step may still be read by copies in flight: order everything later
            # (every forward waits for the schedule stream) after them.
            self._fence_copies()
        self.telemetry.decode_step_done(entered)

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

    def swap_in(
        self, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, top_k: torch.Tensor, layer_id: int
    ) -> torch.Tensor:
        """Device rows of one layer's top-k tokens (int32 ``[B, K]``, -1 for padding)."""
        batch = top_k.shape[0]
        tables = self.layer_tables[layer_id]
        # The layer's new KV is written: back it up before this layer's swap-in reuses any row (a
        # reader of a shared pool does not: its writer backs the same token up, fenced).
        if self._writes_host:
            self.ops.backup_newest(
                req_pool_indices, seq_lens, self.num_real_reqs, tables.req_to_token, tables.device_row_of_loc,
                tables.device_kv, tables.host_kv, fence_system=self._fence_backups,
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

    def _enter_step_kind(self, kind: str) -> None:
        """Fix whether this coordinator serves plain decode steps or speculative verify steps.

        The two keep different tokens on the host and in slot ``D`` (a decode step's newest token
        is backed up by the next forward, a verify's accepted tokens by its commit), so one request
        must never see both; SGLang runs every request of a server one way.
        """
        if self._step_kind is not None and self._step_kind is not kind:
            raise HiSparseMemoryError(
                f"this coordinator serves {self._step_kind}, so it cannot serve {kind}: a server runs "
                f"every request with speculative decoding (prepare_verify / commit_verify) or none "
                f"(prepare_decode)."
            )
        self._step_kind = kind

    # ================================================================== speculative verify step
    def configure_verify(self, num_draft_tokens: int) -> None:
        """Fix the verify positions ``T`` at startup, checking the setup; see :meth:`VerifySteps.configure`."""
        self.speculative.configure(num_draft_tokens)

    def prepare_verify(
        self,
        slots: Sequence[int],
        committed_lens: Sequence[int],
        allocated_lens: Sequence[int],
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        num_draft_tokens: int,
    ) -> None:
        """Before a target-verify forward (speculative decoding); see :meth:`VerifySteps.prepare`."""
        self.speculative.prepare(slots, committed_lens, allocated_lens, req_pool_indices, seq_lens, num_draft_tokens)

    def verify_page_table(self, req_pool_indices: torch.Tensor, page_table: torch.Tensor) -> torch.Tensor:
        """Once per target-verify forward: the page table for a fused top-k (device rows of resident requests,
        positions of offloaded ones); see :meth:`VerifySteps.page_table`."""
        return self.speculative.page_table(req_pool_indices, page_table)

    def swap_in_verify(
        self,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        top_k: torch.Tensor,
        layer_id: int,
        resident_rows: bool = False,
    ) -> torch.Tensor:
        """Device rows of one layer's top-k of every verify position (int32 ``[B, T, K]``); see
        :meth:`VerifySteps.swap_in`."""
        return self.speculative.swap_in(req_pool_indices, seq_lens, top_k, layer_id, resident_rows)

    def capturing_all_resident_verify(self):
        """Context for capturing the target-verify CUDA graph of all-resident steps (no swap-in in it); see
        :meth:`VerifySteps.capturing_all_resident`."""
        return self.speculative.capturing_all_resident()

    @property
    def verify_all_resident(self) -> bool:
        """The prepared verify step has rows and every one is resident (:attr:`VerifySteps.prepared_all_resident`)."""
        return self.speculative.prepared_all_resident

    def cap_verify(self, accept_lens: torch.Tensor, accept_index: torch.Tensor) -> None:
        """Right after acceptance: accept no verify position the swap-ins left out; see
        :meth:`VerifySteps.cap_accepts`."""
        self.speculative.cap_accepts(accept_lens, accept_index)

    def commit_verify(self, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, accept_lens: torch.Tensor) -> None:
        """After acceptance: back up exactly the accepted tokens; see :meth:`VerifySteps.commit`."""
        self.speculative.commit(req_pool_indices, seq_lens, accept_lens)

    def can_verify(self, slots: Sequence[int], allocated_lens: Sequence[int]) -> bool:
        """Whether a verify step with these reserves can bind them; see :meth:`VerifySteps.can_verify`."""
        return self.speculative.can_verify(slots, allocated_lens)

    def swap_counter_values(self, exact: bool = True) -> list[int]:
        """(lookups, misses) so far (see :meth:`SwapCounters.values`)."""
        return self.counters.values(exact)[:2]

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
        if self.prefill_staging.drop(slot):
            record.staging = None  # never enqueued: the host rows of an ending request are not needed
        if record.staging is not None:
            record.staging.wait_on_current_stream()
        if record.promotion is not None:
            self._cancel_promotion(record)
        if record.mode == OFFLOADED:
            self._free_buffer(slot)
            # Under speculation the verify positions past seq_len are bound into the buffer too.
            self.allocator.unmap_(self.req_to_token[slot, : record.allocated_len])
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
        return self.policy.reclaimable_pages(self.requests.values())

    def can_decode(self, slots: Sequence[int]) -> bool:
        """Whether the next decode step of ``slots`` can bind every new token to a device row.

        Offloaded requests need no device row for a new token; a resident request needs a new
        page when its new token starts one, unless it can be demoted instead. The scheduler
        retracts requests while this is False (SGLang's ``check_decode_mem``).

        Raises:
            HiSparseMemoryError: a slot is not admitted, or still staging, whatever memory is free.
        """
        if self._step_kind is VERIFY_STEPS:
            self._enter_step_kind(DECODE_STEPS)  # raises: use can_verify
        # Every slot must be released for decoding before memory is looked at, so that misuse
        # raises with plenty of pages free too. One C-level gather from the slot table's next_len
        # (NOT_DECODING for an unknown, staging or finished slot, and for a negative one, which
        # indexes its second half) costs a fraction of what building the batch's slot list does.
        next_len = self.slots.next_len
        try:
            values = operator.itemgetter(*slots)(next_len) if len(slots) > 1 else [next_len[slot] for slot in slots]
            released = SlotTable.NOT_DECODING not in values
        except (LookupError, TypeError):
            released = False
        if not released:
            for slot in slots:
                self._record(slot)  # raises for the first unknown or staging slot, naming it
        free = self.allocator.device_rows.free_pages
        if len(slots) <= free:  # even if every request started a page (the common case: no scan)
            return True
        records = [self._record(slot) for slot in slots]
        needing = [r for r in records if self.policy.starts_page(r)]
        if len(needing) <= free:
            return True
        return sum(not self.policy.demotable(r) for r in needing) <= free + self.reclaimable_pages()

    def reclaim(self, pages_needed: int) -> bool:
        """Free device pages until ``pages_needed`` are free; returns whether that succeeded."""
        if self.allocator.device_rows.free_pages >= pages_needed:
            return True
        started, before = self.telemetry.start_switching()
        try:
            return self._reclaim(pages_needed)
        finally:
            self.telemetry.end_switching("reclaim", started, before, len(self.requests))

    def take_switch_time_max(self) -> float:
        return self.telemetry.take_switch_time_max()

    def take_step_host_time(self) -> tuple[float, float]:
        return self.telemetry.take_step_host_time()

    def _reclaim(self, pages_needed: int) -> bool:
        self.streams.wait_for_producer()
        self._fence_copies()
        self.telemetry.mark("fence")
        for record in sorted(self.requests.values(), key=lambda r: -r.seq_len):
            if self.allocator.device_rows.free_pages >= pages_needed:
                break
            if record.promotion is not None:
                self._cancel_promotion(record)
        for record in self.policy.demotion_order(self.requests.values(), self.streams.step):
            if self.allocator.device_rows.free_pages >= pages_needed:
                break
            self._order_after_staging(record)
            self._demote(record, record.seq_len)
        return self.allocator.device_rows.free_pages >= pages_needed

    def rank_state(self) -> dict[str, int]:
        """What TP ranks sharing a host pool must agree on: their allocations and their requests."""
        state = allocator_fingerprint(self.allocator)
        state["requests"] = len(self.requests)
        state["offloaded requests"] = self.slots.num_offloaded
        state["tokens"] = sum(self.slots.seq_len[slot] for slot in self.requests)
        return state

    def stats(self, exact: bool = True) -> CoordinatorStats:
        counters = self.counters.values(exact)
        modes = [record.mode for record in self.requests.values()]
        return CoordinatorStats(
            pools=self.allocator.stats(self.buffers.num_buffers, self.buffers.used_buffers),
            resident_requests=modes.count(RESIDENT),
            offloaded_requests=modes.count(OFFLOADED),
            promoting_requests=sum(r.promotion is not None for r in self.requests.values()),
            demotions=self.telemetry.demotions,
            promotions=self.telemetry.promotions,
            promotion_cancels=self.telemetry.promotion_cancels,
            swap_in_lookups=counters[0],
            swap_in_misses=counters[1],
            bytes_swapped_in=counters[1] * self.host_pool.item_bytes,
            verify_rows_capped=counters[2],
            verify_drafts_dropped=counters[3],
            prefills_staged_by_dma=self.prefill_staging.by_dma,
            prefills_staged_by_kernel=self.prefill_staging.by_kernel,
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
                if self.policy.demoted_when_decoding(record):
                    if not switching:
                        self.streams.wait_for_producer()
                        switching = True
                    self._order_after_staging(record)
                    self._demote(record, record.seq_len)

        needed = self._relieve_pressure(records)

        if self.policy.promotes() and self.slots.num_offloaded:
            self._start_promotions(needed, step)

    def _relieve_pressure(self, records: list[RequestRecord]) -> int:
        """Cancel promotions, then demote, until the batch's new tokens fit; returns pages needed.

        Demoting a request that would start a new page this step also removes its need.
        """
        synced = False
        while True:
            needed = self.policy.pages_needed_for_new_tokens(records)
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
            needing = {r.slot for r in records if self.policy.new_pages(r)}
            order = self.policy.demotion_order(self.requests.values(), self.streams.step, needing)
            if not order:
                raise PoolExhaustedError(
                    f"device KV pool exhausted: {needed} page(s) needed for new tokens, "
                    f"{self.allocator.device_rows.free_pages} free and nothing left to demote; "
                    f"the scheduler should have retracted a request (can_decode() was False)."
                )
            victim = order[0]
            self._order_after_staging(victim)
            self._demote(victim, victim.seq_len)

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
        must not block the scheduler on their copies.

        With a shared host pool the copy runs in the writer's process, where no event of a reader
        can see it: the ranks agree whether it is done and, if not, the writer waits for it on the
        host while the readers wait in a second all-reduce. Every rank calls this for the same
        requests (identical decisions), and each request's copy is agreed once."""
        if record.staging is None:
            return
        if self.ranks_share_host_pool:
            if not self.agree([record.staging.query()])[0]:
                record.staging.synchronize()
                self.agree([True])
            record.staging = None
        elif not record.staging.query():
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
        self.telemetry.mark("plan")
        locs = self.req_to_token[record.slot, :num_tokens].to(torch.int64)
        rows = self.allocator.translate(locs).to(torch.int64)
        self.telemetry.mark("rows")
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
        self.telemetry.mark("free")
        # The newest token keeps its row, which is now the reserved slot.
        self.allocator.unmap_(locs[:newest])
        if record.spec is not None:
            self.speculative.release_reserve(record, newest_page)
        self.telemetry.mark("unmap")
        self.buffers.acquire(record.slot, buffer_rows, first_token=first)
        self.telemetry.mark("buffer")
        record.mode = OFFLOADED
        record.mode_step = self.streams.step
        self.telemetry.demotions += 1

    def _start_promotions(self, pages_reserved: int, step: int) -> None:
        capacity = self.allocator.device_rows.capacity_pages
        started = 0
        for record in self.policy.promotion_candidates(self.requests.values(), step, self.pending):
            if started >= self.policy.max_promotions_per_step:
                break
            covered = record.seq_len
            pages_needed = -(-covered // self.page_size)
            if not self.policy.promotion_leaves_room(
                self.allocator.device_rows.free_pages, pages_reserved, pages_needed, capacity
            ):
                break
            pages = self.allocator.device_rows.alloc_pages(pages_needed)
            locs = self.req_to_token[record.slot, :covered].to(torch.int64)
            rows = self.allocator.device_rows.page_rows(pages)[:covered]
            # Positions up to the newest are on the host once the forward in flight (the producer,
            # which backs its new tokens up) is done: streams.on orders the copy after it.
            with self.streams.on(self.streams.promotion):
                self.ops.copy_rows(self.host_layers, self.device_layers, locs, rows, max_blocks=BACKGROUND_COPY_BLOCKS)
                event = self.streams.record(self.streams.promotion)
                self.streams.keep_alive(locs, self.streams.promotion)
                self.streams.keep_alive(rows, self.streams.promotion)
            record.promotion = Promotion(pages=pages, covered=covered, event=event)
            self._promoting.add(record.slot)
            started += 1

    def _complete_promotion(self, record: RequestRecord) -> None:
        """Switch an offloaded request whose promotion copy is done to resident."""
        promotion = record.promotion
        total = record.allocated_len
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
        self.telemetry.promotions += 1

    def _cancel_promotion(self, record: RequestRecord) -> None:
        promotion = record.promotion
        promotion.event.wait_on_current_stream()
        self.allocator.device_rows.free_pages_(promotion.pages)
        record.promotion = None
        self._promoting.discard(record.slot)
        self.telemetry.promotion_cancels += 1

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
