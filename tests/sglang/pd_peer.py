"""SGLang 0.5.17 PD peers for the Mooncake tests, each run in its own spawned process.

* prefill (:func:`prefill_peer`): an ordinary (non-HiSparse) ``DSATokenToKVPool`` on CPU filled with
  unique values, SGLang's ``PrefillBootstrapQueue`` (prefill-mode ``MooncakeKVManager`` +
  ``MooncakeKVSender`` per request) and ``MooncakeKVBootstrapServer``; pages go out through SGLang's
  own ``send_kv_chunk`` (the scheduler mixin method).
* decode (``pd_decode_peer.decode_peer``): hisparse-sglang loaded through SGLang's ``load_plugins()``;
  our device pool, allocator and coordinator (:class:`DecodeSide`); SGLang's ``DecodePreallocQueue``
  (its ``_init_kv_manager`` builds ``KVArgs`` from ``coordinator.mem_pool_host``; ``_pre_alloc`` calls
  the hooked ``alloc_for_decode_prealloc_hisparse``) and ``DecodeTransferQueue``, driven in the order
  of ``process_decode_queue``.

Both sides run SGLang's real parallel state (gloo, world size 1) and Mooncake over TCP on
127.0.0.1 (``--disaggregation-transfer-backend mooncake_tcp``). The Scheduler itself cannot be
built without a model, so each side passes a ``SchedulerView`` holding exactly the scheduler
attributes those SGLang methods read.

A peer takes commands from the test over a pipe (``{"cmd": ...}``) and reports events
(``{"event": ...}``), so the test scripts the order of things across processes; every loop has a
deadline. A peer ends with ``os._exit`` because SGLang's Mooncake manager threads are not daemons (a
normal exit would wait for them forever).

Every source row is unique: viewed as int32 words it is ``kv_words(layer, row)``; every index-K page
``index_words(layer, page)``. Decode memory nobody may write holds POISON.
"""

from __future__ import annotations

import dataclasses
import os
import time
import traceback
import types
from array import array

import drive
import torch

from hisparse_sglang.integration.sglang import compat

PAGE = 64
LAYERS = 3
POISON = 0xA5
PREFILL_TOKENS = PAGE * 40  # prefill KV pool tokens (pages 1..40 usable; page 0 is SGLang's padding page)
DEVICE_TOKENS = PAGE * 24  # decode device KV pool tokens
HOST_TO_DEVICE_RATIO = 4
METADATA_SLOTS = 8
REQUEST_SLOTS = 16  # prefill request slots (never freed there: one per request of a run)
RESERVED_DECODE_TOKENS = 64
INDEX_PAGE_BYTES = PAGE * (128 + 4)  # DSA index-K page: 64 x (128 fp8 + one fp32 scale) = 8448 B


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
    room: int  # the decode request's bootstrap room
    tokens: int
    prefill_pages: tuple[int, ...]  # where the prefill holds the request's KV (scattered on purpose)
    first_token: int  # the prefill's sampled token, carried by the metadata (aux) transfer
    chunk_end: int | None = None  # send a first, non-last chunk up to here (chunked prefill)
    stall: bool = False  # the prefill sends the first chunk only, until told to finish or the transfer failed
    prefill_room: int | None = None  # the room the prefill's request carries, if not ``room`` (a wrong room)

    @property
    def sender_room(self) -> int:
        return self.room if self.prefill_room is None else self.prefill_room

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


def page_rows(pages: torch.Tensor) -> torch.Tensor:
    return (pages.to(torch.int64)[:, None] * PAGE + torch.arange(PAGE)).reshape(-1)


# ------------------------------------------------------------------------------------------ process setup
class SchedulerView(types.SimpleNamespace):
    """The attributes of SGLang's Scheduler that the PD queue methods used here read."""


class OutputStreamer:
    """Records the requests SGLang streams out (the aborted ones here) with their abort messages."""

    def __init__(self) -> None:
        self.aborted: list[tuple[str, str]] = []

    def stream_output(self, reqs, return_logprob, *args, **kwargs) -> None:
        self.aborted.extend((req.rid, req.finished_reason.message) for req in reqs)


def start_process(mode: str, bootstrap_port: int, layout: Layout, env: dict[str, str]):
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
        **(dict(disaggregation_decode_retraction_backup="cpu_tensor") if drive.retraction_backup_is_configurable() else {}),
    )
    # The dummy model skips __post_init__'s handlers; this one turns mooncake_tcp into mooncake +
    # MC_FORCE_TCP=1 (Mooncake's TCP transport, no RDMA device needed).
    handle_pd_disaggregation(server_args)
    init_single_rank_scheduler(server_args)
    drive.call(maybe_init_shared_mooncake_transfer_engine, gpu_id=0, optional=dict(server_args=server_args))
    return server_args


def new_req(spec: RequestSpec, bootstrap_port: int, room: int):
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    return Req(
        spec.rid,
        "",
        array("q", [(spec.room * 7 + t) % 30000 + 1 for t in range(spec.tokens)]),
        SamplingParams(max_new_tokens=16),
        bootstrap_host="127.0.0.1",
        bootstrap_port=bootstrap_port,
        bootstrap_room=room,
    )


def torch_dtype(layout: Layout) -> torch.dtype:
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


def command_loop(conn, handlers, step, deadline_s: float) -> None:
    """Runs ``step()`` every 5 ms and each command ``{"cmd": name, ...}`` from the test through
    ``handlers[name](command)`` in between, until "exit"; past ``deadline_s`` it raises."""
    started = time.monotonic()
    while True:
        while conn.poll():
            command = conn.recv()
            if command["cmd"] == "exit":
                return
            handlers[command["cmd"]](command)
        step()
        if time.monotonic() - started > deadline_s:
            raise TimeoutError(f"peer still running after {deadline_s} s")
        time.sleep(0.005)


def run_peer(conn, body) -> None:
    """Runs ``body()``; a failure goes to the test as an "error" event; the process then ends."""
    try:
        body()
    except BaseException:
        conn.send({"event": "error", "traceback": traceback.format_exc()})
    finally:
        conn.close()
        os._exit(0)


# ------------------------------------------------------------------------------------------ prefill
class _Prefill:
    """A prefill scheduler's PD side: bootstrap server, KV pool, bootstrap queue, senders.

    Commands: ``add`` (specs: requests to prefill and send), ``finish`` (rid: send the last chunk of
    a stalled request now). Events: ``status`` (rid, "Success" or "Failed", the failure reason).
    A stalled request whose transfer failed gets its last chunk sent anyway, as a forward that
    finishes late would: SGLang must drop it.
    """

    def __init__(self, conn, layout: Layout, bootstrap_port: int, deadline_s: float, env: dict[str, str]) -> None:
        self.conn, self.bootstrap_port = conn, bootstrap_port
        server_args = start_process("prefill", bootstrap_port, layout, env)
        from sglang.srt.disaggregation.mooncake.conn import MooncakeKVBootstrapServer
        from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue, SchedulerDisaggregationPrefillMixin
        from sglang.srt.disaggregation.utils import MetadataBuffers, ReqToMetadataIdxAllocator, TransferBackend
        from sglang.srt.distributed import parallel_state
        from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool, ReqToTokenPool

        self.bootstrap_server = MooncakeKVBootstrapServer(host="127.0.0.1", port=bootstrap_port)
        _wait_listening(bootstrap_port, deadline_s)  # its thread binds the port; the KV manager registers there
        pool = DSATokenToKVPool(
            size=PREFILL_TOKENS, page_size=PAGE, kv_lora_rank=512, dtype=torch_dtype(layout), qk_rope_head_dim=64,
            layer_num=LAYERS, device="cpu", index_head_dim=128, enable_memory_saver=False,
            kv_cache_dim=layout.kv_cache_dim,
        )
        for layer in range(LAYERS):
            rows = byte_rows(pool.kv_buffer[layer])
            rows.copy_(kv_words(layer, torch.arange(rows.shape[0]), layout.row_bytes))
            index = pool.index_k_with_scale_buffer[layer]
            index.copy_(index_words(layer, torch.arange(index.shape[0])))
        self.req_to_token_pool = ReqToTokenPool(
            size=REQUEST_SLOTS, max_context_len=4096, device="cpu", enable_memory_saver=False
        )
        metadata_buffers = MetadataBuffers(
            METADATA_SLOTS, hidden_size=16, hidden_states_dtype=torch.bfloat16, max_sampling_mask_tokens=0
        )
        self.metadata_allocator = ReqToMetadataIdxAllocator(METADATA_SLOTS)

        class PrefillSchedulerView(SchedulerDisaggregationPrefillMixin, SchedulerView):
            """The view with SGLang's prefill-scheduler methods (send_kv_chunk calls its helpers on self)."""

        self.view = PrefillSchedulerView(
            server_args=server_args,
            ps=types.SimpleNamespace(tp_rank=0, dp_rank=0, gpu_id=0),
            tp_worker=types.SimpleNamespace(
                model_runner=types.SimpleNamespace(
                    kv_cache_dtype_str=layout.kv_cache_dtype, effective_max_total_num_tokens=PREFILL_TOKENS,
                    effective_logical_max_total_num_tokens=PREFILL_TOKENS,
                )
            ),
            model_config=types.SimpleNamespace(num_hidden_layers=LAYERS, hf_text_config=types.SimpleNamespace()),
            req_to_token_pool=self.req_to_token_pool,
            # a plain paged allocator of the DSA pool: transfer ids are its locations
            token_to_kv_pool_allocator=types.SimpleNamespace(
                page_size=PAGE, get_kvcache=lambda: pool, translate_kv_indices_for_transfer=lambda indices: indices
            ),
            attn_tp_cpu_group=parallel_state.get_attn_tp_group().cpu_group,
            attn_cp_cpu_group=parallel_state.get_attn_cp_group().cpu_group,
            disagg_metadata_buffers=metadata_buffers,
            sliding_window_size=None,
            output_streamer=OutputStreamer(),
            handle_bootstrap_failure=lambda req: self._concluded(req, "Failed"),
            # read by later releases' prefill queue (0.5.2x): no KV checksums, no KV-cache sharding, no
            # Rust HTTP server, no prefix cache, chunks sent at once (no staging)
            kv_checksum_computer=None, kv_shard_widening=1, rust_server=None, tree_cache=None,
            processed_tokens_counter=0, disagg_prefill_pending_chunk_rids=set(), enable_staging=False,
        )
        self.queue = drive.call(
            PrefillBootstrapQueue, token_to_kv_pool=pool, draft_token_to_kv_pool=None,
            req_to_metadata_buffer_idx_allocator=self.metadata_allocator,
            metadata_buffers=metadata_buffers, gpu_id=0, bootstrap_port=bootstrap_port,
            max_total_num_tokens=PREFILL_TOKENS, scheduler=self.view, transfer_backend=TransferBackend.MOONCAKE,
            optional=dict(
                tp_rank=0, tp_size=1, gloo_group=parallel_state.get_tp_group().cpu_group, pp_rank=0, pp_size=1,
                scheduler_stage_metrics=drive.disabled_stage_metrics(),
            ),
        )
        self.view.disagg_prefill_bootstrap_queue = self.queue
        self.specs: dict[str, RequestSpec] = {}
        self.reqs: dict = {}
        self.sending: set[str] = set()  # bootstrapped, not concluded
        self.unsent_last_chunk: set[str] = set()

    # -------------------------------------------------------------- commands
    def add(self, command) -> None:
        for spec in command["specs"]:
            req = new_req(spec, self.bootstrap_port, spec.sender_room)
            self.req_to_token_pool.alloc([req])
            rows = spec.prefill_rows()[: spec.tokens]
            self.req_to_token_pool.req_to_token[compat.req_slot(req), : spec.tokens] = rows.to(torch.int32)
            self.queue.add(req, num_kv_heads=1)
            self.specs[spec.rid], self.reqs[spec.rid] = spec, req

    def finish(self, command) -> None:
        self._send_last_chunk(command["rid"])

    # -------------------------------------------------------------- the scheduler's loop
    def step(self) -> None:
        from sglang.srt.disaggregation.base.conn import KVPoll

        for req in self.queue.pop_bootstrapped():
            spec = self.specs[req.rid]
            # SGLang 0.5.2x hands the page indices to its transfer worker through pinned memory and
            # a CUDA event when the sender supports it; this machine has no GPU: its other
            # (synchronous) path, as before 0.5.2x.
            req.disagg_kv_sender.supports_host_tensor_indices = False
            # the "forward": chunked prefill sends finished pages first, then the rest
            if spec.chunk_end is not None:
                drive.set_extend_range(req, 0, spec.chunk_end)
                self.view.send_kv_chunk(req, last_chunk=False)
            self.unsent_last_chunk.add(req.rid)
            if not spec.stall:
                self._send_last_chunk(req.rid)
            self.sending.add(req.rid)
        for rid in sorted(self.sending):
            poll = self.reqs[rid].disagg_kv_sender.poll()
            if poll == KVPoll.Success:
                self._concluded(self.reqs[rid], "Success")
            elif poll == KVPoll.Failed:
                self._concluded(self.reqs[rid], "Failed")
                if rid in self.unsent_last_chunk:
                    self._send_last_chunk(rid)  # the stalled forward ends after the failure

    def _send_last_chunk(self, rid: str) -> None:
        req, spec = self.reqs[rid], self.specs[rid]
        self.unsent_last_chunk.discard(rid)
        req.output_ids.append(spec.first_token)
        drive.set_extend_range(req, spec.chunk_end or 0, spec.tokens)
        self.view.send_kv_chunk(req, last_chunk=True)

    def _concluded(self, req, status: str) -> None:
        from sglang.srt.disaggregation.prefill import maybe_release_metadata_buffer

        reason = None
        if status == "Failed":
            try:
                req.disagg_kv_sender.failure_exception()
            except Exception as exc:  # SGLang's KVTransferError: its message is the reason
                reason = str(exc)
        self.sending.discard(req.rid)
        maybe_release_metadata_buffer(req, self.metadata_allocator)
        self.conn.send({"event": "status", "rid": req.rid, "status": status, "reason": reason})


def prefill_peer(conn, layout_name: str, bootstrap_port: int, deadline_s: float, env: dict[str, str]) -> None:
    """Prefill process: sends "registered" once its KV manager registered, then runs commands."""

    def body() -> None:
        prefill = _Prefill(conn, LAYOUTS[layout_name], bootstrap_port, deadline_s, env)
        conn.send({"event": "registered"})
        command_loop(conn, {"add": prefill.add, "finish": prefill.finish}, prefill.step, deadline_s)
        prefill.bootstrap_server.close()

    run_peer(conn, body)


# ------------------------------------------------------------------------------------------ decode
class DecodeSide:
    """Our HiSparse stack and SGLang's decode PD queues, as the decode scheduler builds them."""

    def __init__(self, layout: Layout, quarantine_s: float, env: dict[str, str]) -> None:
        self.layout = layout
        # a decode instance binds no bootstrap port (each request names its prefill's)
        self.server_args = start_process("decode", 8998, layout, env)
        os.environ["SGLANG_PLUGINS"] = "hisparse"
        from sglang.srt.plugins import load_plugins

        load_plugins()  # applies hisparse-sglang's hooks, as in a scheduler process
        from sglang.srt.disaggregation.decode import DecodePreallocQueue, DecodeReqToTokenPool, DecodeTransferQueue
        from sglang.srt.disaggregation.utils import (
            DisaggregationMode,
            MetadataBuffers,
            ReqToMetadataIdxAllocator,
            TransferBackend,
        )
        from sglang.srt.distributed import parallel_state
        from sglang.srt.managers.scheduler import Scheduler
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        from hisparse_sglang.config import HiSparseConfig
        from hisparse_sglang.integration.sglang.allocator import HiSparseTokenAllocator
        from hisparse_sglang.integration.sglang.pool import HiSparseDevicePool

        self.config = HiSparseConfig(
            top_k=128, device_buffer_size=256, host_to_device_ratio=HOST_TO_DEVICE_RATIO, pd_quarantine_s=quarantine_s
        )
        self.pool = HiSparseDevicePool(
            size=DEVICE_TOKENS, page_size=PAGE, kv_lora_rank=512, dtype=torch_dtype(layout), qk_rope_head_dim=64,
            layer_num=LAYERS, device="cpu", index_head_dim=128, enable_memory_saver=False,
            kv_cache_dim=layout.kv_cache_dim, host_to_device_ratio=HOST_TO_DEVICE_RATIO,
        )
        self.allocator = HiSparseTokenAllocator(
            DEVICE_TOKENS, page_size=PAGE, dtype=torch_dtype(layout), device="cpu", kvcache=self.pool,
            need_sort=True, host_to_device_ratio=HOST_TO_DEVICE_RATIO,
        )
        self.req_to_token_pool = DecodeReqToTokenPool(
            size=8, max_context_len=4096, device="cpu", enable_memory_saver=False, pre_alloc_size=8
        )
        self.coordinator = self.pool.runtime.start(self.config, self.req_to_token_pool, "cpu")
        self.host = self.coordinator.host_pool
        self.tree_cache = drive.disabled_prefix_cache(self.req_to_token_pool, self.allocator, PAGE)
        self.metadata_buffers = MetadataBuffers(
            METADATA_SLOTS, hidden_size=16, hidden_states_dtype=torch.bfloat16, max_sampling_mask_tokens=0
        )
        self.metadata_allocator = ReqToMetadataIdxAllocator(METADATA_SLOTS)
        self.streamer = OutputStreamer()
        self.tokenizer_aborts: list[str] = []
        self.waiting_queue: list = []

        class DecodeSchedulerView(SchedulerView, Scheduler):
            """The view with SGLang's Scheduler methods (abort_request calls its helpers on self:
            collect_inflight_reqs from 0.5.19, _release_aborted_request from 0.5.20, send_abort_output
            from 0.5.23). Scheduler.__init__ never runs: the view holds the attributes."""

        self.view = DecodeSchedulerView(
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
            waiting_queue=self.waiting_queue,
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
            # what Scheduler.abort_request reads besides the above
            chunked_req=None,
            enable_hicache_storage=False,
            # ... and in later releases: no encoder, no beam-search groups (0.5.19+), no continuous
            # input polling (0.5.22+), no Rust HTTP server (0.5.23)
            mm_receiver=None,
            beam_coordinator=types.SimpleNamespace(retire_group=lambda req: None),
            rust_server=None,
            enable_continuous_input_polling=False,
            result_queue=[],
            ipc_channels=types.SimpleNamespace(
                send_to_tokenizer=types.SimpleNamespace(
                    send_output=lambda output, req=None: self.tokenizer_aborts.append(output.rid)
                )
            ),
            disaggregation_mode=DisaggregationMode.DECODE,
            tree_cache=self.tree_cache,
            dllm_config=None,
            grammar_manager=types.SimpleNamespace(abort_requests=lambda recv_req: None),
        )
        gloo_group = parallel_state.get_attn_tp_group().cpu_group
        self.transfer_queue = drive.call(
            DecodeTransferQueue, req_to_metadata_buffer_idx_allocator=self.metadata_allocator,
            metadata_buffers=self.metadata_buffers, scheduler=self.view, tree_cache=self.tree_cache,
            optional=dict(gloo_group=gloo_group, tp_rank=0),
        )
        self.prealloc_queue = drive.call(
            DecodePreallocQueue, req_to_token_pool=self.req_to_token_pool, token_to_kv_pool_allocator=self.allocator,
            draft_token_to_kv_pool=None, req_to_metadata_buffer_idx_allocator=self.metadata_allocator,
            metadata_buffers=self.metadata_buffers, scheduler=self.view, transfer_queue=self.transfer_queue,
            tree_cache=self.tree_cache, gpu_id=0, bootstrap_port=0, max_total_num_tokens=DEVICE_TOKENS,
            num_reserved_decode_tokens=RESERVED_DECODE_TOKENS, transfer_backend=TransferBackend.MOONCAKE,
            optional=dict(gloo_group=gloo_group, tp_rank=0, tp_size=1, dp_size=1, pp_rank=0),
        )
        self.view.disagg_decode_prealloc_queue = self.prealloc_queue  # the transfer queue asks (0.5.22+)
        self.view.disagg_decode_transfer_queue = self.transfer_queue
        self.kv_manager = self.prealloc_queue.kv_manager
        for layer in range(LAYERS):
            self.host.layers[layer].fill_(POISON)
            self.device_rows(layer).fill_(POISON)
            self.pool.index_k_with_scale_buffer[layer].fill_(POISON)

    def device_rows(self, layer: int) -> torch.Tensor:
        return byte_rows(self.pool.kv_buffer[layer])

    def registration_report(self) -> dict:
        """What the decode KV manager registered and will send to the prefill."""
        from sglang.srt.disaggregation.base.conn import StateType

        kv_args = self.kv_manager.kv_args
        host_ptrs, host_lens, host_item_lens = self.coordinator.mem_pool_host.get_contiguous_buf_infos()
        state_ptrs, _, state_item_lens = self.pool.get_state_buf_infos()
        return {
            "kv_data_is_host_pool": (
                list(kv_args.kv_data_ptrs), list(kv_args.kv_data_lens), list(kv_args.kv_item_lens)
            ) == (host_ptrs, host_lens, host_item_lens),
            "kv_item_lens": list(kv_args.kv_item_lens),
            "kv_data_lens": list(kv_args.kv_data_lens),
            "page_size": kv_args.page_size,
            "state_types": [str(t) for t in kv_args.state_types],
            "dsa_state_is_index_k": kv_args.state_types == [StateType.DSA]
            and kv_args.state_data_ptrs == [state_ptrs]
            and kv_args.state_item_lens == [state_item_lens],
            "is_mla_backend": self.kv_manager.is_mla_backend,
        }

    def alloc_logical(self, num_tokens: int) -> torch.Tensor:
        """Logical locations of a request that is not part of the transfer (a running one)."""
        zero, length = torch.tensor([0]), torch.tensor([num_tokens])
        return self.allocator.alloc_logical_only(
            prefix_lens=zero, prefix_lens_cpu=zero, seq_lens=length, seq_lens_cpu=length,
            last_loc=torch.tensor([-1]), extend_num_tokens=num_tokens,
        )


# A decode side with nothing left to hold (request slots: DecodeReqToTokenPool size 8 + pre_alloc_size 8).
NO_LEAKS = {
    "logical_pages_in_use": 0,
    "device_pages_in_use": 0,
    "buffers_in_use": 0,
    "coordinator_requests": 0,
    "preallocated_entries": 0,
    "quarantined_pages": 0,
    "metadata_slots_free": 8,
    "request_slots_free": 16,
}


def leak_report(side) -> dict:
    """What a decode side still holds, keyed as NO_LEAKS. ``side`` has the HiSparse ``allocator`` and
    ``coordinator``, SGLang's ``req_to_token_pool`` and ``metadata_allocator`` (DecodeSide here, the
    in-process DecodeQueues of pd_decode_harness)."""
    rows = side.allocator.rows
    return {
        "logical_pages_in_use": logical_pages_in_use(side.allocator),
        "device_pages_in_use": rows.device_rows.capacity_pages - rows.device_rows.free_pages,
        "buffers_in_use": side.coordinator.buffers.used_buffers,
        "coordinator_requests": len(side.coordinator.core.requests),
        "preallocated_entries": len(side.coordinator.mem_pool_host.preallocated),
        "quarantined_pages": side.allocator.quarantine.pages_held,
        "metadata_slots_free": side.metadata_allocator.available_size(),
        "request_slots_free": side.req_to_token_pool.available_size(),
    }


def logical_pages_in_use(allocator) -> int:
    # SGLang reads this budget every scheduling step; it also returns quarantined pages whose time is up
    allocator.logical_attn_allocator.available_size()
    logical = allocator.rows.logical
    return logical.capacity_pages - logical.free_pages
