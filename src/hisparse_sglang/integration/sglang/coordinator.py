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
import socket
import time
from typing import NamedTuple

import torch

from hisparse_sglang.config import HiSparseConfig
from hisparse_sglang.coordinator import Coordinator
from hisparse_sglang.errors import HiSparseMemoryError
from hisparse_sglang.integration.sglang import compat, limits
from hisparse_sglang.integration.sglang.mooncake import HostRegions
from hisparse_sglang.integration.sglang.runtime import host_pages_for
from hisparse_sglang.memory.consistency import RankStateCheck, gather_ints
from hisparse_sglang.memory.device_buffers import DeviceBufferPool
from hisparse_sglang.memory.host_pool import HostKVPool
from hisparse_sglang.memory.shared_host_pool import open_host_pool
from hisparse_sglang.streams import StreamSet

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
        req_to_token_pool: SGLang's ReqToTokenPool.
        allocator: the HiSparseTokenAllocator SGLang built.
        pool: the HiSparseDevicePool SGLang built.
        device: the model runner's device.
        tp_group: CPU process group whose ranks must take identical decisions (None: one rank).
        dp_attention: SGLang runs DP attention (its ranks hold other requests: no shared host pool).
        num_draft_tokens: ``T``, the positions of each speculative verify step
            (``--speculative-num-draft-tokens``); 0 without speculative decoding.

    Attributes:
        shares_host_pool: the TP ranks of each node map one host pool (``share_host_pool_across_tp``
            on, more than one rank in ``tp_group``, DP attention off); the same on every rank.
    """

    def __init__(
        self, runtime, config: HiSparseConfig, req_to_token_pool, allocator, pool, device, tp_group=None,
        dp_attention: bool = False, num_draft_tokens: int = 0,
    ) -> None:
        self.runtime = runtime
        self.config = config
        self.device = torch.device(device)
        self.start_layer = getattr(pool, "start_layer", 0) or 0
        self.top_k = config.top_k
        self.device_buffer_size = config.device_buffer_size
        self.padded_buffer_size = config.padded_buffer_size
        self.tp_group = tp_group
        rows = allocator.rows
        layers = pool.kv_rows()
        item_bytes = layers[0].shape[1]
        self.shares_host_pool = _shares_host_pool(config, tp_group, dp_attention)
        _check_host_memory(
            len(layers) * rows.num_locs * item_bytes, config, allocator=allocator, row_bytes=len(layers) * item_bytes,
            tp_group=tp_group, device_pool_pages=rows.device_rows.capacity_pages, shared=self.shares_host_pool,
        )
        self.host_pool = open_host_pool(
            len(layers), rows.num_locs, item_bytes, pin=self.device.type == "cuda",
            group=tp_group if self.shares_host_pool else None,
        )
        num_req_slots, context_len = req_to_token_pool.req_to_token.shape
        # No more requests can be offloaded at once than there are request slots; a pool smaller
        # than one buffer was refused by _check_host_memory.
        num_buffers = min(num_req_slots, rows.device_rows.capacity_rows // config.padded_buffer_size)
        table_shape = (len(layers), num_req_slots, num_buffers, config.device_buffer_size, config.page_size, context_len)
        _check_device_memory(DeviceBufferPool.table_bytes(*table_shape), self.device, table_shape)
        self.buffers = DeviceBufferPool(*table_shape, self.device)
        if self.device.type == "cuda":
            from hisparse_sglang.ops.jit import load_module
            from hisparse_sglang.ops.swap_in import CudaOps

            started = time.monotonic()
            ops = CudaOps(self.device, module=load_module())  # compiled before any CUDA-graph capture
            ops.reserve(
                num_req_slots, config.top_k, config.device_buffer_size, config.swap_in_block_size,
                page_size=config.page_size,
            )
            logger.info("HiSparse: CUDA kernels ready in %.1f s", time.monotonic() - started)
        else:
            from hisparse_sglang.ops import reference as ops
        self.streams = StreamSet(self.device)
        self.core = Coordinator(
            config, rows, self.buffers, self.host_pool, layers, req_to_token_pool.req_to_token,
            ops=ops, streams=self.streams, agree=self._agree,
            rank_check=RankStateCheck(gather_ints(tp_group)) if self.shares_host_pool else None,
            ranks_share_host_pool=self.shares_host_pool,
        )
        self.allocator = allocator
        self.num_real_reqs = self.core.num_real_reqs
        self.num_draft_tokens = num_draft_tokens
        if num_draft_tokens:
            # Before SGLang captures the TARGET_VERIFY graph (its swap-ins need T) and before any
            # request: a setup the verify step cannot serve stops the scheduler here.
            self.core.configure_verify(num_draft_tokens)
        self.mem_pool_host = PDHostPool(self.host_pool, config.page_size)
        # SGLang's PD prealloc passes these back into mem_pool_host.alloc_paged_token_slots.
        self.req_to_host_pool = None
        self.req_to_host_pool_allocated_len = None
        self._staging: dict[int, object] = {}
        self._report_state = (time.monotonic(), 0, 0, 0, 0)
        logger.info(
            "HiSparse (hisparse-sglang): %s; host pool %.2f GiB; device pool %d rows, %d buffers of %d",
            config.to_json(), self.host_pool.nbytes / 2**30, rows.device_rows.capacity_rows, num_buffers,
            config.padded_buffer_size,
        )

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

    def swap_in_selected_pages(self, req_pool_indices, seq_lens, top_k_result, layer_id):
        """One DSA layer's swap-in. Decode: ``top_k_result`` int32 ``[B, K]``, ``seq_lens`` ``[B]``;
        returns ``[B, K]`` device rows. Target verify (0.5.22+): ``top_k_result`` int32 ``[B, T, K]`` and
        ``seq_lens`` the per-query lengths ``dsa_seqlens_expanded`` (int32, ``s + j + 1`` at ``b * T + j``);
        returns ``[B, T, K]`` (SGLang views it as ``[B * T, K]``)."""
        layer = layer_id - self.start_layer
        if top_k_result.dim() == 3:
            batch, positions = top_k_result.shape[:2]
            # s of each row: its first query's length minus one (one strided elementwise op, captured
            # with the graph; the slice also drops any tail of a longer, graph-static length buffer).
            committed = seq_lens[: batch * positions : positions] - 1
            return self.core.swap_in_verify(req_pool_indices, committed, top_k_result, layer)
        return self.core.swap_in(req_pool_indices, seq_lens, top_k_result, layer)

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
        lengths = compat.next_spec_allocated_lens(reqs, self.config.page_size)
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
        """Counters since the previous report: hit rate, bytes moved, modes, switches per minute."""
        stats = self.core.stats(exact=False)
        step_host_mean, step_host_max = self.core.take_step_host_time()
        now = time.monotonic()
        last_time, last_lookups, last_misses, last_demotions, last_promotions = self._report_state
        lookups = stats.swap_in_lookups - last_lookups
        misses = stats.swap_in_misses - last_misses
        minutes = max(now - last_time, 1e-6) / 60
        self._report_state = (now, stats.swap_in_lookups, stats.swap_in_misses, stats.demotions, stats.promotions)
        pools = stats.pools
        return {
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
        """All-reduce MIN over the TP group so every rank takes the same decisions."""
        if self.tp_group is None or not flags or torch.distributed.get_world_size(group=self.tp_group) == 1:
            return flags
        values = torch.tensor([int(f) for f in flags], dtype=torch.int32)
        torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.MIN, group=self.tp_group)
        return [bool(v) for v in values.tolist()]


def _check_device_memory(needed: int, device: torch.device, shape: tuple) -> None:
    """The buffer tables are allocated after SGLang sized its KV pool: they must fit what is left."""
    layers, _, buffers, buffer_size, _, context_len = shape
    logger.info(
        "HiSparse: device buffer tables take %.1f MiB (%d layers x %d buffers; token -> slot map of "
        "context %d)", needed / 2**20, layers, buffers, context_len,
    )
    if device.type != "cuda":
        return
    free, _ = torch.cuda.mem_get_info(device)
    if needed > 0.5 * free:
        raise HiSparseMemoryError(
            f"the HiSparse device buffer tables need {needed / 2**30:.2f} GiB of GPU memory ({layers} layers x "
            f"{buffers} buffers x context {context_len}) but only {free / 2**30:.2f} GiB is free after the KV "
            f"pool; lower --mem-fraction-static or --context-length, or raise device_buffer_size "
            f"({buffer_size}) in --hisparse-config (fewer, larger buffers)."
        )


def _group_size(group) -> int:
    return 1 if group is None else torch.distributed.get_world_size(group=group)


def _shares_host_pool(config: HiSparseConfig, tp_group, dp_attention: bool) -> bool:
    """Whether the TP ranks of each node map one host pool: the switch is on, the group has more than
    one rank, and DP attention is off (with it the ranks hold different requests). Every rank of the
    group decides alike (the same server arguments)."""
    if not config.share_host_pool_across_tp:
        return False
    if dp_attention or _group_size(tp_group) == 1:
        logger.info(
            "HiSparse: share_host_pool_across_tp has no effect here (%s): every rank keeps its own host pool.",
            "DP attention gives the ranks different requests" if dp_attention else "one TP rank",
        )
        return False
    logger.warning(
        "HiSparse: share_host_pool_across_tp is on: the TP ranks of each node share one host pool. This is "
        "experimental and has run on the CPU only (docs/shared-host-pool.md); set it to false to give every rank "
        "its own pool."
    )
    return True


def _check_host_memory(
    needed: int, config: HiSparseConfig, allocator=None, row_bytes: int | None = None, tp_group=None,
    device_pool_pages: int | None = None, shared: bool = False,
) -> None:
    """What must hold before the host pool is pinned (minutes on a large host): the GPU KV pool
    (``device_pool_pages``, sized by SGLang) holds one offloaded request's buffer, and the host pools
    of every rank of ``tp_group`` on this host (``needed`` bytes each; one in all when ``shared``) fit
    the memory the host, or its cgroup, has available.

    With ``allocator`` (device pool size, page size) and ``row_bytes`` (one token of every layer) the
    message gives the largest host_to_device_ratio that fits. ``tp_group`` is the CPU group the
    coordinator agrees on (ranks outside it, e.g. other DP-attention groups, are not counted).
    """
    if device_pool_pages is not None:
        limits.check_device_pool(device_pool_pages, config)
    pools_on_host = 1
    if _group_size(tp_group) > 1:
        hosts: list = [None] * _group_size(tp_group)
        torch.distributed.all_gather_object(hosts, socket.gethostname(), group=tp_group)
        pools_on_host = limits.host_pools_on_host(hosts, socket.gethostname(), shared)

    def bytes_for_ratio(ratio: int) -> int:
        if allocator is None or row_bytes is None:
            return needed * ratio // config.host_to_device_ratio
        pages = host_pages_for(allocator.device_tokens, ratio, allocator.page_size)
        return pages * allocator.page_size * row_bytes

    limits.check_host_pool(
        needed, pools_on_host, bytes_for_ratio, config.host_to_device_ratio, limits.host_memory_available()
    )
