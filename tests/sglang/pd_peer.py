"""The two SGLang 0.5.17 PD peers of ``test_pd_sglang_mooncake.py``, each in its own spawned process.

* prefill: an ordinary (non-HiSparse) ``DSATokenToKVPool`` on CPU filled with unique values,
  SGLang's ``PrefillBootstrapQueue`` (prefill-mode ``MooncakeKVManager`` + ``MooncakeKVSender``
  per request) and ``MooncakeKVBootstrapServer``; pages go out through SGLang's own
  ``send_kv_chunk`` (the scheduler mixin method).
* decode: hisparse-sglang loaded through SGLang's ``load_plugins()``; our device pool, allocator and
  coordinator; SGLang's ``DecodePreallocQueue`` (its ``_init_kv_manager`` builds ``KVArgs`` from
  ``coordinator.mem_pool_host``; ``_pre_alloc`` calls the hooked ``alloc_for_decode_prealloc_hisparse``)
  and ``DecodeTransferQueue``, driven in the order of ``process_decode_queue``.

Both sides run SGLang's real parallel state (gloo, world size 1) and Mooncake over TCP on
127.0.0.1 (``--disaggregation-transfer-backend mooncake_tcp``). The Scheduler itself cannot be
built without a model, so each side passes a ``SchedulerView`` holding exactly the scheduler
attributes those SGLang methods read.

A ``RequestSpec`` may stall (the prefill sends its first chunk, then nothing until the decode's
waiting timeout fails it; its last chunk is sent after that, as a late forward would) or wait for
the failures (the decode adds it once every other request concluded, while the failed request's
rows are in quarantine).

Every source row is unique: viewed as int32 words it is ``kv_words(layer, row)``; every index-K page
``index_words(layer, page)``. Decode memory nobody may write holds POISON. Results go back to the
test over a pipe; the process then ends with ``os._exit`` because SGLang's Mooncake manager
threads are not daemons (a normal exit would wait for them forever).
"""

from __future__ import annotations

import dataclasses
import os
import time
import traceback
import types
from array import array

import torch

from hisparse_sglang.integration.sglang import compat

PAGE = 64
LAYERS = 3
POISON = 0xA5
PREFILL_TOKENS = PAGE * 24  # prefill KV pool tokens (pages 1..24 usable; page 0 is SGLang's padding page)
DEVICE_TOKENS = PAGE * 24  # decode device KV pool tokens
HOST_TO_DEVICE_RATIO = 4
METADATA_SLOTS = 8
RESERVED_DECODE_TOKENS = 64
INDEX_PAGE_BYTES = PAGE * (128 + 4)  # DSA index-K page: 64 x (128 fp8 + one fp32 scale) = 8448 B
# Rows of a failed transfer are held this long (the prefill here never writes late; production
# keeps the default, longer than the prefill's transfer timeout).
PD_QUARANTINE_S = 2.0


@dataclasses.dataclass(frozen=True)
class Layout:
    name: str
    dtype: str  # torch dtype name of the MLA pool
    kv_cache_dim: int
    row_bytes: int
    kv_cache_dtype: str  # --kv-cache-dtype (both sides must agree; SGLang checks the string)


LAYOUTS = {
    "bf16": Layout("bf16", "bfloat16", 576, 1152, "auto"),
    # FlashMLA "V32" fp8 layout: 512 fp8 nope + 4 fp32 scales + 64 bf16 rope
    "fp8": Layout("fp8", "float8_e4m3fn", 656, 656, "fp8_e4m3"),
}


@dataclasses.dataclass(frozen=True)
class RequestSpec:
    rid: str
    room: int
    tokens: int
    prefill_pages: tuple[int, ...]  # where the prefill holds the request's KV (scattered on purpose)
    first_token: int  # the prefill's sampled token, carried by the metadata (aux) transfer
    chunk_end: int | None = None  # send a first, non-last chunk up to here (chunked prefill)
    stall: bool = False  # the prefill sends the first chunk only, until the decode gives up on it
    after_failures: bool = False  # the decode adds it once every other request concluded

    def first_chunk_pages(self) -> int:
        """Pages of the first chunk of a chunked request (a non-last chunk sends whole pages only)."""
        return (self.chunk_end or 0) // PAGE

    def prefill_rows(self) -> torch.Tensor:
        """Prefill KV rows of every row of the request's pages (transfers move whole pages)."""
        pages = torch.tensor(self.prefill_pages, dtype=torch.int64)
        return (pages[:, None] * PAGE + torch.arange(PAGE)).reshape(-1)


# ------------------------------------------------------------------------------------------ data
def kv_words(layer: int, rows: torch.Tensor, row_bytes: int) -> torch.Tensor:
    """uint8 ``[len(rows), row_bytes]``: int32 words ``layer << 24 | row * words + j`` (positive, unique)."""
    words = row_bytes // 4
    values = (layer << 24) + rows.to(torch.int64)[:, None] * words + torch.arange(words)
    return values.to(torch.int32).view(torch.uint8).reshape(len(rows), row_bytes)


def index_words(layer: int, pages: torch.Tensor) -> torch.Tensor:
    """uint8 ``[len(pages), 8448]`` for index-K pages, disjoint from every ``kv_words`` value."""
    words = INDEX_PAGE_BYTES // 4
    values = (1 << 30) + (layer << 24) + pages.to(torch.int64)[:, None] * words + torch.arange(words)
    return values.to(torch.int32).view(torch.uint8).reshape(len(pages), INDEX_PAGE_BYTES)


def byte_rows(buffer: torch.Tensor) -> torch.Tensor:
    """An MLA KV buffer ``[rows, 1, dim]`` as bytes ``[rows, row_bytes]`` (a view)."""
    return buffer.view(buffer.shape[0], -1).view(torch.uint8)


def first_difference(actual: torch.Tensor, expected: torch.Tensor, what: str) -> str | None:
    """None if equal, else the first differing (row, byte) of two uint8 ``[n, b]`` tensors."""
    if actual.shape != expected.shape:
        return f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    diff = (actual != expected).nonzero()
    if diff.numel() == 0:
        return None
    row, col = diff[0].tolist()
    return (
        f"{what}: {diff.shape[0]} bytes differ, first at (row {row}, byte {col}): "
        f"got {int(actual[row, col])}, expected {int(expected[row, col])}"
    )


def first_not_poison(tensor: torch.Tensor, what: str) -> str | None:
    bad = (tensor != POISON).nonzero()
    if bad.numel() == 0:
        return None
    return f"{what}: {bad.shape[0]} bytes written, first at {tuple(bad[0].tolist())}"


# ------------------------------------------------------------------------------------------ process setup
class SchedulerView(types.SimpleNamespace):
    """The attributes of SGLang's Scheduler that the PD queue methods used here read."""


class OutputStreamer:
    """Records the requests SGLang streams out (only aborted ones in this test)."""

    def __init__(self) -> None:
        self.aborted: list[str] = []

    def stream_output(self, reqs, return_logprob, *args, **kwargs) -> None:
        self.aborted.extend(req.rid for req in reqs)


def _start_process(mode: str, bootstrap_port: int, layout: Layout, env: dict[str, str]):
    """What an SGLang scheduler process sets up before its PD queues: published server args, the
    parallel state (gloo, one rank), DP attention and the shared Mooncake transfer engine."""
    os.environ["SGLANG_HOST_IP"] = "127.0.0.1"  # KV manager sockets and bootstrap registration
    os.environ["MC_LOG_LEVEL"] = "ERROR"
    os.environ["MC_TRANSFER_TIMEOUT"] = "5"
    os.environ.update(env)

    from pd_decode_harness import init_single_rank_scheduler
    from sglang.srt.arg_groups.pd_disaggregation_hook import handle_pd_disaggregation
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
        maybe_init_shared_mooncake_transfer_engine,
    )
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(
        model_path="dummy",  # no model: ServerArgs skips model-dependent resolution
        device="cpu",
        host="127.0.0.1",
        page_size=PAGE,
        kv_cache_dtype=layout.kv_cache_dtype,
        disaggregation_mode=mode,
        disaggregation_transfer_backend="mooncake_tcp",
        disaggregation_bootstrap_port=bootstrap_port,
        # resolved at launch from the KV pool from 0.5.18: CPU tensors for a DSA pool
        **(dict(disaggregation_decode_retraction_backup="cpu_tensor") if compat.retraction_backup_is_configurable() else {}),
    )
    # The dummy model skips __post_init__'s handlers; this one turns mooncake_tcp into mooncake +
    # MC_FORCE_TCP=1 (Mooncake's TCP transport, no RDMA device needed).
    handle_pd_disaggregation(server_args)
    init_single_rank_scheduler(server_args)
    compat.call(maybe_init_shared_mooncake_transfer_engine, gpu_id=0, optional=dict(server_args=server_args))
    return server_args


def _new_req(spec: RequestSpec, bootstrap_port: int):
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    return Req(
        spec.rid,
        "",
        array("q", [(spec.room * 7 + t) % 30000 + 1 for t in range(spec.tokens)]),
        SamplingParams(max_new_tokens=16),
        bootstrap_host="127.0.0.1",
        bootstrap_port=bootstrap_port,
        bootstrap_room=spec.room,
    )


def _torch_dtype(layout: Layout) -> torch.dtype:
    return getattr(torch, layout.dtype)


def _wait_listening(port: int, deadline_s: float) -> None:
    import socket

    started = time.monotonic()
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() - started > deadline_s:
                raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {deadline_s} s") from None
            time.sleep(0.02)


# ------------------------------------------------------------------------------------------ prefill
def run_prefill(
    conn, layout_name: str, specs: list[RequestSpec], bootstrap_port: int, deadline_s: float, env: dict[str, str]
) -> None:
    """Prefill peer: bootstrap server, KV pool, bootstrap queue, senders; reports each sender's poll."""
    try:
        layout = LAYOUTS[layout_name]
        server_args = _start_process("prefill", bootstrap_port, layout, env)
        from sglang.srt.disaggregation.base.conn import KVPoll
        from sglang.srt.disaggregation.mooncake.conn import MooncakeKVBootstrapServer
        from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue, SchedulerDisaggregationPrefillMixin
        from sglang.srt.disaggregation.utils import MetadataBuffers, ReqToMetadataIdxAllocator, TransferBackend
        from sglang.srt.distributed import parallel_state
        from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool, ReqToTokenPool

        bootstrap_server = MooncakeKVBootstrapServer(host="127.0.0.1", port=bootstrap_port)
        _wait_listening(bootstrap_port, deadline_s)  # its thread binds the port; the KV manager registers there
        pool = DSATokenToKVPool(
            size=PREFILL_TOKENS, page_size=PAGE, kv_lora_rank=512, dtype=_torch_dtype(layout), qk_rope_head_dim=64,
            layer_num=LAYERS, device="cpu", index_head_dim=128, enable_memory_saver=False,
            kv_cache_dim=layout.kv_cache_dim,
        )
        for layer in range(LAYERS):
            rows = byte_rows(pool.kv_buffer[layer])
            rows.copy_(kv_words(layer, torch.arange(rows.shape[0]), layout.row_bytes))
            index = pool.index_k_with_scale_buffer[layer]
            index.copy_(index_words(layer, torch.arange(index.shape[0])))
        req_to_token_pool = ReqToTokenPool(size=8, max_context_len=4096, device="cpu", enable_memory_saver=False)
        metadata_buffers = MetadataBuffers(
            METADATA_SLOTS, hidden_size=16, hidden_states_dtype=torch.bfloat16, max_sampling_mask_tokens=0
        )
        streamer = OutputStreamer()

        class PrefillSchedulerView(SchedulerDisaggregationPrefillMixin, SchedulerView):
            """The view with SGLang's prefill-scheduler methods (send_kv_chunk calls its helpers on self)."""

        view = PrefillSchedulerView(
            server_args=server_args,
            ps=types.SimpleNamespace(tp_rank=0, dp_rank=0, gpu_id=0),
            tp_worker=types.SimpleNamespace(
                model_runner=types.SimpleNamespace(
                    kv_cache_dtype_str=layout.kv_cache_dtype, effective_max_total_num_tokens=PREFILL_TOKENS,
                    effective_logical_max_total_num_tokens=PREFILL_TOKENS,
                )
            ),
            model_config=types.SimpleNamespace(num_hidden_layers=LAYERS, hf_text_config=types.SimpleNamespace()),
            req_to_token_pool=req_to_token_pool,
            # a plain paged allocator of the DSA pool: transfer ids are its locations
            token_to_kv_pool_allocator=types.SimpleNamespace(
                page_size=PAGE, get_kvcache=lambda: pool, translate_kv_indices_for_transfer=lambda indices: indices
            ),
            attn_tp_cpu_group=parallel_state.get_attn_tp_group().cpu_group,
            attn_cp_cpu_group=parallel_state.get_attn_cp_group().cpu_group,
            disagg_metadata_buffers=metadata_buffers,
            sliding_window_size=None,
            output_streamer=streamer,
            handle_bootstrap_failure=lambda req: streamer.aborted.append(req.rid),
            # read by later releases' prefill queue (0.5.2x): no KV checksums, no KV-cache sharding, no
            # Rust HTTP server, no prefix cache, chunks sent at once (no staging)
            kv_checksum_computer=None, kv_shard_widening=1, rust_server=None, tree_cache=None,
            processed_tokens_counter=0, disagg_prefill_pending_chunk_rids=set(), enable_staging=False,
        )
        queue = compat.call(
            PrefillBootstrapQueue, token_to_kv_pool=pool, draft_token_to_kv_pool=None,
            req_to_metadata_buffer_idx_allocator=ReqToMetadataIdxAllocator(METADATA_SLOTS),
            metadata_buffers=metadata_buffers, gpu_id=0, bootstrap_port=bootstrap_port,
            max_total_num_tokens=PREFILL_TOKENS, scheduler=view, transfer_backend=TransferBackend.MOONCAKE,
            optional=dict(
                tp_rank=0, tp_size=1, gloo_group=parallel_state.get_tp_group().cpu_group, pp_rank=0, pp_size=1,
                scheduler_stage_metrics=compat.disabled_stage_metrics(),
            ),
        )
        view.disagg_prefill_bootstrap_queue = queue
        # the KV manager registered itself with the bootstrap server inside the constructor
        conn.send({"event": "registered"})

        reqs = {}
        for spec in specs:
            req = _new_req(spec, bootstrap_port)
            req_to_token_pool.alloc([req])
            rows = spec.prefill_rows()[: spec.tokens]
            req_to_token_pool.req_to_token[compat.req_slot(req), : spec.tokens] = rows.to(torch.int32)
            queue.add(req, num_kv_heads=1)
            reqs[spec.rid] = req
        by_rid = {spec.rid: spec for spec in specs}

        def send_last_chunk(req, spec: RequestSpec) -> None:
            req.output_ids.append(spec.first_token)
            compat.set_extend_range(req, spec.chunk_end or 0, spec.tokens)
            view.send_kv_chunk(req, last_chunk=True)

        started = time.monotonic()
        sent = set()
        status = {}
        while len(status) < len(specs):
            if time.monotonic() - started > deadline_s:
                raise TimeoutError(f"senders unfinished after {deadline_s} s: concluded {status}")
            for req in queue.pop_bootstrapped():
                spec = by_rid[req.rid]
                # SGLang 0.5.2x hands the page indices to its transfer worker through pinned memory and
                # a CUDA event when the sender supports it; this machine has no GPU: its other
                # (synchronous) path, as before 0.5.2x.
                req.disagg_kv_sender.supports_host_tensor_indices = False
                # the "forward": chunked prefill sends finished pages first, then the rest
                if spec.chunk_end is not None:
                    compat.set_extend_range(req, 0, spec.chunk_end)
                    view.send_kv_chunk(req, last_chunk=False)
                if not spec.stall:
                    send_last_chunk(req, spec)
                sent.add(req.rid)
            for rid in sent - set(status):
                poll = reqs[rid].disagg_kv_sender.poll()
                if poll == KVPoll.Success:
                    status[rid] = "Success"
                elif poll == KVPoll.Failed:
                    status[rid] = "Failed"
                    if by_rid[rid].stall:
                        # The stalled forward finishes after the decode gave up: SGLang must drop it.
                        send_last_chunk(reqs[rid], by_rid[rid])
            time.sleep(0.005)
        conn.send({"event": "done", "status": status, "aborted": streamer.aborted})
        # stay alive (heartbeats, late status messages) until the test says the decode is done
        conn.poll(deadline_s)
        bootstrap_server.close()
    except BaseException:
        conn.send({"event": "error", "traceback": traceback.format_exc()})
    finally:
        conn.close()
        os._exit(0)


# ------------------------------------------------------------------------------------------ decode
class DecodeSide:
    """Our HiSparse stack and SGLang's decode PD queues, as the decode scheduler builds them."""

    def __init__(self, layout: Layout, bootstrap_port: int, env: dict[str, str]) -> None:
        self.layout = layout
        self.server_args = _start_process("decode", bootstrap_port, layout, env)
        os.environ["SGLANG_PLUGINS"] = "hisparse"
        from sglang.srt.plugins import load_plugins

        load_plugins()  # applies hisparse-sglang's hooks, as in a scheduler process
        from sglang.srt.disaggregation.decode import DecodePreallocQueue, DecodeReqToTokenPool, DecodeTransferQueue
        from sglang.srt.disaggregation.utils import MetadataBuffers, ReqToMetadataIdxAllocator, TransferBackend
        from sglang.srt.distributed import parallel_state
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        from hisparse_sglang.config import HiSparseConfig
        from hisparse_sglang.integration.sglang.allocator import HiSparseTokenAllocator
        from hisparse_sglang.integration.sglang.coordinator import SGLangHiSparseCoordinator
        from hisparse_sglang.integration.sglang.pool import HiSparseDevicePool

        self.config = HiSparseConfig(
            top_k=128, device_buffer_size=256, host_to_device_ratio=HOST_TO_DEVICE_RATIO,
            pd_quarantine_s=PD_QUARANTINE_S,
        )
        self.pool = HiSparseDevicePool(
            size=DEVICE_TOKENS, page_size=PAGE, kv_lora_rank=512, dtype=_torch_dtype(layout), qk_rope_head_dim=64,
            layer_num=LAYERS, device="cpu", index_head_dim=128, enable_memory_saver=False,
            kv_cache_dim=layout.kv_cache_dim, host_to_device_ratio=HOST_TO_DEVICE_RATIO,
        )
        self.allocator = HiSparseTokenAllocator(
            DEVICE_TOKENS, page_size=PAGE, dtype=_torch_dtype(layout), device="cpu", kvcache=self.pool,
            need_sort=True, host_to_device_ratio=HOST_TO_DEVICE_RATIO,
        )
        self.req_to_token_pool = DecodeReqToTokenPool(
            size=8, max_context_len=4096, device="cpu", enable_memory_saver=False, pre_alloc_size=8
        )
        self.coordinator = SGLangHiSparseCoordinator(
            self.config, self.req_to_token_pool, self.allocator, self.pool, "cpu"
        )
        self.host = self.coordinator.host_pool
        self.tree_cache = compat.disabled_prefix_cache(self.req_to_token_pool, self.allocator, PAGE)
        self.metadata_buffers = MetadataBuffers(
            METADATA_SLOTS, hidden_size=16, hidden_states_dtype=torch.bfloat16, max_sampling_mask_tokens=0
        )
        self.metadata_allocator = ReqToMetadataIdxAllocator(METADATA_SLOTS)
        self.streamer = OutputStreamer()
        self.view = SchedulerView(
            server_args=self.server_args,
            ps=types.SimpleNamespace(tp_rank=0, dp_rank=0, gpu_id=0, pp_size=1),
            tp_worker=types.SimpleNamespace(
                model_runner=types.SimpleNamespace(
                    kv_cache_dtype_str=layout.kv_cache_dtype, max_token_pool_size=self.allocator.size_full
                ),
                is_hybrid_swa=False,
            ),
            model_config=types.SimpleNamespace(num_hidden_layers=LAYERS),
            enable_hisparse=True,
            hisparse_coordinator=self.coordinator,
            running_batch=types.SimpleNamespace(reqs=[]),
            last_batch=None,
            waiting_queue=[],
            enable_priority_scheduling=False,
            enable_decode_hicache=False,
            spec_algorithm=SpeculativeAlgorithm.NONE,
            sliding_window_size=None,
            metrics_reporter=types.SimpleNamespace(enable_metrics=False, current_scheduler_metrics_enabled=False),
            output_streamer=self.streamer,
            # read by later releases' decode queues: KV checksums, LoRA budget, overlap streams (0.5.2x)
            random_seed=0, kv_checksum_computer=None, enable_lora=False, enable_overlap=False,
            # the reasoning-token count of the handed-over first token (0.5.2x): not counted here
            batch_result_processor=types.SimpleNamespace(_maybe_update_reasoning_tokens=lambda req, token: None),
        )
        gloo_group = parallel_state.get_attn_tp_group().cpu_group
        self.transfer_queue = compat.call(
            DecodeTransferQueue, req_to_metadata_buffer_idx_allocator=self.metadata_allocator,
            metadata_buffers=self.metadata_buffers, scheduler=self.view, tree_cache=self.tree_cache,
            optional=dict(gloo_group=gloo_group, tp_rank=0),
        )
        self.prealloc_queue = compat.call(
            DecodePreallocQueue, req_to_token_pool=self.req_to_token_pool, token_to_kv_pool_allocator=self.allocator,
            draft_token_to_kv_pool=None, req_to_metadata_buffer_idx_allocator=self.metadata_allocator,
            metadata_buffers=self.metadata_buffers, scheduler=self.view, transfer_queue=self.transfer_queue,
            tree_cache=self.tree_cache, gpu_id=0, bootstrap_port=bootstrap_port, max_total_num_tokens=DEVICE_TOKENS,
            num_reserved_decode_tokens=RESERVED_DECODE_TOKENS, transfer_backend=TransferBackend.MOONCAKE,
            optional=dict(gloo_group=gloo_group, tp_rank=0, tp_size=1, dp_size=1, pp_rank=0),
        )
        self.view.disagg_decode_prealloc_queue = self.prealloc_queue  # the transfer queue asks (0.5.22+)
        self.kv_manager = self.prealloc_queue.kv_manager
        self.poison()

    def poison(self) -> None:
        for layer in range(LAYERS):
            self.host.layers[layer].fill_(POISON)
            byte_rows(self.pool.kv_buffer[layer]).fill_(POISON)
            self.pool.index_k_with_scale_buffer[layer].fill_(POISON)

    def device_rows(self, layer: int) -> torch.Tensor:
        return byte_rows(self.pool.kv_buffer[layer])


def _registration_report(side: DecodeSide) -> dict:
    """What the decode KV manager registered and will send to the prefill."""
    from sglang.srt.disaggregation.base.conn import StateType

    kv_args = side.kv_manager.kv_args
    host_ptrs, host_lens, host_item_lens = side.coordinator.mem_pool_host.get_contiguous_buf_infos()
    state_ptrs, _, state_item_lens = side.pool.get_state_buf_infos()
    return {
        "kv_data_is_host_pool": (list(kv_args.kv_data_ptrs), list(kv_args.kv_data_lens), list(kv_args.kv_item_lens))
        == (host_ptrs, host_lens, host_item_lens),
        "kv_item_lens": list(kv_args.kv_item_lens),
        "page_size": kv_args.page_size,
        "state_types": [str(t) for t in kv_args.state_types],
        "dsa_state_is_index_k": kv_args.state_types == [StateType.DSA]
        and kv_args.state_data_ptrs == [state_ptrs]
        and kv_args.state_item_lens == [state_item_lens],
        "is_mla_backend": side.kv_manager.is_mla_backend,
    }


def _page_rows(pages: torch.Tensor) -> torch.Tensor:
    return (pages.to(torch.int64)[:, None] * PAGE + torch.arange(PAGE)).reshape(-1)


def _verify_landed(side: DecodeSide, done: list[RequestSpec], failed: list[RequestSpec], granted: dict) -> dict:
    """Host rows, index-K pages and device rows once every transfer concluded, before any admission.

    A transferred request's pages hold the prefill's pages; a failed request's pages hold exactly its
    first chunk (what arrived before the decode gave up) and no index-K page; nothing else was written.
    """
    problems = []
    row_bytes = side.layout.row_bytes
    host_expected = torch.zeros(side.host.num_rows, dtype=torch.bool)
    index_expected = torch.zeros(side.pool.index_k_with_scale_buffer[0].shape[0], dtype=torch.bool)
    for spec in done + failed:
        locations = granted[spec.rid]
        pages = locations[::PAGE] // PAGE
        if not torch.equal(locations, _page_rows(pages)[: spec.tokens]):
            problems.append(f"{spec.rid}: granted locations are not page-aligned runs")
        arrived = len(pages) if spec in done else spec.first_chunk_pages()
        host_rows = _page_rows(pages[:arrived])
        host_expected[host_rows] = True
        for layer in range(LAYERS):
            problems.append(
                first_difference(
                    side.host.layers[layer][host_rows],
                    kv_words(layer, spec.prefill_rows()[: arrived * PAGE], row_bytes),
                    f"{spec.rid} layer {layer} host rows",
                )
            )
        if spec in done:
            index_expected[pages] = True
            for layer in range(LAYERS):
                problems.append(
                    first_difference(
                        side.pool.index_k_with_scale_buffer[layer][pages],
                        index_words(layer, torch.tensor(spec.prefill_pages)),
                        f"{spec.rid} layer {layer} index-K pages",
                    )
                )
    for layer in range(LAYERS):
        problems.append(first_not_poison(side.host.layers[layer][~host_expected], f"layer {layer} other host rows"))
        other_pages = side.pool.index_k_with_scale_buffer[layer][~index_expected]
        problems.append(first_not_poison(other_pages, f"layer {layer} other index-K pages"))
        problems.append(first_not_poison(side.device_rows(layer), f"layer {layer} device KV rows before admission"))
    return {
        "problems": [p for p in problems if p],
        "host_rows_written": int(host_expected.sum()),
        "index_pages_written": int(index_expected.sum()),
    }


def _verify_admitted(side: DecodeSide, specs: list[RequestSpec], reqs: dict, granted: dict[str, torch.Tensor]) -> dict:
    """After admit_request_direct: short requests resident on device rows, long ones offloaded."""
    from hisparse_sglang.coordinator import OFFLOADED, RESIDENT

    problems, modes = [], {}
    row_bytes = side.layout.row_bytes
    device_written = torch.zeros(side.device_rows(0).shape[0], dtype=torch.bool)
    for spec in specs:
        req = reqs[spec.rid]
        record = side.coordinator.core.requests[compat.req_slot(req)]
        modes[spec.rid] = record.mode
        rows = side.pool.translate_loc_to_hisparse_device(granted[spec.rid]).to(torch.int64)
        if record.mode == RESIDENT:
            if not bool((rows > 0).all()):
                problems.append(f"{spec.rid}: resident but {int((rows <= 0).sum())} locations have no device row")
                continue
            device_written[rows] = True
            for layer in range(LAYERS):
                problems.append(
                    first_difference(
                        side.device_rows(layer)[rows], kv_words(layer, spec.prefill_rows()[: spec.tokens], row_bytes),
                        f"{spec.rid} layer {layer} device rows",
                    )
                )
        elif record.mode == OFFLOADED:
            if not bool((rows == 0).all()):
                problems.append(f"{spec.rid}: offloaded but {int((rows != 0).sum())} locations map to device rows")
        else:
            problems.append(f"{spec.rid}: unexpected mode {record.mode}")
    for layer in range(LAYERS):
        problems.append(first_not_poison(side.device_rows(layer)[~device_written], f"layer {layer} other device rows"))
    return {
        "problems": [p for p in problems if p],
        "modes": modes,
        "buffers_used": side.coordinator.buffers.used_buffers,
    }


def _alloc_logical(allocator, num_tokens: int) -> torch.Tensor:
    """Logical locations of a request that is not part of the transfer (a running one)."""
    zero, length = torch.tensor([0]), torch.tensor([num_tokens])
    return allocator.alloc_logical_only(
        prefix_lens=zero, prefix_lens_cpu=zero, seq_lens=length, seq_lens_cpu=length, last_loc=torch.tensor([-1]),
        extend_num_tokens=num_tokens,
    )


def _wait_for(conn, word: str, deadline_s: float) -> None:
    if not conn.poll(deadline_s) or conn.recv() != word:
        raise TimeoutError(f"the test did not say '{word}' within {deadline_s} s")


# A decode side with nothing left to hold (request slots: DecodeReqToTokenPool size 8 + pre_alloc_size 8).
NO_LEAKS = {
    "logical_pages_in_use": 0,
    "device_pages_in_use": 0,
    "buffers_in_use": 0,
    "coordinator_requests": 0,
    "preallocated_entries": 0,
    "metadata_slots_free": 8,
    "request_slots_free": 16,
}


def leak_report(side) -> dict:
    """What a decode side still holds, keyed as NO_LEAKS. ``side`` has the HiSparse ``allocator`` and
    ``coordinator``, SGLang's ``req_to_token_pool`` and ``metadata_allocator`` (DecodeSide here, the
    in-process DecodeQueues of pd_decode_harness)."""
    rows = side.allocator.rows
    return {
        "logical_pages_in_use": _logical_pages_in_use(side),
        "device_pages_in_use": rows.device_rows.capacity_pages - rows.device_rows.free_pages,
        "buffers_in_use": side.coordinator.buffers.used_buffers,
        "coordinator_requests": len(side.coordinator.core.requests),
        "preallocated_entries": len(side.coordinator.mem_pool_host.preallocated),
        "metadata_slots_free": side.metadata_allocator.available_size(),
        "request_slots_free": side.req_to_token_pool.available_size(),
    }


def _logical_pages_in_use(side) -> int:
    # SGLang reads this budget every scheduling step; it also returns quarantined rows whose time is up
    side.allocator.logical_attn_allocator.available_size()
    logical = side.allocator.rows.logical
    return logical.capacity_pages - logical.free_pages


class _DecodeLoop:
    """``process_decode_queue`` (decode.py:2333-2342) step by step, with admission deferred so the
    bytes can be checked first; records what each request was granted and how failures ended."""

    def __init__(self, side: DecodeSide, specs: list[RequestSpec], reqs: dict, deadline_s: float) -> None:
        self.side, self.reqs, self.deadline_s = side, reqs, deadline_s
        self.by_rid = {spec.rid: spec for spec in specs}
        self.granted: dict[str, torch.Tensor] = {}
        self.captured: dict[str, bool] = {}
        self.transferred: dict = {}
        self.released_on_failure: dict[str, dict] = {}
        self.failed_at: float | None = None

    def run(self, rids: list[str]) -> None:
        side = self.side
        side.prealloc_queue.extend([self.reqs[rid] for rid in rids])
        started = time.monotonic()
        slots: dict[str, int] = {}
        failing: set[str] = set()  # aborted, their KV not released yet
        while failing or not all(rid in self.transferred or rid in side.streamer.aborted for rid in rids):
            if time.monotonic() - started > self.deadline_s:
                raise TimeoutError(f"transfers unfinished after {self.deadline_s} s: done {sorted(self.transferred)}")
            preallocated, _ = side.prealloc_queue.pop_preallocated()
            for decode_req in preallocated:
                req = decode_req.req
                slot = compat.req_slot(req)
                locations = side.req_to_token_pool.req_to_token[slot, : self.by_rid[req.rid].tokens].to(torch.int64)
                self.granted[req.rid] = locations
                hooked = side.coordinator.mem_pool_host.preallocated.get(slot)
                self.captured[req.rid] = hooked is not None and torch.equal(hooked.to(torch.int64), locations)
            side.transfer_queue.extend(preallocated)
            aborted_before = set(side.streamer.aborted)
            slots.update({d.req.rid: compat.req_slot(d.req) for d in side.transfer_queue.queue})
            for req in side.transfer_queue.pop_transferred():
                self.transferred[req.rid] = req
            failing |= set(side.streamer.aborted) - aborted_before
            # SGLang's failure path ran request_finished and release_kv_cache for these requests (from
            # 0.5.21, once the prefill acknowledged that its writes drained)
            compat.resolve_deferred_releases(side.transfer_queue)
            for rid in [rid for rid in failing if compat.req_slot_or_none(self.reqs[rid]) is None]:
                failing.discard(rid)
                self.failed_at = time.monotonic()
                slot = slots.get(rid)  # None: failed before preallocation
                self.released_on_failure[rid] = {
                    "slot_released": True,
                    "coordinator_forgot": slot not in side.coordinator.core.requests
                    and slot not in side.coordinator.mem_pool_host.preallocated,
                    "finished_reason": type(self.reqs[rid].finished_reason).__name__,
                }
            time.sleep(0.005)


def run_decode(
    conn, layout_name: str, specs: list[RequestSpec], bootstrap_port: int, deadline_s: float, env: dict[str, str]
) -> None:
    """Decode peer: preallocate, receive, verify, admit, release; reports everything it saw.

    Requests marked ``after_failures`` are only added once every other request concluded. Talks to
    the test in steps: "ready" -> waits "go" (the prefill registered) -> "concluded" (every transfer
    succeeded or failed) -> waits "check" (the prefill finished, late sends included) -> "done".
    """
    try:
        side = DecodeSide(LAYOUTS[layout_name], bootstrap_port, env)
        from sglang.srt.plugins.hook_registry import HookRegistry

        report = {"registration": _registration_report(side)}
        report["prealloc_hook_applied"] = (
            "sglang.srt.disaggregation.decode.alloc_for_decode_prealloc_hisparse" in HookRegistry._patched
        )
        # A running request holds a page in the middle of the free list, so the first preallocation
        # gets non-contiguous logical pages and the transfers must leave that page alone.
        freed = _alloc_logical(side.allocator, 2 * PAGE)
        held = _alloc_logical(side.allocator, PAGE)
        side.allocator.free(freed)
        reqs = {spec.rid: _new_req(spec, bootstrap_port) for spec in specs}
        loop = _DecodeLoop(side, specs, reqs, deadline_s)
        conn.send({"event": "ready"})
        _wait_for(conn, "go", deadline_s)

        started = time.monotonic()
        loop.run([spec.rid for spec in specs if not spec.after_failures])
        report["logical_pages_in_use_after_first_wave"] = _logical_pages_in_use(side)
        later = [spec.rid for spec in specs if spec.after_failures]
        if later:
            loop.run(later)
        report["transfer_seconds"] = time.monotonic() - started
        report["aborted"] = sorted(side.streamer.aborted)
        report["released_on_failure"] = loop.released_on_failure
        report["transferred"] = sorted(loop.transferred)
        report["hook_captured_locations"] = loop.captured
        report["first_tokens"] = {rid: list(req.output_ids) for rid, req in loop.transferred.items()}
        report["dst_pages"] = {rid: (locs[::PAGE] // PAGE).tolist() for rid, locs in loop.granted.items()}
        conn.send({"event": "concluded"})
        _wait_for(conn, "check", deadline_s)

        done = [spec for spec in specs if spec.rid in loop.transferred]
        failed = [spec for spec in specs if spec.rid in side.streamer.aborted]
        report["landed"] = _verify_landed(side, done, failed, loop.granted)
        report["held_rows_untouched"] = all(
            bool((side.host.layers[layer][held] == POISON).all()) for layer in range(LAYERS)
        )
        for spec in done:
            side.coordinator.admit_request_direct(loop.transferred[spec.rid])
        report["admitted"] = _verify_admitted(side, done, loop.transferred, loop.granted)

        for req in loop.transferred.values():
            side.coordinator.request_finished(req)
            compat.release_kv_cache(req, side.tree_cache)
        side.allocator.free(held)
        if loop.failed_at is not None:
            # rows of a failed transfer come back once the quarantine is over
            time.sleep(max(0.0, loop.failed_at + side.config.pd_quarantine_s - time.monotonic()) + 0.05)
        report["leaks"] = leak_report(side)
        conn.send({"event": "done", "report": report})
    except BaseException:
        conn.send({"event": "error", "traceback": traceback.format_exc()})
    finally:
        conn.close()
        os._exit(0)
