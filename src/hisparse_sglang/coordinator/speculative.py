"""Speculative decoding (EAGLE / NextN MTP, linear drafts): the coordinator's verify step.

docs/speculative.md, section 2, designs it; the reference twins of ``ops/reference.py``
(``swap_in_positions``, ``bind_verify_slots``, ``commit_accepted``) specify its device work. A verify
step of a batch, every device part in stream order on the forward stream:

1. :meth:`VerifySteps.prepare` (before the target-verify forward; SGLang 0.5.22+ ``prepare_spec_verify``):
   mode switches as for a decode step (promotions completed and started, demotions under pressure);
   device pages for the new reserve locations of resident requests, mapped whole; the verify positions
   ``s .. s + T - 1`` of offloaded requests bound to buffer slots ``D + 1 .. D + T``
   (``bind_verify_slots``); slot ``D`` refreshed from the host where it may be stale.
2. :meth:`VerifySteps.swap_in` (each DSA layer of the forward): ``swap_in_positions``. Where an offloaded
   request's positions name more distinct tokens than its buffer holds, the later positions are not served
   and the row's verify limit records the first of them.
3. :meth:`VerifySteps.cap_accepts` (right after SGLang's acceptance, before it uses the accept lengths):
   ``cap_accepted`` accepts no position past a row's limit.
4. :meth:`VerifySteps.commit` (after acceptance; SGLang 0.5.22+ ``commit_spec_accept_tokens``):
   ``commit_accepted`` copies exactly the accepted tokens' KV to their host rows, and an offloaded
   request's newest accepted token into slot ``D``. Under speculation nothing else writes a host row
   (the decode step's ``backup_newest`` is not used), so a rejected draft token's KV never becomes
   host truth: its location stays allocated and the next verify writes it again.

Lengths. The device's committed length ``s`` (``seq_lens``) is never read on the host. The host knows
``c <= s``, the committed length of SGLang's ``req.kv.kv_committed_len`` (one verify late under the
overlap scheduler), which becomes the request's ``seq_len``, and ``kv_allocated_len`` (exact: the host
allocates the reserve), kept in :class:`~hisparse_sglang.coordinator.state.SpecState`. Demotion and
promotion decide with ``c``: positions ``[c, s)`` are committed and on the host, so at worst they miss
once. Every unmap (finish, demotion) and a promotion's mapping are bounded by ``kv_allocated_len``.

The draft (NextN) layer is not the coordinator's: as on SGLang 0.5.22+, its KV stays dense on the GPU
over the logical locations (docs/speculative.md, 2.6 (A)); nothing here binds, copies or frees it.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Protocol, Sequence

import torch

from hisparse_sglang.coordinator.state import DECODE_STEPS, OFFLOADED, RESIDENT, VERIFY_STEPS, RequestRecord, SpecState
from hisparse_sglang.errors import HiSparseConfigError, HiSparseMemoryError, PoolExhaustedError, UnsupportedSetupError
from hisparse_sglang.memory.paged import DeviceCount, upload_ints
from hisparse_sglang.ops.reference import NO_VERIFY_LIMIT, VERIFY_SLOT_BASE
from hisparse_sglang.ops.tables import SwapInTables

if TYPE_CHECKING:
    from hisparse_sglang.coordinator.core import Coordinator

__all__ = ["VerifyOps", "VerifySteps", "VERIFY_OP_NAMES"]

VERIFY_OP_NAMES = (
    "swap_in_positions", "bind_verify_slots", "verify_page_table", "commit_accepted", "cap_accepted", "copy_rows"
)
"""The ops a verify step calls; the coordinator's ``ops`` must have all of them."""


class VerifyOps(Protocol):
    """The device operations of a verify step, as the coordinator calls them.

    ``ops.reference`` holds their pure-PyTorch twins (the specification: their docstrings state the
    semantics); a CUDA twin must take exactly these arguments and give bit-identical outputs, table
    updates and KV rows. Names: ``B`` batch rows (CUDA-graph padding included in ``top_k``), ``T``
    verify positions per request, ``K`` top-k, ``R`` request slots, ``C`` context per slot, ``N``
    logical locations, ``NB`` buffers, ``D`` LRU slots per buffer, ``P`` page size, ``L`` layers. Every
    tensor is on the GPU (contiguous) except the host KV, which is pinned; no op synchronizes with
    the host, and ``swap_in_positions`` runs inside the captured TARGET_VERIFY graph.
    """

    def swap_in_positions(
        self,
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
        """One layer's swap-in of a target-verify forward.

        Args:
            top_k: int32 ``[B, T, K]``: token positions the indexer chose for query position ``j``
                (the token at position ``s + j``) of each row; -1 padding; an entry outside
                ``[0, s + j]`` counts as padding.
            seq_lens: int32 or int64 ``[B]``: ``s``, each request's committed length.
            req_pool_indices: int32 or int64 ``[B]``: request slot of each row, distinct among the real rows.
            num_real_reqs: int32 ``[1]``: rows ``>= num_real_reqs[0]`` are CUDA-graph padding.
            tables: the layer's :class:`SwapInTables` (``req_to_token`` int32 ``[R, C]``,
                ``device_row_of_loc`` int32 ``[N + 1]``, ``buffer_of_req`` int32 ``[R]``, ``slot_rows``
                int32 ``[NB, D + P]``, ``slot_tokens`` int32 ``[NB, D]``, ``slot_stamps`` int32
                ``[NB, D]``, ``token_slot`` int16 ``[NB, C + 1]``, ``host_kv`` uint8 ``[N, row bytes]``
                pinned, ``device_kv`` uint8 ``[rows, row bytes]``); ``slot_tokens``, ``slot_stamps``,
                ``token_slot`` and ``device_kv`` are written.
            out: int32 ``[B, T, K]``, written and returned.
            counters: int64 ``[2]``, incremented: history entries looked up, misses copied (each
                group's distinct placed misses).
            verify_limit: int32 ``[>= B]``, read and lowered: per row, the first position not served
                this step (``reference.NO_VERIFY_LIMIT``: all are); the coordinator keeps one across the
                forward's layers and ``cap_accepted`` resets it.
            group: ``G``, the positions served together: the positions go in consecutive groups of ``G``,
                group after group, each as one row of its ``G x K`` entries (``reference.swap_in_positions``
                states the rules). It changes the result, so both twins must use the same: None (what the
                coordinator passes) is ``swap_in_plan.positions_per_group(T, K, D)``, the largest group that
                fits the buffer and one launch of the CUDA twin, in both twins (the CUDA twin with its GPU's
                shared memory, the same 227 KiB as the reference's sm_90 default on an H100 or H200): top_k
                2048 gives ``G = 2`` with ``D`` 4096 to 5760, ``G = 1`` from 6144 up.
            resident_rows: a resident request's entries are its device rows already (the fused top-k mapped
                them through :meth:`verify_page_table`'s table) and are passed through; an offloaded
                request's are positions either way.
            splits, threads: launch parameters; they never change the result.

        Returns:
            ``out``: the device row of every entry, -1 for padding (``reference.swap_in_positions``).
        """

    def bind_verify_slots(
        self,
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
        """Map the locations of positions ``s .. s + T - 1`` of every real offloaded row to slots
        ``D + 1 .. D + T`` of its buffer (``device_row_of_loc`` int32 ``[N + 1]`` written); resident
        rows are left alone. ``req_pool_indices``, ``seq_lens``: int32/int64 ``[B]``;
        ``num_real_reqs``: int32 ``[1]``; ``num_positions``: ``T``; ``buffer_size``: ``D``; the tables
        as in :meth:`swap_in_positions` (``reference.bind_verify_slots``)."""

    def verify_page_table(
        self,
        page_table: torch.Tensor,
        req_pool_indices: torch.Tensor,
        num_positions: int,
        buffer_of_req: torch.Tensor,
        device_row_of_loc: torch.Tensor,
        page_size: int,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The page table (int32 ``[B * T, W]``) a fused top-k maps a verify forward's selected positions
        through: a resident request's rows get the device page of each logical page of ``page_table`` (int32
        ``[B * T, W]``, row ``i`` of batch row ``i // T``), an offloaded request's the column index, so the
        top-k yields device rows and positions respectively (``reference.verify_page_table``)."""

    def commit_accepted(
        self,
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
        """For every real row with ``a = accept_lens[b]`` (int32/int64 ``[B]``, ``0 <= a <= T``): each
        layer's rows of positions ``s .. s + a - 1`` device -> host (host row = location), and for an
        offloaded row verify slot ``D + a`` -> slot ``D`` in every layer; nothing else. The layers:
        ``L`` uint8 ``[rows, row bytes]`` device tensors and ``L`` pinned uint8 ``[N, row bytes]`` host
        tensors (``LayerSet``). One launch for the batch and every layer, fixed shape ``[B, T]``
        masked by ``a`` on the device (``reference.commit_accepted``)."""

    def cap_accepted(
        self,
        verify_limit: torch.Tensor,
        accept_lens: torch.Tensor,
        accept_index: torch.Tensor,
        counters: torch.Tensor | None = None,
    ) -> None:
        """After acceptance: a row of ``a`` accepted positions (``accept_lens`` int32/int64 ``[B]``) whose
        limit ``l`` (``verify_limit`` int32 ``[>= B]``) is below ``a`` accepts ``l`` (at least 1):
        ``accept_lens[b] = l``, ``accept_index[b, l:] = -1`` (int32 ``[B, W]``); then every limit of the
        batch is reset. ``counters`` int64 ``[2]``: rows capped, positions dropped
        (``reference.cap_accepted``)."""

    def copy_rows(
        self,
        src_layers: Sequence[torch.Tensor],
        dst_layers: Sequence[torch.Tensor],
        src_rows: torch.Tensor,
        dst_rows: torch.Tensor,
        *,
        max_blocks: int = 0,
    ) -> None:
        """Every layer: ``dst[dst_rows[i]] = src[src_rows[i]]`` (int64 row tensors on the GPU; the op
        both twins already have; ``max_blocks`` caps the CUDA twin's grid)."""


class VerifySteps:
    """The verify step of one :class:`~hisparse_sglang.coordinator.core.Coordinator`, built by it.

    It works on the coordinator's allocator, buffers, tables and records; ``Coordinator.prepare_verify``,
    ``swap_in_verify``, ``commit_verify`` and ``can_verify`` forward to it. The number of verify
    positions ``T`` is fixed by the first :meth:`prepare`.

    Attributes:
        num_draft_tokens: ``T`` once the first verify step was prepared, else None.
        rows: int32 ``[R, T, K]``: the swap-in's output, one fixed tensor (a CUDA graph captures its address).
        verify_limit: int32 ``[R]``: per batch row, the first verify position the forward's swap-ins did not
            serve (``reference.NO_VERIFY_LIMIT``: every one was), one fixed tensor; :meth:`cap_accepts`
            applies and resets it.
        prepared_all_resident: the verify step prepared and not yet committed has rows and none of them is
            offloaded: a forward of it with the fused top-k (every entry a device row) may run the all-resident
            CUDA graph, captured under :meth:`capturing_all_resident`, in which no swap-in runs.
    """

    def __init__(self, coordinator: "Coordinator") -> None:
        self._coordinator = coordinator
        self.num_draft_tokens: int | None = None
        self.rows: torch.Tensor | None = None
        self.verify_limit = torch.full(
            (coordinator.buffers.num_req_slots,), NO_VERIFY_LIMIT, dtype=torch.int32, device=coordinator.device
        )
        # Whether the prepared step has an offloaded row (only those can leave a position unserved; until the
        # step's acceptance, so for its forward too: an eager forward of resident rows only skips its swap-ins).
        self._may_cap = False
        # Batch size of the verify step prepared and not yet committed.
        self._prepared_batch: int | None = None
        self.prepared_all_resident = False
        # A CUDA graph of the all-resident verify forward is being captured (capturing_all_resident).
        self._capturing_all_resident = False
        # Rows the prepare and the commit work on: every row of their batch (no CUDA-graph padding there).
        self._batch_size = DeviceCount(torch.zeros(1, dtype=torch.int32, device=coordinator.device))

    # ================================================================== the step
    def prepare(
        self,
        slots: Sequence[int],
        committed_lens: Sequence[int],
        allocated_lens: Sequence[int],
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        num_draft_tokens: int,
    ) -> None:
        """Before a target-verify forward: switch modes if needed and bind the verify positions.

        Args:
            slots: request slots of the batch (Python ints), distinct, each admitted and released by
                ``collect_ready`` (or admitted by ``admit_direct``).
            committed_lens: ``c`` per slot: the committed length known on the host (SGLang's
                ``req.kv.kv_committed_len``); never below the previous step's, never above the device's ``s``.
            allocated_lens: per slot, ``kv_allocated_len`` after this step's allocation: positions
                ``[0, allocated_len)`` have locations in ``req_to_token`` (the reserve is logical only:
                this call gives resident requests their device pages). Never below the previous one;
                at least ``c + T``; precondition: at least ``s + T`` (SGLang reserves ``2 T`` beyond ``c``,
                and ``c`` lags ``s`` by at most one verify).
            req_pool_indices: int32/int64 ``[B]`` on the device: ``slots`` (``batch.req_pool_indices``).
            seq_lens: int32/int64 ``[B]`` on the device: ``s`` per row (``batch.seq_lens``); only the
                device ops read it.
            num_draft_tokens: ``T``, verify positions per request (``--speculative-num-draft-tokens``),
                the same on every call.

        Raises:
            HiSparseMemoryError: a slot is unknown, staging or repeated; the argument lengths differ;
                a committed or allocated length goes back or is out of range; the coordinator served
                plain decode steps.
            HiSparseConfigError: ``T`` outside ``[1, P - 1]``.
            UnsupportedSetupError: a host pool shared by TP ranks, or ops without the verify ops.
        """
        coordinator = self._coordinator
        entered = time.perf_counter()
        self.prepared_all_resident = False
        records = self._check_prepare(slots, committed_lens, allocated_lens, req_pool_indices, seq_lens, num_draft_tokens)
        coordinator._enter_step_kind(VERIFY_STEPS)
        self._fix_num_draft_tokens(num_draft_tokens)
        for record, committed, allocated in zip(records, committed_lens, allocated_lens):
            if record.spec is None:
                # An offloaded request's slot D holds no accepted token yet when PD admitted it with an
                # empty buffer; refresh it at its first verify whatever made it offloaded (one row per layer).
                record.spec = SpecState(record.seq_len, record.seq_len, slot_d_stale=record.mode == OFFLOADED)
            record.seq_len = committed
            record.spec.wanted_len = allocated
        coordinator.streams.step += 1
        coordinator.prefill_staging.issue_ready()
        switched = False
        if coordinator._promoting or coordinator.slots.num_offloaded or not coordinator.config.resident_first or (
            coordinator.policy.pages_needed_for_new_tokens(records) > coordinator.allocator.device_rows.free_pages
        ):
            started, before = coordinator.telemetry.start_switching()
            coordinator._switch_modes(records)
            switched = coordinator.telemetry.end_switching(
                "verify step", started, before, len(coordinator.requests)
            )
        self._bind(records, req_pool_indices, seq_lens)
        self._prepared_batch = len(records)
        self.prepared_all_resident = bool(records) and not self._may_cap
        if switched:
            # Rows freed this step may still be read by copies in flight (Coordinator.prepare_decode).
            coordinator._fence_copies()
        coordinator.telemetry.decode_step_done(entered)

    def configure(self, num_draft_tokens: int) -> None:
        """Fix ``T`` before the first verify step: a server knows it at startup, and its TARGET_VERIFY
        CUDA graph is captured (swap-ins included) before any request is prepared.

        Raises what :meth:`prepare` raises for the setup, now instead of at the first verify:
        HiSparseConfigError (``T`` outside ``[1, P - 1]``),
        UnsupportedSetupError (ops without the verify ops, a host pool shared by TP ranks),
        HiSparseMemoryError (a different ``T`` fixed before).
        """
        self._check_setup(num_draft_tokens)
        self._fix_num_draft_tokens(num_draft_tokens)

    def page_table(self, req_pool_indices: torch.Tensor, page_table: torch.Tensor) -> torch.Tensor:
        """Once per target-verify forward, before its first layer's top-k: the page table through which a fused
        top-k yields a resident request's device rows and an offloaded request's positions, for
        :meth:`swap_in` with ``resident_rows`` (``verify_page_table``; the modes and resident pages are those
        :meth:`prepare` left, which nothing changes during the forward).

        Args:
            req_pool_indices: int32/int64 ``[B]`` on the device (padding rows included).
            page_table: int32 ``[B * T, W]`` on the device: the forward's logical page table, one row per
                query (SGLang's ``real_page_table``).

        Returns:
            A new int32 ``[B * T, W]`` tensor (under CUDA-graph capture, the graph's).
        """
        coordinator = self._coordinator
        if self.num_draft_tokens is None:
            raise HiSparseMemoryError("verify page table before any prepare_verify: prepare the verify step first.")
        return coordinator.ops.verify_page_table(
            page_table,
            req_pool_indices,
            self.num_draft_tokens,
            coordinator.buffers.buffer_of_req,
            coordinator.allocator.device_row_of_loc,
            coordinator.page_size,
        )

    def swap_in(
        self,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        top_k: torch.Tensor,
        layer_id: int,
        resident_rows: bool = False,
    ) -> torch.Tensor:
        """One DSA layer of the target-verify forward: device rows of every verify position's top-k.

        Args:
            req_pool_indices: int32/int64 ``[B]`` on the device (padding rows included).
            seq_lens: int32/int64 ``[B]`` on the device: ``s`` per row. SGLang 0.5.22+ passes the
                per-query lengths ``dsa_seqlens_expanded`` (int32 ``[B * T]``, ``s + j + 1``): the adapter
                hands ``view(B, T)[:, 0] - 1``.
            top_k: int32 ``[B, T, K]`` on the device: token positions per query position, -1 padding;
                with ``resident_rows``, a resident request's entries are device rows (:meth:`page_table`).
            layer_id: the target layer (0-based).
            resident_rows: the top-k came through :meth:`page_table`'s table.

        Returns:
            int32 ``[B, T, K]``, a view of :attr:`rows` (the same storage on every call): the device
            row of every entry, -1 for padding. Real rows are the first ``num_real_reqs[0]`` (the
            coordinator's tensor, set per forward like the decode swap-in's). One exception: with
            ``resident_rows``, an eager forward of the prepared rows (no CUDA-graph padding), none of them
            offloaded, gets ``top_k`` itself and launches nothing, since the swap-in would return each resident
            row's entries unchanged. A captured forward runs the swap-in, except in the graph captured under
            :meth:`capturing_all_resident` (with ``resident_rows``: ``top_k`` itself, nothing launched), which the
            adapter replays only for a step whose rows are all resident (:attr:`prepared_all_resident`). A
            conditional node in one graph instead costs more GPU time than the one launch per layer at ``T = 2``
            and, with the copy of the rows into the top-k it needs, more than the launches in a batch with an
            offloaded request (benchmarks/results/e2e_H200_2026-11-26.md, section 36).
        """
        coordinator = self._coordinator
        num_positions = self.num_draft_tokens
        if num_positions is None:
            raise HiSparseMemoryError("swap_in_verify before any prepare_verify: prepare the verify step first.")
        expected = (num_positions, coordinator.config.top_k)
        if top_k.dim() != 3 or tuple(top_k.shape[1:]) != expected or top_k.shape[0] > self.rows.shape[0]:
            raise HiSparseMemoryError(
                f"verify top-k of shape {tuple(top_k.shape)}; expected [B, {expected[0]}, {expected[1]}] "
                f"(num_draft_tokens, top_k) with B <= {self.rows.shape[0]} request slots."
            )
        if resident_rows and self._capturing_all_resident:
            return top_k  # the all-resident graph: each resident row's entries are its device rows
        if (resident_rows and not self._may_cap and top_k.shape[0] == self._prepared_batch
                and not (top_k.is_cuda and torch.cuda.is_current_stream_capturing())):
            return top_k  # an eager forward of the prepared rows only, all resident
        return coordinator.ops.swap_in_positions(
            top_k,
            seq_lens,
            req_pool_indices,
            coordinator.num_real_reqs,
            coordinator.layer_tables[layer_id],
            out=self.rows[: top_k.shape[0]],
            counters=coordinator.swap_counters,
            verify_limit=self.verify_limit,
            resident_rows=resident_rows,
            threads=coordinator.config.swap_in_block_size,
        )

    def cap_accepts(self, accept_lens: torch.Tensor, accept_index: torch.Tensor) -> None:
        """Right after SGLang's acceptance of the prepared step, before it uses the result: a row accepts no
        position the forward's swap-ins left out (``cap_accepted``), so the tokens it emits and the KV
        :meth:`commit` backs up come only from positions whose attention read every row it asked for.

        Args:
            accept_lens: int32/int64 ``[B]`` on the device, changed in place: accepted positions per row,
                the root included (SGLang's ``accept_lens``).
            accept_index: int32 ``[B, T]`` on the device, changed in place: SGLang's ``accept_index``.

        A step with no offloaded row launches nothing (a resident row is always served whole).
        """
        if not self._may_cap or accept_lens.shape[0] == 0:
            return
        self._may_cap = False
        self._coordinator.ops.cap_accepted(
            self.verify_limit, accept_lens, accept_index, self._coordinator.counters.caps
        )

    def commit(self, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, accept_lens: torch.Tensor) -> None:
        """After acceptance, before the draft extend: the accepted tokens' KV, and only theirs, goes to the host.

        Args:
            req_pool_indices, seq_lens: the prepared batch's (``s`` still before this verify).
            accept_lens: int32/int64 ``[B]`` on the device: ``a`` per row, ``0 <= a <= T``; positions
                ``s .. s + a - 1`` are accepted. SGLang counts the root, so a real row has ``a >= 1``; 0
                commits nothing. From SGLang's ``accept_index`` (``[B, S + 1]``, -1 padded):
                ``(accept_index >= 0).sum(1)``.

        Raises:
            HiSparseMemoryError: no verify step of ``B`` rows is prepared and uncommitted. A batch of
                no rows (an idle step) commits nothing and is always accepted.
        """
        coordinator = self._coordinator
        batch = req_pool_indices.shape[0]
        if batch == 0:
            return
        if self._prepared_batch != batch or seq_lens.shape[0] != batch or accept_lens.shape[0] != batch:
            prepared = "none" if self._prepared_batch is None else f"{self._prepared_batch} rows"
            raise HiSparseMemoryError(
                f"commit_verify of {batch} request indices, {seq_lens.shape[0]} seq_lens and "
                f"{accept_lens.shape[0]} accept lengths, but the verify step prepared and not yet committed "
                f"has {prepared}: commit each prepared batch once, with one value of each per row."
            )
        self._prepared_batch = None
        self.prepared_all_resident = False
        self._batch_size.fill_(batch)
        coordinator.ops.commit_accepted(
            req_pool_indices,
            seq_lens,
            accept_lens,
            self._batch_size.tensor,
            self.num_draft_tokens,
            coordinator.req_to_token,
            coordinator.allocator.device_row_of_loc,
            coordinator.buffers.buffer_of_req,
            coordinator.buffers.slot_rows,
            coordinator.buffer_size,
            coordinator.device_layers,
            coordinator.host_layers,
        )

    @contextlib.contextmanager
    def capturing_all_resident(self):
        """While a CUDA graph of the target-verify forward is captured for steps whose rows are all resident:
        :meth:`swap_in` with ``resident_rows`` returns the fused top-k itself (a resident row's entries are its
        device rows), so the graph holds no swap-in. Only a step with :attr:`prepared_all_resident` may replay
        it. Its padding rows read what the fused top-k gave them through :meth:`page_table`'s table (device
        rows, or positions below the padding's sequence length): rows inside the pool, outputs discarded."""
        if self._capturing_all_resident:
            raise HiSparseMemoryError("capturing_all_resident entered twice: capture one graph at a time.")
        self._capturing_all_resident = True
        try:
            yield
        finally:
            self._capturing_all_resident = False

    # ================================================================== capacity
    def can_verify(self, slots: Sequence[int], allocated_lens: Sequence[int]) -> bool:
        """Whether :meth:`prepare` with these reserves can give every resident request its new pages.

        A resident request needs the device pages of its reserve beyond those it holds, unless it
        can be demoted instead; offloaded requests need none. The scheduler retracts requests while
        this is False (SGLang's ``check_decode_mem``).

        Raises:
            HiSparseMemoryError: a slot is not admitted or still staging; the lengths do not match the
                slots; the coordinator served plain decode steps.
        """
        coordinator = self._coordinator
        if coordinator._step_kind is DECODE_STEPS:
            coordinator._enter_step_kind(VERIFY_STEPS)  # raises
        if len(allocated_lens) != len(slots):
            raise HiSparseMemoryError(
                f"can_verify of {len(slots)} request slots with {len(allocated_lens)} allocated lengths; "
                f"pass one per slot."
            )
        records = [coordinator._record(slot) for slot in slots]
        page = coordinator.page_size
        needs = [
            (record, max(-(-allocated // page) - -(-record.allocated_len // page), 0))
            for record, allocated in zip(records, allocated_lens)
            if record.mode == RESIDENT
        ]
        free = coordinator.allocator.device_rows.free_pages
        if sum(need for _, need in needs) <= free:
            return True
        undemotable = sum(need for record, need in needs if not coordinator.policy.demotable(record))
        return undemotable <= free + coordinator.reclaimable_pages()

    # ================================================================== transitions
    def release_reserve(self, record: RequestRecord, newest_page: int) -> None:
        """Demotion of a request that verifies drafts (``Coordinator._demote``, after the pages below
        its LRU window are freed): free its device pages after the page of its newest committed token
        ``c - 1`` (the speculative reserve), unmap every location of its pages (each verify binds its
        own positions), and mark slot ``D`` stale (it holds ``c - 1``; the device may be at ``s > c``).

        The positions in those pages that the device has committed are on the host (their commit
        ran before, in stream order), so they are served as misses."""
        coordinator = self._coordinator
        page = coordinator.page_size
        # Position p * P starts a logical page (locations are page-aligned with positions).
        starts = coordinator.req_to_token[record.slot, 0 : record.spec.allocated_len : page].to(torch.int64)
        above = starts[newest_page + 1 :]
        if above.numel():
            coordinator.allocator.free_device_pages(coordinator.allocator.translate(above).to(torch.int64) // page)
        coordinator.allocator.unmap_(coordinator.allocator.logical.page_rows(starts // page))
        record.spec.slot_d_stale = True

    # ================================================================== internals
    def _check_prepare(
        self,
        slots: Sequence[int],
        committed_lens: Sequence[int],
        allocated_lens: Sequence[int],
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        num_draft_tokens: int,
    ) -> list[RequestRecord]:
        """Typed errors for a prepare call that does not describe one verify step; nothing changes."""
        coordinator = self._coordinator
        if coordinator._step_kind is DECODE_STEPS:
            coordinator._enter_step_kind(VERIFY_STEPS)  # raises
        if self.num_draft_tokens is None:
            self._check_setup(num_draft_tokens)
        elif num_draft_tokens != self.num_draft_tokens:  # the setup was checked when T was fixed
            self._check_num_draft_tokens(num_draft_tokens)  # raises
        count = len(slots)
        lengths = (len(committed_lens), len(allocated_lens), req_pool_indices.shape[0], seq_lens.shape[0])
        if any(length != count for length in lengths):
            raise HiSparseMemoryError(
                f"verify step of {count} request slots with {lengths[0]} committed lengths, {lengths[1]} "
                f"allocated lengths, {lengths[2]} request indices and {lengths[3]} seq_lens; pass one of each "
                f"per slot."
            )
        if count > 1 and len(set(slots)) != count:
            repeated = sorted({slot for slot in slots if list(slots).count(slot) > 1})
            raise HiSparseMemoryError(
                f"verify step lists request slot(s) {repeated[:8]} more than once; each request verifies once per step."
            )
        context = coordinator.req_to_token.shape[1]
        records = []
        for slot, committed, allocated in zip(slots, committed_lens, allocated_lens):
            record = coordinator._record(slot)  # raises for an unknown or staging slot
            if committed < record.seq_len:
                raise HiSparseMemoryError(
                    f"request slot {slot}: committed length {committed} is below the {record.seq_len} the "
                    f"coordinator has; committed tokens never go back."
                )
            lowest = max(committed + num_draft_tokens, record.allocated_len)
            if not lowest <= allocated <= context:
                raise HiSparseMemoryError(
                    f"request slot {slot}: allocated length {allocated} must be in [{lowest}, {context}]: at least "
                    f"the committed length {committed} + num_draft_tokens {num_draft_tokens} and the "
                    f"{record.allocated_len} already allocated (it never shrinks), at most the request slot's context."
                )
            records.append(record)
        return records

    def _check_setup(self, num_draft_tokens: int) -> None:
        """Typed errors for a setup that cannot verify ``num_draft_tokens`` positions; nothing changes."""
        coordinator = self._coordinator
        missing = [name for name in VERIFY_OP_NAMES if not hasattr(coordinator.ops, name)]
        if missing:
            raise UnsupportedSetupError(
                f"the coordinator's ops ({type(coordinator.ops).__name__}) have no {', '.join(missing)}: a verify "
                f"step needs {', '.join(VERIFY_OP_NAMES)}; use hisparse_sglang.ops.swap_in.CudaOps (GPU) or "
                f"hisparse_sglang.ops.reference (CPU)."
            )
        if coordinator.ranks_share_host_pool:
            raise UnsupportedSetupError(
                "speculative decoding with a host pool shared by the TP ranks is not supported: a reader "
                "rank's first layer could read a host row before the writer's commit of the previous verify "
                "lands (no collective orders them); set share_host_pool_across_tp to false."
            )
        self._check_num_draft_tokens(num_draft_tokens)

    def _fix_num_draft_tokens(self, num_draft_tokens: int) -> None:
        """The first call fixes ``T`` and allocates the swap-in's output (checked by the caller)."""
        if self.num_draft_tokens is None:
            coordinator = self._coordinator
            self.num_draft_tokens = num_draft_tokens
            self.rows = torch.full(
                (coordinator.buffers.num_req_slots, num_draft_tokens, coordinator.config.top_k), -1,
                dtype=torch.int32, device=coordinator.device,
            )

    def _check_num_draft_tokens(self, num_draft_tokens: int) -> None:
        coordinator = self._coordinator
        if self.num_draft_tokens is not None and num_draft_tokens != self.num_draft_tokens:
            raise HiSparseMemoryError(
                f"num_draft_tokens {num_draft_tokens}, but this coordinator's verify steps have "
                f"{self.num_draft_tokens}; it is fixed per server."
            )
        verify_slots = coordinator.page_size - VERIFY_SLOT_BASE
        if not 1 <= num_draft_tokens <= verify_slots:
            raise HiSparseConfigError(
                f"num_draft_tokens ({num_draft_tokens}) must be in [1, {verify_slots}]: an offloaded request's "
                f"verify positions take the slots after slot D of its reserved page (page_size "
                f"{coordinator.page_size} - 1); lower --speculative-num-draft-tokens."
            )

    def _bind(self, records: list[RequestRecord], req_pool_indices: torch.Tensor, seq_lens: torch.Tensor) -> None:
        """After the mode switches: device pages for resident requests' new reserve locations (mapped
        whole, one gather and one map for the batch), the verify slots of offloaded requests
        (``bind_verify_slots``, one launch), and slot ``D`` refreshed from the host where stale."""
        coordinator = self._coordinator
        page = coordinator.page_size
        page_slots, page_positions, offloaded_rows, stale_rows = [], [], [], []
        for row, record in enumerate(records):
            spec = record.spec
            if record.mode == RESIDENT:
                for logical_page in range(-(-spec.allocated_len // page), -(-spec.wanted_len // page)):
                    page_slots.append(record.slot)
                    page_positions.append(logical_page * page)
            else:
                offloaded_rows.append(row)
                if spec.slot_d_stale:
                    stale_rows.append(row)
        free = coordinator.allocator.device_rows.free_pages
        if len(page_positions) > free:
            raise PoolExhaustedError(
                f"device KV pool exhausted while binding speculative reserves: {len(page_positions)} page(s) "
                f"needed, {free} free; the scheduler should have retracted a request (can_verify() was False)."
            )
        for record in records:
            record.spec.allocated_len = record.spec.wanted_len
            record.spec.slot_d_stale = False
        if page_positions:
            pages = coordinator.allocator.device_rows.alloc_pages(len(page_positions))
            first_locs = _entries(coordinator.req_to_token, page_slots, page_positions)
            coordinator.allocator.map_pages_(first_locs, pages * page)
        if self._may_cap:
            # The previous step's limits were never applied (no acceptance reached cap_accepts): start afresh.
            self.verify_limit.fill_(NO_VERIFY_LIMIT)
        self._may_cap = bool(offloaded_rows)
        if offloaded_rows:
            self._batch_size.fill_(len(records))
            coordinator.ops.bind_verify_slots(
                req_pool_indices,
                seq_lens,
                self._batch_size.tensor,
                self.num_draft_tokens,
                coordinator.req_to_token,
                coordinator.allocator.device_row_of_loc,
                coordinator.buffers.buffer_of_req,
                coordinator.buffers.slot_rows,
                coordinator.buffer_size,
            )
        if stale_rows:
            # The newest committed token s - 1 is on its host row (committed by an earlier verify, or
            # written by the prefill); s is read on the device only.
            index = upload_ints([stale_rows], coordinator.device)[0]
            req_slots = req_pool_indices[index].to(torch.int64)
            locs = coordinator.req_to_token[req_slots, seq_lens[index].to(torch.int64) - 1].to(torch.int64)
            buffer_ids = coordinator.buffers.buffer_of_req[req_slots].to(torch.int64)
            rows = coordinator.buffers.slot_rows[buffer_ids, coordinator.buffer_size].to(torch.int64)
            coordinator.ops.copy_rows(coordinator.host_layers, coordinator.device_layers, locs, rows)


# At most this many entries are read as one-element views of the table (no upload; a concatenation when more
# than one); beyond, the indices are uploaded for one gather.
_FEW_ENTRIES = 16


def _entries(table: torch.Tensor, rows: list[int], columns: list[int]) -> torch.Tensor:
    """``table[rows[i], columns[i]]`` for Python integers (1-D, in order), without an upload for a few: a
    verify step binds at most one new page per resident request, whose start it reads here."""
    if len(rows) > _FEW_ENTRIES:
        index = upload_ints([rows, columns], table.device)
        return table[index[0], index[1]]
    views = [table[row, column : column + 1] for row, column in zip(rows, columns)]
    return views[0] if len(views) == 1 else torch.cat(views)
