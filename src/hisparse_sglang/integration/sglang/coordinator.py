"""The object SGLang keeps in ``model_runner.hisparse_coordinator``.

It honours every call SGLang 0.5.17 makes on its HiSparse coordinator (the duck-typed contract:
staging after prefill, direct admission, per-step binding of new tokens, per-layer swap-in,
eager backup, retract, finish, token stats, CUDA-graph padding) and the speculative verify step
0.5.22+ adds (``prepare_spec_verify``, the 3-D ``swap_in_selected_pages``,
``commit_spec_accept_tokens``; docs/speculative.md 2.8) by translating SGLang requests and batches
into request slots and lengths for the framework-free :class:`hisparse_sglang.coordinator.Coordinator`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import NamedTuple

import torch

from hisparse_sglang.config import HiSparseConfig
from hisparse_sglang.errors import HiSparseMemoryError
from hisparse_sglang.integration.sglang import build, compat
from hisparse_sglang.integration.sglang.mooncake import HostRegions
from hisparse_sglang.integration.sglang.runtime import PerForward
from hisparse_sglang.memory.host_pool import HostKVPool
from hisparse_sglang.memory.paged import DeviceCount

__all__ = ["SGLangHiSparseCoordinator", "HiSparseTokenStats"]

logger = logging.getLogger(__name__)


class HiSparseTokenStats(NamedTuple):
    """What SGLang's pool-stats observer reads (``get_token_stats``)."""

    device_tokens: int
    device_token_usage: float
    host_tokens: int
    host_token_usage: float


@dataclasses.dataclass
class _StagingEntry:
    """Element of ``ack_staging_queue`` (SGLang reads ``.req``)."""

    req: object


class PDHostPool:
    """``coordinator.mem_pool_host`` as SGLang's PD decode side uses it.

    Host rows are the logical locations: the rows a request's KV is written to are the locations
    SGLang preallocated for it, captured when ``alloc_for_decode_prealloc_hisparse`` returns them.
    """

    def __init__(self, host_pool: HostKVPool, page_size: int) -> None:
        self.host_pool = host_pool
        self.page_size = page_size
        self.layer_num = host_pool.layer_num
        self.preallocated: dict[int, torch.Tensor | None] = {}

    def get_contiguous_buf_infos(self) -> tuple[HostRegions, list[int], list[int]]:
        """Per-layer base addresses (marked as ours: a failed Mooncake registration of them raises),
        byte lengths, and bytes per page."""
        pointers, lengths = self.host_pool.region_infos()
        return HostRegions(pointers), lengths, [self.host_pool.item_bytes * self.page_size] * self.layer_num

    def alloc_paged_token_slots(self, req_to_host_pool, req_to_host_pool_allocated_len, req_pool_idx, start_pos, num_tokens):
        slot = int(req_pool_idx)
        if slot not in self.preallocated:
            raise HiSparseMemoryError(
                f"request slot {slot}: no preallocated logical locations for positions "
                f"[{start_pos}, {start_pos + num_tokens}); hisparse-sglang's PD hook did not run."
            )
        locations = self.preallocated[slot]
        if locations is None:
            raise HiSparseMemoryError(
                f"request slot {slot}: the logical (host) pool had no room for {num_tokens} tokens although PD "
                f"admission budgeted them; raise host_to_device_ratio in --hisparse-config or lower "
                f"--max-running-requests."
            )
        if start_pos + num_tokens > locations.numel():
            raise HiSparseMemoryError(
                f"request slot {slot}: positions [{start_pos}, {start_pos + num_tokens}) exceed the "
                f"{locations.numel()} preallocated logical locations."
            )
        return locations[start_pos : start_pos + num_tokens].to(torch.int64)


class SGLangHiSparseCoordinator(compat.CoordinatorCalls):
    """HiSparse coordinator of one scheduler process (one TP rank).

    Args:
        runtime: the process's HiSparseRuntime (which builds this object in ``start``).
        config: validated HiSparse settings.
        parts: what ``build.build`` made for this process (host pool, buffers, streams, core).
        allocator: the HiSparseTokenAllocator SGLang built.
        device: the model runner's device.
        tp_group: CPU process group whose ranks must take identical decisions (None: one rank).
        num_draft_tokens: ``T``, the positions of each speculative verify step
            (``--speculative-num-draft-tokens``); 0 without speculative decoding.

    Attributes:
        shares_host_pool: the TP ranks of each node map one host pool (``share_host_pool_across_tp``
            on, more than one rank in ``tp_group``, DP attention off); the same on every rank.
    """

    def __init__(self, runtime, config: HiSparseConfig, parts, allocator, device, tp_group=None,
                 num_draft_tokens: int = 0) -> None:
        self.runtime = runtime
        self.config = config
        self.device = torch.device(device)
        self.start_layer = parts.start_layer
        self.top_k = config.top_k
        self.device_buffer_size = config.device_buffer_size
        self.padded_buffer_size = config.padded_buffer_size
        self.tp_group = tp_group
        self.shares_host_pool = parts.shares_host_pool
        self.host_pool = parts.host_pool
        self.buffers = parts.buffers
        self.streams = parts.streams
        self.core = parts.core
        self.allocator = allocator
        # SGLang sets it with fill_(n) before every forward (DecodeCudaGraphRunner.load_batch, ModelRunner) and
        # calls nothing else on it (0.5.17 - 0.5.23); the swap-in kernels read core.num_real_reqs.
        self.num_real_reqs = DeviceCount(self.core.num_real_reqs)
        self.num_draft_tokens = num_draft_tokens
        self.mem_pool_host = PDHostPool(self.host_pool, config.page_size)
        # SGLang's PD prealloc passes these back into mem_pool_host.alloc_paged_token_slots.
        self.req_to_host_pool = None
        self.req_to_host_pool_allocated_len = None
        self._staging: dict[int, object] = {}
        self._report_state = (time.monotonic(), 0, 0, 0, 0, 0, 0)
        # A target-verify forward's committed lengths s, derived from its per-query lengths once per forward.
        self._verify_committed = PerForward()
        # SGLang's reserve per speculative decode step (compat.spec_alloc_reserve), read at the first can_verify.
        self._spec_reserve: int | None = None

    # ------------------------------------------------------------------ lifecycle
    def set_decode_producer_stream(self, stream) -> None:
        self.streams.producer = stream

    def destroy(self) -> None:
        if self.streams.is_cuda:
            torch.cuda.synchronize(self.device)

    # ------------------------------------------------------------------ admission
    def admit_request_into_staging(self, req) -> None:
        slot = compat.req_slot(req)
        self.core.admit_prefilled(slot, compat.req_prefill_len(req))
        req.hisparse_staging = True
        self._staging[slot] = req

    def collect_ready_reqs(self) -> list:
        ready = []
        for slot in self.core.collect_ready():
            req = self._staging.pop(slot)
            req.hisparse_staging = False
            ready.append(req)
        return ready

    def has_ongoing_staging(self) -> bool:
        return self.core.has_pending()

    @property
    def ack_staging_queue(self) -> list[_StagingEntry]:
        return [_StagingEntry(req) for req in self._staging.values()]

    def admit_request_direct(self, req) -> None:
        slot = compat.req_slot(req)
        self.mem_pool_host.preallocated.pop(slot, None)
        self.core.admit_direct(slot, compat.req_kv_allocated_len(req))
        req.hisparse_staging = False

    def admissible_now(self, kv_lens) -> int:
        """How many of these requests, taken in order, :meth:`admit_request_direct` can admit now.

        Each takes its device pages (all of its KV when it fits a buffer, else one buffer) from the
        pages that are free or that demotions and promotion cancels could free. A request larger than
        the whole device pool counts as admissible: waiting could never help it, and its admission
        then fails with the pool's error instead of stalling the queue behind it.

        Args:
            kv_lens: each request's tokens with KV (its logical locations), in queue order.
        """
        budget = self.core.obtainable_pages()
        capacity = self.allocator.rows.device_rows.capacity_pages
        count = 0
        for kv_len in kv_lens:
            pages = self.core.direct_admission_pages(int(kv_len))
            if budget < pages <= capacity:
                break
            budget -= pages
            count += 1
        return count

    def host_token_len(self, kv_allocated_len: int) -> int:
        return kv_allocated_len

    def staging_reqs(self) -> list:
        return list(self._staging.values())

    # ------------------------------------------------------------------ decode step
    def map_last_loc_to_buffer(self, seq_lens, out_cache_loc, req_pool_indices, seq_lens_cpu, req_pool_indices_cpu):
        self.core.prepare_decode(req_pool_indices_cpu.tolist(), seq_lens_cpu.tolist(), out_cache_loc)

    def swap_in_selected_pages(self, req_pool_indices, seq_lens, top_k_result, layer_id, resident_rows=False):
        """One DSA layer's swap-in. Decode: ``top_k_result`` int32 ``[B, K]``, ``seq_lens`` ``[B]``;
        returns ``[B, K]`` device rows. Target verify (0.5.22+; 0.5.17 - 0.5.21 through hook H4):
        ``top_k_result`` int32 ``[B, T, K]`` and ``seq_lens`` the per-query lengths ``dsa_seqlens_expanded``
        (int32, ``s + j + 1`` at ``b * T + j``); returns ``[B, T, K]`` (SGLang views it as ``[B * T, K]``).
        ``resident_rows`` (H4 only): the top-k is the fused one through :meth:`verify_page_table`'s table."""
        layer = layer_id - self.start_layer
        if top_k_result.dim() == 3:
            batch, positions = top_k_result.shape[:2]
            # s of each row: its first query's length minus one (one strided elementwise op per forward, at its
            # first layer, captured with the graph; the slice also drops any tail of a longer, graph-static
            # length buffer).
            committed = self._verify_committed.get(
                seq_lens, layer == 0, lambda: seq_lens[: batch * positions : positions] - 1
            )
            return self.core.swap_in_verify(req_pool_indices, committed, top_k_result, layer, resident_rows)
        return self.core.swap_in(req_pool_indices, seq_lens, top_k_result, layer)

    def verify_page_table(self, req_pool_indices, page_table):
        """Once per target-verify forward (hook H5 on 0.5.17 - 0.5.21): the page table (int32 ``[B * T, W]``)
        SGLang's fused top-k maps its positions through, from the forward's logical ``real_page_table``; the
        top-k then yields a resident request's device rows and an offloaded request's positions."""
        return self.core.verify_page_table(req_pool_indices, page_table)

    def wait_for_pending_backup(self) -> None:
        self.core.wait_for_pending_backup()

    def can_decode(self, slots) -> bool:
        return self.core.can_decode(slots)

    # ------------------------------------------------------------------ speculative verify step (0.5.22+)
    def prepare_spec_verify(self, batch) -> None:
        """``eagle_prepare_for_verify``, once ``batch.out_cache_loc`` holds the verify locations: bind
        positions ``s .. s + T - 1`` of every request (and switch modes if needed).

        Reads ``batch.reqs`` (slot, ``kv.kv_committed_len``: the host's committed length, one verify
        behind the device's under the overlap scheduler; ``kv.kv_allocated_len``: after this step's
        reserve) and ``batch.req_pool_indices`` / ``batch.seq_lens`` (``[B]`` on the device, ``s``).
        """
        self._check_speculative("prepare_spec_verify")
        reqs = batch.reqs
        self.core.prepare_verify(
            [compat.req_slot(req) for req in reqs],
            [compat.kv_committed_len(req) for req in reqs],
            [compat.req_kv_allocated_len(req) for req in reqs],
            batch.req_pool_indices,
            batch.seq_lens,
            self.num_draft_tokens,
        )

    def capturing_all_resident_verify(self):
        """While SGLang captures the target-verify CUDA graph replayed for steps whose requests are all resident
        (hook H11 on 0.5.17 - 0.5.21): that graph runs no swap-in."""
        return self.core.capturing_all_resident_verify()

    def verify_all_resident(self) -> bool:
        """The prepared verify step's requests are all resident: its forward may replay that graph (hook H12)."""
        return self.core.verify_all_resident

    def cap_spec_accepts(self, batch, accept_lens, accept_index) -> None:
        """Right after ``eagle_sample`` (every release; hook H10): ``accept_lens`` (``[B]``, the root
        included) and ``accept_index`` (int32 ``[B, S + 1]``) are capped in place, on the device, where an
        offloaded request's verify positions named more distinct tokens than its buffer holds and the
        swap-in left the later positions out; SGLang then emits, commits and drafts from the capped result.
        An idle batch has no rows."""
        if batch.forward_mode.is_idle() or batch.req_pool_indices.numel() == 0:
            return
        self._check_speculative("eagle_sample")
        self.core.cap_verify(accept_lens, accept_index)

    def commit_spec_accept_tokens(self, batch=None, accept_indices=None) -> None:
        """``run_eagle_verify`` after sampling: the accepted tokens' KV, and only theirs, goes to the host.

        ``accept_indices``: int32 ``[B, S + 1]``, the accepted verify rows (``b * T + i``), -1 padded;
        with ``--speculative-eagle-topk 1`` (required at startup) row ``b`` accepts its first
        ``a = (accept_indices[b] >= 0).sum()`` positions, the root included. ``batch.seq_lens`` is still
        ``s``. An idle batch (DP attention) has no rows and commits nothing.
        """
        if batch.forward_mode.is_idle() or batch.req_pool_indices.numel() == 0:
            return
        rows = batch.req_pool_indices.shape[0]
        if accept_indices is None or accept_indices.dim() != 2 or accept_indices.shape[0] != rows:
            shape = None if accept_indices is None else tuple(accept_indices.shape)
            raise HiSparseMemoryError(
                f"commit_spec_accept_tokens of a batch of {rows} requests with accept_indices of shape {shape}; "
                f"expected [{rows}, speculative_num_steps + 1]."
            )
        self.commit_spec_accept_lens(batch, (accept_indices >= 0).sum(dim=1))

    def commit_spec_accept_lens(self, batch, accept_lens) -> None:
        """:meth:`commit_spec_accept_tokens` given each row's accepted count ``a`` (int ``[B]``, the root
        included, ``0 <= a <= T``), as ``run_eagle_verify`` returns it (0.5.17 - 0.5.21: its result's
        ``accept_lens``, hooks_speculative.py). An idle batch commits nothing."""
        if batch.forward_mode.is_idle() or batch.req_pool_indices.numel() == 0:
            return
        self._check_speculative("commit_spec_accept_tokens")
        rows = batch.req_pool_indices.shape[0]
        if accept_lens.dim() != 1 or accept_lens.shape[0] != rows:
            raise HiSparseMemoryError(
                f"commit of a batch of {rows} requests with accept lengths of shape {tuple(accept_lens.shape)}; "
                f"expected [{rows}]."
            )
        self.core.commit_verify(batch.req_pool_indices, batch.seq_lens, accept_lens)

    def can_verify(self, reqs) -> bool:
        """Whether the next speculative decode step of ``reqs`` can bind the reserve SGLang will allocate
        them (``check_decode_mem`` under speculation; the scheduler retracts requests while False)."""
        self._check_speculative("check_decode_mem")
        if self._spec_reserve is None:  # fixed by the server's speculative settings: read once
            self._spec_reserve = compat.spec_alloc_reserve()
        lengths = compat.next_spec_allocated_lens(reqs, self.config.page_size, self._spec_reserve)
        return self.core.can_verify([compat.req_slot(req) for req in reqs], lengths)

    def _check_speculative(self, call: str) -> None:
        if not self.num_draft_tokens:
            raise HiSparseMemoryError(
                f"SGLang called {call} on a HiSparse coordinator started without speculative decoding "
                f"(no --speculative-num-draft-tokens when the model runner started it)."
            )

    # ------------------------------------------------------------------ request end
    def request_finished(self, req) -> None:
        """SGLang calls this (and abort_staging_request) before releasing a request's KV."""
        self.release_request(req)

    abort_staging_request = request_finished

    def retract_req(self, req) -> None:
        """Before a retracted request's KV is released; in PD decode SGLang then copies the KV out
        (``get_cpu_copy``) to restore it on resume, so the host rows are completed first."""
        self.release_request(req, retract=True)

    def release_request(self, req, retract: bool = False) -> None:
        """Drop everything held for a request's slot; a no-op for slots HiSparse does not know."""
        slot = compat.req_slot_or_none(req)
        if slot is None:
            return
        self._staging.pop(slot, None)
        untransferred = self.mem_pool_host.preallocated.pop(slot, None)
        if untransferred is not None and untransferred.numel() and self.runtime.quarantine.seconds > 0:
            # PD decode: the request ends before its KV transfer completed; writes of the prefill
            # instance may still land in these host rows.
            reason = getattr(getattr(req, "finished_reason", None), "message", None) or "no abort message"
            logger.warning(
                "HiSparse: PD request %s ended before its KV transfer completed (%s); its %d host rows (slot %d) "
                "are held for %.0f s (pd_quarantine_s) so that a late write of the prefill instance cannot reach "
                "another request.",
                getattr(req, "rid", "?"), reason, untransferred.numel(), slot, self.runtime.quarantine.seconds,
            )
            self.runtime.quarantine.expect(slot, untransferred)
        if retract:
            self.core.retract(slot)
        else:
            self.core.finish(slot)

    # ------------------------------------------------------------------ stats
    def get_token_stats(self) -> HiSparseTokenStats:
        pools = self.core.allocator.stats()
        return HiSparseTokenStats(
            device_tokens=pools.device_rows_used,
            device_token_usage=pools.device_rows_used / max(pools.device_rows_total, 1),
            host_tokens=pools.host_rows_used,
            host_token_usage=pools.host_rows_used / max(pools.host_rows_total, 1),
        )

    def report(self) -> dict:
        """Counters since the previous report: hit rate, bytes moved, modes, switches per minute, and with
        speculative decoding the verify rows capped and drafts dropped."""
        stats = self.core.stats(exact=False)
        step_host_mean, step_host_max = self.core.take_step_host_time()
        now = time.monotonic()
        last_time, last_lookups, last_misses, last_demotions, last_promotions, last_capped, last_dropped = (
            self._report_state
        )
        lookups = stats.swap_in_lookups - last_lookups
        misses = stats.swap_in_misses - last_misses
        minutes = max(now - last_time, 1e-6) / 60
        self._report_state = (now, stats.swap_in_lookups, stats.swap_in_misses, stats.demotions, stats.promotions,
                              stats.verify_rows_capped, stats.verify_drafts_dropped)
        pools = stats.pools
        return {
            # speculative decoding: verify rows whose accepts the swap-ins' left-out positions capped, and the
            # drafts they dropped (2.9 of docs/speculative.md); None without speculation
            "verify_rows_capped": stats.verify_rows_capped - last_capped if self.num_draft_tokens else None,
            "verify_drafts_dropped": stats.verify_drafts_dropped - last_dropped if self.num_draft_tokens else None,
            "hit_rate": 1.0 - misses / lookups if lookups else None,
            "lookups": lookups,
            "misses": misses,
            "bytes_moved": misses * self.host_pool.item_bytes,
            "resident": stats.resident_requests,
            "offloaded": stats.offloaded_requests,
            "promoting": stats.promoting_requests,
            "demotions_per_min": (stats.demotions - last_demotions) / minutes,
            "promotions_per_min": (stats.promotions - last_promotions) / minutes,
            "switch_ms_max": 1e3 * self.core.take_switch_time_max(),
            "step_host_ms": 1e3 * step_host_mean,
            "step_host_ms_max": 1e3 * step_host_max,
            "demotions_total": stats.demotions,
            "promotions_total": stats.promotions,
            "verify_rows_capped_total": stats.verify_rows_capped,
            "verify_drafts_dropped_total": stats.verify_drafts_dropped,
            # prefills staged to the host by the copy engines and by the copy kernel (coordinator/staging.py)
            "prefills_staged_by_dma_total": stats.prefills_staged_by_dma,
            "prefills_staged_by_kernel_total": stats.prefills_staged_by_kernel,
            "lookups_total": stats.swap_in_lookups,
            "misses_total": stats.swap_in_misses,
            "device_rows_used": pools.device_rows_used,
            "device_rows_total": pools.device_rows_total,
            "host_rows_used": pools.host_rows_used,
            "host_rows_total": pools.host_rows_total,
            "host_rows_quarantined": self.runtime.quarantine.pages_held * self.config.page_size,
        }

    def publish_host_writes(self) -> None:
        """After host rows were written on the scheduler's thread (PD retract-resume, ``load_cpu_copy``),
        before any rank reads them: with a shared pool only its writer wrote, and the readers wait here
        for it (an all-reduce every rank makes at the same call)."""
        if self.shares_host_pool:
            self._agree([True])

    # ------------------------------------------------------------------ helpers
    def _agree(self, flags: list[bool]) -> list[bool]:
        return build.agree(self.tp_group, flags)
