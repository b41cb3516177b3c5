"""The decode side of ``test_pd_long_prompt.py``: hisparse-sglang's stack under SGLang 0.5.17's real
decode-side objects (FAKE transfer backend), driven in the order of ``process_decode_queue``.

Runs in the test's spawned child, after SGLang's process setup and ``load_plugins()``. The worker and
the scheduler cannot be built without a model, so views hold the attributes SGLang's methods read.
The FAKE backend moves no bytes, so :meth:`DecodeQueues.preallocate` writes each request's KV into its
granted host rows (the prefill instance's write). ``Stack.decode`` checks every swapped-in row.
"""

from __future__ import annotations

import logging
import types
from array import array

import drive
from pd_peer import leak_report

from hisparse_sglang.integration.sglang import compat

PAGE = 64
DEVICE_TOKENS = PAGE * 8
RATIO = 8
BUFFER_SIZE = 256
CONTEXT_LEN = 4096
RESERVED = 512  # SGLang's default --num-reserved-decode-tokens
CAPACITY = (DEVICE_TOKENS * RATIO - RESERVED) // PAGE * PAGE  # 3584
LONG = 1500  # > DEVICE_TOKENS
SHORTER = 400  # < DEVICE_TOKENS, > BUFFER_SIZE: admitted offloaded as well



def rejection_message(scheduler, error: str | None) -> str | None:
    """The abort message a client receives for a prompt SGLang's ``validate_input_length`` rejected:
    the scheduler then queues the aborted request, and the plugin's hook on
    ``Scheduler._add_request_to_queue`` appends why a KV pool sets the limit."""
    if error is None:
        return None
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    from hisparse_sglang.integration.sglang import hooks

    rejected = types.SimpleNamespace(to_finish=FINISH_ABORT(error))
    hooks._add_request_to_queue_before(scheduler, rejected)
    return rejected.to_finish.message

class Streamer:
    """SGLang's output streamer, as the PD queues use it: records what they stream out (aborts)."""

    def __init__(self) -> None:
        self.aborted: dict[str, str] = {}

    def stream_output(self, reqs, return_logprob, *args, **kwargs) -> None:
        for req in reqs:
            self.aborted[req.rid] = req.finished_reason.message


class LogLines(logging.Handler):
    """hisparse-sglang's log lines of the child (the startup limit line is checked)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def take(self, prefix: str) -> list[str]:
        taken = [line for line in self.lines if line.startswith(prefix)]
        self.lines.clear()
        return taken


LOG = LogLines()


class DecodeQueues:
    """Our HiSparse stack and SGLang's decode-side objects, as a decode scheduler builds them."""

    def __init__(self, server_args) -> None:
        import torch
        from sglang.srt.disaggregation.decode import DecodePreallocQueue, DecodeReqToTokenPool, DecodeTransferQueue
        from sglang.srt.disaggregation.utils import MetadataBuffers, ReqToMetadataIdxAllocator, TransferBackend
        from sglang.srt.distributed import parallel_state
        from sglang.srt.managers.tp_worker import TpModelWorker
        from sglang.srt.runtime_context import get_disagg
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
        from test_coordinator_sglang import Stack

        self.server_args = server_args
        self.stack = Stack(
            device_tokens=DEVICE_TOKENS, ratio=RATIO, buffer_size=BUFFER_SIZE, top_k=128,
            req_to_token_pool=DecodeReqToTokenPool(
                size=8, max_context_len=CONTEXT_LEN, device="cpu", enable_memory_saver=False, pre_alloc_size=8
            ),
        )
        self.coordinator, self.allocator = self.stack.coordinator, self.stack.allocator
        self.req_to_token_pool = self.stack.req_to_token_pool
        self.tree_cache = self.stack.cache
        # What SGLang's ModelRunner reports (the union over the supported releases): the device pool
        # sizes, and under HiSparse the logical pool as max_token_pool_size (allocator.size_full).
        model_runner = types.SimpleNamespace(
            max_total_num_tokens=DEVICE_TOKENS, effective_max_total_num_tokens=DEVICE_TOKENS, dcp_size=1,
            logical_max_total_num_tokens=DEVICE_TOKENS, effective_logical_max_total_num_tokens=DEVICE_TOKENS,
            max_token_pool_size=self.allocator.size_full, max_running_requests=8, forward_stream=None,
            req_to_token_pool=self.req_to_token_pool, token_to_kv_pool=self.stack.pool,
            token_to_kv_pool_allocator=self.allocator, hisparse_coordinator=self.coordinator,
            kv_cache_dtype_str="auto",
        )
        # TpModelWorker.get_worker_info reads these; SGLang's scheduler unpacks its tuple at startup.
        self.worker = types.SimpleNamespace(
            model_config=types.SimpleNamespace(context_len=CONTEXT_LEN), model_runner=model_runner,
            server_args=server_args, ps=types.SimpleNamespace(tp_rank=0, attn_dcp_size=1), random_seed=0, device="cpu",
            dllm_algorithm=None,
        )
        self.worker_info = TpModelWorker.get_worker_info(self.worker)
        self.streamer = Streamer()
        self.running: list = []
        self.waiting: list = []
        self.scheduler = types.SimpleNamespace(
            # init_req_max_new_tokens
            max_total_num_tokens=self.worker_info[0], max_req_len=self.worker_info[4],
            max_req_input_len=self.worker_info[5], max_new_tokens_limit=None, page_size=PAGE,
            token_to_kv_pool_allocator=self.allocator, kv_shard_widening=1, chunked_prefill_size=None,
            # the PD queues
            server_args=server_args, ps=types.SimpleNamespace(tp_rank=0, dp_rank=0, gpu_id=0, pp_size=1),
            tp_worker=types.SimpleNamespace(model_runner=model_runner, is_hybrid_swa=False),
            model_config=types.SimpleNamespace(num_hidden_layers=len(self.stack.layers)),
            enable_hisparse=True, hisparse_coordinator=self.coordinator,
            running_batch=types.SimpleNamespace(reqs=self.running), last_batch=None, waiting_queue=self.waiting,
            enable_priority_scheduling=False, enable_decode_hicache=False, spec_algorithm=SpeculativeAlgorithm.NONE,
            sliding_window_size=None,
            metrics_reporter=types.SimpleNamespace(enable_metrics=False, current_scheduler_metrics_enabled=False),
            output_streamer=self.streamer,
            # read by later releases' decode queues: 0.5.2x's KV checksums, LoRA budget, overlap streams
            random_seed=0, kv_checksum_computer=None, enable_lora=False, enable_overlap=False,
            # the reasoning-token count of the handed-over first token (0.5.2x): not counted here
            batch_result_processor=types.SimpleNamespace(_maybe_update_reasoning_tokens=lambda req, token: None),
        )
        self.metadata_buffers = MetadataBuffers(
            8, hidden_size=16, hidden_states_dtype=torch.bfloat16, max_sampling_mask_tokens=0
        )
        self.metadata_allocator = ReqToMetadataIdxAllocator(8)
        gloo_group = parallel_state.get_attn_tp_group().cpu_group
        self.transfer_queue = drive.call(
            DecodeTransferQueue, req_to_metadata_buffer_idx_allocator=self.metadata_allocator,
            metadata_buffers=self.metadata_buffers, scheduler=self.scheduler, tree_cache=self.tree_cache,
            optional=dict(gloo_group=gloo_group, tp_rank=0),
        )
        self.prealloc_queue = drive.call(
            DecodePreallocQueue, req_to_token_pool=self.req_to_token_pool, token_to_kv_pool_allocator=self.allocator,
            draft_token_to_kv_pool=None, req_to_metadata_buffer_idx_allocator=self.metadata_allocator,
            metadata_buffers=self.metadata_buffers, scheduler=self.scheduler, transfer_queue=self.transfer_queue,
            tree_cache=self.tree_cache, gpu_id=0, bootstrap_port=0,
            max_total_num_tokens=self.scheduler.max_total_num_tokens,
            num_reserved_decode_tokens=get_disagg().num_reserved_decode_tokens, transfer_backend=TransferBackend.FAKE,
            optional=dict(gloo_group=gloo_group, tp_rank=0, tp_size=1, dp_size=1, pp_rank=0),
        )
        self.scheduler.disagg_decode_prealloc_queue = self.prealloc_queue  # the transfer queue asks (0.5.22+)

    # -------------------------------------------------------------- requests
    def new_req(self, rid: str, prompt_len: int, max_new_tokens: int = 200):
        """A request as the decode scheduler receives it: max_new_tokens clamped, length validated."""
        from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST
        from sglang.srt.managers import scheduler as scheduler_module
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.managers.scheduler import Scheduler
        from sglang.srt.sampling.sampling_params import SamplingParams

        uid = len(self.stack.uids) + 1  # the KV values' request id (Stack.decode checks them)
        self.stack.uids[rid] = uid
        req = Req(
            rid, "", array("q", range(prompt_len)), SamplingParams(max_new_tokens=max_new_tokens),
            bootstrap_host=FAKE_BOOTSTRAP_HOST, bootstrap_port=8998, bootstrap_room=uid,
        )
        req.vocab_size = 32000  # the FAKE backend derives the handed-over first token from it (0.5.22+)
        Scheduler.init_req_max_new_tokens(self.scheduler, req)
        req.validation_error = rejection_message(
            self.scheduler, scheduler_module.validate_input_length(req, self.scheduler.max_req_input_len, False)
        )
        return req

    # -------------------------------------------------------------- process_decode_queue, step by step
    def resume(self) -> list:
        """decode.py:2320-2324: resume retracted requests (no new ones are preallocated while any stay)."""
        resumed = self.prealloc_queue.resume_retracted_reqs()
        for req in resumed:
            self.stack.lens[req.rid] = req.kv.kv_allocated_len
        self.waiting.extend(resumed)
        return resumed

    def preallocate(self) -> list:
        """decode.py:2333-2334, then the prefill instance's write into the granted host rows."""
        preallocated, _ = self.prealloc_queue.pop_preallocated()
        self.transfer_queue.extend(preallocated)
        for decode_req in preallocated:
            self._prefill_writes(decode_req.req)
        return [decode_req.req for decode_req in preallocated]

    def receive(self) -> list:
        """decode.py:2335-2342: the transferred requests are admitted and wait to run."""
        transferred = self.transfer_queue.pop_transferred()
        for req in transferred:
            self.coordinator.admit_request_direct(req)
            self.stack.lens[req.rid] = req.kv.kv_allocated_len
        self.waiting.extend(transferred)
        return transferred

    def _prefill_writes(self, req) -> None:
        import torch
        from test_coordinator_sglang import token_values

        fill_len = req.kv.kv_allocated_len
        host_rows = self.req_to_token_pool.req_to_token[compat.req_slot(req), :fill_len].to(torch.int64)
        for layer in self.stack.layers:
            nope, rope = token_values(self.stack.uids[req.rid], torch.arange(fill_len), layer.layer_id)
            row_bytes = torch.cat([nope, rope], dim=-1).reshape(fill_len, -1).view(torch.uint8)
            self.coordinator.host_pool.layers[layer.layer_id][host_rows] = row_bytes

    # -------------------------------------------------------------- running
    def run_waiting(self) -> None:
        self.running.extend(self.waiting)
        self.waiting.clear()

    def batch(self):
        """The running batch as a real ScheduleBatch (what check_decode_mem / retract_decode read)."""
        import torch
        from sglang.srt.managers.schedule_batch import ScheduleBatch
        from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        model_config = types.SimpleNamespace(vocab_size=32000, is_encoder_decoder=False)
        batch = ScheduleBatch.init_new(
            list(self.running), self.req_to_token_pool, self.allocator, self.tree_cache, model_config, False,
            SpeculativeAlgorithm.NONE,
        )
        batch.hisparse_coordinator = self.coordinator
        slots = [compat.req_slot(req) for req in batch.reqs]
        lens = [self.stack.lens[req.rid] for req in batch.reqs]
        batch.req_pool_indices, batch.req_pool_indices_cpu = torch.tensor(slots), torch.tensor(slots)
        batch.seq_lens, batch.seq_lens_cpu = torch.tensor(lens), torch.tensor(lens)
        batch.orig_seq_lens = torch.tensor(lens, dtype=torch.int32)
        batch.sampling_info = SamplingBatchInfo.from_schedule_batch(batch, model_config.vocab_size)
        return batch

    def decode_step(self) -> bool:
        """check_decode_mem (hooked), then one decode step of every running request; returns the check."""
        fits = self.batch().check_decode_mem()
        if fits:
            self.stack.decode(self.running)  # checks every swapped-in row's KV
            for req in self.running:
                req.output_ids.append(7)
        return fits

    def finish(self, req) -> None:
        self.coordinator.request_finished(req)
        drive.release_kv_cache(req, self.tree_cache)
        self.running.remove(req)

    def mode(self, req) -> str:
        return self.coordinator.core.requests[compat.req_slot(req)].mode

    def leaks(self) -> dict:
        return leak_report(self)


def init_single_rank_scheduler(server_args) -> None:
    """The process setup a one-rank SGLang scheduler does before building its queues: publish the
    server args, a gloo process group on a free loopback port, model parallel of 1, DP attention
    off (initialize_dp_attention reads only these model-config fields)."""
    import socket

    import torch
    from sglang.srt.distributed import parallel_state
    from sglang.srt.layers import dp_attention

    drive.publish_single_rank_scheduler(server_args)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    parallel_state.init_distributed_environment(
        world_size=1, rank=0, local_rank=0, backend="gloo", distributed_init_method=f"tcp://127.0.0.1:{port}"
    )
    drive.call(parallel_state.initialize_model_parallel, optional=dict(tensor_model_parallel_size=1))
    model_config = types.SimpleNamespace(hf_config=types.SimpleNamespace(), hidden_size=16, dtype=torch.bfloat16)
    drive.call(dp_attention.initialize_dp_attention, server_args, optional=dict(model_config=model_config))

