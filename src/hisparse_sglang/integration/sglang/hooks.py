"""The hooks hisparse-sglang installs into SGLang, each a declared spec.

Every spec names its target (a dotted path that must exist in the installed SGLang), the SGLang
releases it applies to (a PEP 440 specifier within ``compat.SUPPORTED_SGLANG``), why it is needed
and what upstream change would make it unnecessary. ``tests/sglang/test_hooks.py`` checks that the
target of every spec covering the installed release resolves and that SGLang's ``load_plugins()``
applies each of them. ``docs/sglang-versions.md`` says what differs between the releases.
"""

from __future__ import annotations

import logging

from hisparse_sglang.errors import UnsupportedSetupError, UnsupportedSGLangError
from hisparse_sglang.integration.sglang import compat
from hisparse_sglang.integration.sglang.hook_spec import HookSpec
from hisparse_sglang.integration.sglang.hooks_speculative import SPECULATIVE_HOOKS

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------------
# hook implementations (imports of sglang and of the adapters happen lazily, in the process that runs them)


def _validate_hisparse(server_args) -> None:
    """REPLACE validate_hisparse: our validation (main process, before any model load)."""
    if not server_args.enable_hisparse:
        return
    from hisparse_sglang.integration.sglang.validation import validate_server_args

    settings, model_config = compat.validation_inputs(server_args)
    validate_server_args(
        settings, model_config, kv_cache_dtype=str(settings.kv_cache_dtype), **compat.model_kind(model_config.hf_config)
    )


def _refuse_unsupported_sglang(server_args) -> None:
    """REPLACE validate_hisparse on an SGLang outside the supported range: --enable-hisparse stops
    the server at startup, before any scheduler starts, with the installed and supported versions."""
    if getattr(server_args, "enable_hisparse", False):
        raise UnsupportedSGLangError(compat.unsupported_message(compat.sglang_version()))


def _parse_hisparse_config(server_args=None):
    """REPLACE parse_hisparse_config: SGLang's SparseConfig, filled from the process's one validated
    config (the model's index_topk included: the coordinator starts from the same object)."""
    from sglang.srt.mem_cache.sparsity.core.sparse_coordinator import SparseConfig

    from hisparse_sglang.integration.sglang.validation import hisparse_config
    from hisparse_sglang.ops.swap_in_plan import DEFAULT_THREADS

    config = hisparse_config(server_args)
    return SparseConfig(
        top_k=config.top_k,
        device_buffer_size=config.device_buffer_size,
        host_to_device_ratio=config.host_to_device_ratio,
        swap_in_block_size=config.swap_in_block_size or DEFAULT_THREADS,
        page_size=config.page_size,
    )


def _pool_class():
    from hisparse_sglang.integration.sglang.pool import HiSparseDevicePool

    return HiSparseDevicePool


def _allocator_class():
    from hisparse_sglang.integration.sglang.allocator import HiSparseTokenAllocator

    return HiSparseTokenAllocator


def _maybe_init_hisparse_coordinator(self) -> None:
    """REPLACE ModelRunner.maybe_init_hisparse_coordinator: start the process's HiSparse runtime."""
    if not self.enable_hisparse:
        return
    if getattr(self, "is_draft_worker", False):
        # The draft (NextN) layer stays dense on the GPU over the logical space, without a coordinator
        # (docs/speculative.md 2.6 A): from 0.5.22 a draft runner's enable_hisparse is false, so only
        # 0.5.17 - 0.5.21 get here, where hooks H6 - H8 gave the draft runner that dense pool.
        return
    from hisparse_sglang.integration.sglang.validation import hisparse_config

    # The allocator, not the model runner: its hisparse_coordinator is the one being made here.
    runtime = _runtime_of(self.token_to_kv_pool_allocator)
    if runtime is None:
        raise UnsupportedSetupError(
            f"HiSparse expected its own KV allocator but SGLang built {type(self.token_to_kv_pool_allocator).__name__}; "
            f"the hisparse-sglang hooks did not apply (see the HookRegistry log lines)."
        )
    config = hisparse_config(self.server_args, self.model_config)
    self.hisparse_coordinator = runtime.start(
        config, self.req_to_token_pool, self.device, tp_group=compat.coordinator_cpu_group(self),
        dp_attention=compat.attention_dp_size() > 1, num_draft_tokens=_speculative_num_draft_tokens(),
    )


def _speculative_num_draft_tokens() -> int:
    """The verify positions of this server's speculative decoding (``--speculative-num-draft-tokens``,
    resolved), 0 without it: what SGLang's own coordinator is given."""
    from sglang.srt.runtime_context import get_spec

    spec = get_spec()
    algorithm = spec.speculative_algorithm
    if algorithm is None or str(algorithm).upper() == "NONE":
        return 0
    return int(spec.speculative_num_draft_tokens or 0)


def _check_decode_mem(original, self, selected_indices=None):
    """AROUND ScheduleBatch.check_decode_mem: logical rows for every request, device rows only
    for resident requests (offloaded ones decode into their buffer). Under speculative decoding
    (0.5.22+) the logical rows are the reserve SGLang allocates next (its own count), and the device
    check is the coordinator's for that reserve."""
    coordinator = _coordinator_of(self)
    if coordinator is None:
        return original(self, selected_indices)
    from sglang.srt.managers import schedule_batch

    num_tokens = self.new_tokens_required_next_decode(selected_indices)
    schedule_batch.evict_from_tree_cache(self.tree_cache, num_tokens)
    requests = self.reqs if selected_indices is None else [self.reqs[i] for i in selected_indices]
    allocator = self.token_to_kv_pool_allocator
    if allocator.rows.logical.free_rows < num_tokens:
        return False
    if not self.spec_algorithm.is_none():
        return coordinator.can_verify(requests)
    return coordinator.can_decode([compat.req_slot(req) for req in requests])


def _release_kv_cache_before(req, tree_cache, *args, **kwargs):
    """BEFORE release_kv_cache: every release of a request's KV also releases its HiSparse state.
    (Its third argument is ``is_insert`` up to 0.5.21, the keyword ``checkpoint`` from 0.5.22.)"""
    coordinator = _coordinator_of(tree_cache)
    if coordinator is not None:
        coordinator.release_request(req)


def _abort_request_after(result, self, recv_req):
    """AFTER Scheduler.abort_request: abort requests still staging (SGLang 0.5.17 leaves them running)."""
    coordinator = _coordinator_of(self)
    if coordinator is None:
        return result
    for req in coordinator.staging_reqs():
        if not req.finished() and (recv_req.abort_all or req.rid.startswith(recv_req.rid)):
            req.to_finish = compat.abort_reason("Aborted by AbortReq.")
    return result


def _alloc_for_decode_prealloc_after(result, allocator, *, req, fill_len, uses_swa_tail, swa_tail_len):
    """AFTER alloc_for_decode_prealloc_hisparse: remember the logical locations (= host rows) the
    prefill instance must write, before SGLang asks the host pool for them."""
    runtime = _runtime_of(allocator)
    if runtime is not None and runtime.started:
        # None (no logical rows left) is kept too, so that alloc_paged_token_slots names the cause.
        runtime.remember_preallocated(compat.req_slot(req), result)
    return result


def _batch_register_after(result, self, ptrs, lengths):
    """AFTER MooncakeTransferEngine.batch_register: a failed registration of a batch holding our host
    pool stops the decode instance with a typed error (SGLang ignores the code); other batches pass."""
    from hisparse_sglang.integration.sglang import mooncake

    host_pointers, host_lengths = compat.host_pool_regions(ptrs, lengths)
    if host_pointers:
        mooncake.check_host_pool_registration(result, host_pointers, host_lengths)
    return result


def _load_kv_cache_after(result, self, req_to_token_pool, token_to_kv_pool_allocator):
    """AFTER Req.load_kv_cache: a retracted PD-decode request resumed with its KV back in the host
    pool is admitted like a transferred one (SGLang 0.5.17 puts it in the waiting queue directly)."""
    coordinator = _coordinator_of(token_to_kv_pool_allocator)
    if coordinator is not None:
        coordinator.admit_request_direct(self)
    return result


def _report_decode_stats_after(result, self, *args, **kwargs):
    """AFTER SchedulerMetricsReporter.report_decode_stats: the HiSparse log line and metrics. (Its
    third parameter is ``num_correct_drafts`` up to 0.5.19, ``num_generated_tokens`` from 0.5.20.)"""
    coordinator = _coordinator_of(self.scheduler)
    if coordinator is None or self.forward_ct_decode % self.decode_log_interval != 0:
        return result
    if not (self.is_stats_logging_rank or self.current_scheduler_metrics_enabled):
        return result
    from hisparse_sglang.integration.sglang import metrics

    labels = getattr(self.metrics_collector, "labels", None) if self.current_scheduler_metrics_enabled else None
    metrics.report(coordinator, log=self.is_stats_logging_rank, prometheus_labels=labels)
    return result


def _get_worker_info_after(result, self):
    """AFTER TpModelWorker.get_worker_info: on a PD decode instance the request-length limits
    (items 4 and 5: max_req_len, max_req_input_len) come from the logical pool, not the device
    pool (item 0, kept: SGLang's invariant checks and metrics read it). Logs the limit once and
    records it for the rejection message (both modes). The arithmetic is limits'."""
    runtime = _runtime_of(self.model_runner)
    if runtime is None or not runtime.started:
        return result
    from hisparse_sglang.integration.sglang import limits

    max_req_len, max_req_input_len = result[limits.MAX_REQ_LEN_ITEM], result[limits.MAX_REQ_INPUT_LEN_ITEM]
    context_len = self.model_config.context_len
    device_tokens = self.model_runner.max_total_num_tokens
    mode = getattr(self.server_args, "disaggregation_mode", "null")
    if mode == "decode":
        from sglang.srt.runtime_context import get_disagg

        reserved = get_disagg().num_reserved_decode_tokens
        allocator = runtime.coordinator.allocator
        request_limits = limits.decode_request_limits(
            max_req_len, max_req_input_len, context_len=context_len, device_tokens=device_tokens,
            capacity=limits.decode_request_capacity(runtime.coordinator, reserved), logical_tokens=allocator.size,
            reserved=reserved, host_to_device_ratio=allocator.host_to_device_ratio,
        )
    elif mode == "null":
        request_limits = limits.colocated_request_limits(
            max_req_len, max_req_input_len, context_len=context_len, device_tokens=device_tokens
        )
    else:  # a prefill instance: SGLang's limits stand, nothing to explain
        request_limits = limits.RequestLimits(max_req_len, max_req_input_len)
    if request_limits.startup_line and compat.tp_rank() == 0:
        logger.info(request_limits.startup_line)
    runtime.set_request_limit(request_limits.max_req_input_len, request_limits.note)
    return limits.with_request_limits(result, request_limits)


def _init_req_max_new_tokens(original, self, req):
    """AROUND Scheduler.init_req_max_new_tokens: on a PD decode instance clamp max_new_tokens by the
    logical-pool capacity instead of the device pool (which gives a long prompt 0 new tokens)."""
    capacity = _decode_capacity(self)
    if capacity is None:
        return original(self, req)
    device_tokens = self.max_total_num_tokens
    self.max_total_num_tokens = capacity
    try:
        return original(self, req)
    finally:
        self.max_total_num_tokens = device_tokens


def _add_request_to_queue_before(self, req, *args, **kwargs):
    """BEFORE Scheduler._add_request_to_queue: a prompt SGLang rejected for a limit a KV pool sets
    (``validate_input_length``) gets the runtime's note on which pool and how to admit it appended
    to its abort message, which the client receives."""
    runtime = _runtime_of(self)
    abort = getattr(req, "to_finish", None)
    message = getattr(abort, "message", None)
    if runtime is not None and isinstance(message, str):
        abort.message = runtime.explain_rejection(message, self.max_req_input_len)


def _decode_prealloc_queue_init_after(result, self, *args, **kwargs):
    """AFTER DecodePreallocQueue.__init__: its max_total_num_tokens is read only by
    _check_if_req_exceed_kv_capacity (every new and every retracted request); make it the
    logical-pool capacity, which is what its preallocation budget uses."""
    coordinator = _coordinator_of(self.scheduler)
    if coordinator is not None:
        from hisparse_sglang.integration.sglang import limits

        self.max_total_num_tokens = limits.decode_request_capacity(coordinator, self.num_reserved_decode_tokens)


def _resume_retracted_reqs(original, self, rids_to_check=None):
    """AROUND DecodePreallocQueue.resume_retracted_reqs: resume only the retracted requests (in queue
    order) whose device pages the coordinator can provide now; the others stay retracted until
    pages free. SGLang 0.5.17 checks only the logical budget, and the admission on load_kv_cache
    raised PoolExhaustedError (a scheduler crash) when the device pool was short."""
    coordinator = _coordinator_of(self.scheduler)
    if coordinator is None or not self.retracted_queue:
        return original(self, rids_to_check)
    candidates = [req for req in self.retracted_queue if rids_to_check is None or req.rid in rids_to_check]
    admissible = _admissible_rids(coordinator, candidates, self._pre_alloc_fill_len, "retracted", "it resumes")
    return original(self, admissible)


def _pop_transferred(original, self, rids_to_check=None):
    """AROUND DecodeTransferQueue.pop_transferred: hand over (for admit_request_direct) only the
    requests, in queue order, whose device pages the coordinator can provide now; the others stay
    in the transfer queue. Device pages budgeted at preallocation can be taken by resident requests
    growing while the transfer runs; SGLang 0.5.17 then admitted anyway, raising PoolExhaustedError."""
    coordinator = _coordinator_of(self.scheduler)
    if coordinator is None or not self.queue:
        return original(self, rids_to_check)
    candidates = [entry.req for entry in self.queue if rids_to_check is None or entry.req.rid in rids_to_check]
    admissible = _admissible_rids(coordinator, candidates, compat.req_kv_allocated_len, "transferred", "admission")
    return original(self, admissible)


def _admissible_rids(coordinator, candidates, kv_len, kind: str, before: str) -> list:
    """The rids of the longest queue-order prefix of ``candidates`` whose device pages the
    coordinator can provide now (``kv_len(req)`` tokens each); the first left out is logged."""
    count = coordinator.admissible_now(kv_len(req) for req in candidates)
    if count < len(candidates):
        logger.debug("HiSparse: %s request %s waits for device pages before %s.", kind, candidates[count].rid, before)
    return [req.rid for req in candidates[:count]]


def _decode_capacity(scheduler) -> int | None:
    """Logical-pool request capacity of a PD decode scheduler with hisparse-sglang, else None."""
    if getattr(scheduler.server_args, "disaggregation_mode", "null") != "decode":
        return None
    coordinator = _coordinator_of(scheduler)
    if coordinator is None:
        return None
    from sglang.srt.runtime_context import get_disagg

    from hisparse_sglang.integration.sglang import limits

    return limits.decode_request_capacity(coordinator, get_disagg().num_reserved_decode_tokens)


def _runtime_of(sglang_object):
    """:func:`runtime.runtime_of`, imported in the process that runs the hook."""
    from hisparse_sglang.integration.sglang.runtime import runtime_of

    return runtime_of(sglang_object)


def _coordinator_of(sglang_object):
    """The started coordinator of the runtime behind ``sglang_object`` (:func:`runtime.runtime_of`), else None."""
    runtime = _runtime_of(sglang_object)
    return runtime.coordinator if runtime is not None else None


# ---------------------------------------------------------------------------------------------------
_CORE_HOOKS: tuple[HookSpec, ...] = (
    HookSpec(
        "sglang.srt.arg_groups.hisparse_hook.validate_hisparse", "REPLACE", lambda: _validate_hisparse,
        why="reject unsupported setups and bad --hisparse-config before model load, with typed errors naming the fix",
        upstream="a validation extension point for sparse-attention plugins",
        scheduler_only=False,
    ),
    HookSpec(
        "sglang.srt.mem_cache.sparsity.factory.parse_hisparse_config", "REPLACE", lambda: _parse_hisparse_config,
        why="one strict parse of --hisparse-config, with the model's index_topk, for SGLang and the coordinator "
        "(SGLang's accepts unknown keys and unchecked ratios, and takes top_k 2048 whatever the model's index_topk)",
        upstream="config parsing delegated to the sparse backend",
        scheduler_only=False,
    ),
    HookSpec(
        "sglang.srt.mem_cache.hisparse_memory_pool.HiSparseDSATokenToKVPool", "REPLACE", _pool_class,
        why="KV reads and writes must go through HiSparse's location -> device-row table",
        upstream="a pool factory hook in KVCacheConfigurator._build_dsa_kv_pool",
    ),
    HookSpec(
        "sglang.srt.mem_cache.allocator.hisparse.HiSparseTokenToKVPoolAllocator", "REPLACE", _allocator_class,
        why="logical locations are host rows; device rows follow resident requests and are reclaimed by demotion",
        upstream="an allocator factory hook in KVCacheConfigurator._build_token_to_kv_pool_allocator",
    ),
    HookSpec(
        "sglang.srt.model_executor.model_runner.ModelRunner.maybe_init_hisparse_coordinator", "REPLACE",
        lambda: _maybe_init_hisparse_coordinator,
        why="install hisparse-sglang's coordinator where SGLang creates its own",
        upstream="a coordinator factory keyed by the sparse backend",
    ),
    HookSpec(
        "sglang.srt.managers.schedule_batch.ScheduleBatch.check_decode_mem", "AROUND", lambda: _check_decode_mem,
        why="offloaded requests need no device rows for new tokens; counting them retracts requests needlessly",
        upstream="an allocator method for decode-step capacity",
    ),
    HookSpec(
        "sglang.srt.mem_cache.common.release_kv_cache", "BEFORE", lambda: _release_kv_cache_before,
        why="SGLang 0.5.17 releases some requests without request_finished (PD waiting-queue abort), leaking buffers",
        upstream="call request_finished on every release path (fixed in 0.5.23 for PD abort)",
    ),
    HookSpec(
        "sglang.srt.managers.scheduler.Scheduler.abort_request", "AFTER", lambda: _abort_request_after,
        why="SGLang 0.5.17 does not abort requests that are staging (scheduler.py TODO)",
        upstream="abort_request walking the coordinator's staging queue",
    ),
    HookSpec(
        "sglang.srt.disaggregation.decode.alloc_for_decode_prealloc_hisparse", "AFTER",
        lambda: _alloc_for_decode_prealloc_after,
        why="PD decode asks the host pool for rows before writing req_to_token; host rows are the logical locations",
        upstream="pass the preallocated locations to alloc_paged_token_slots",
    ),
    HookSpec(
        "sglang.srt.distributed.device_communicators.mooncake_transfer_engine.MooncakeTransferEngine.batch_register",
        "AFTER", lambda: _batch_register_after,
        why="MooncakeKVManager.register_buffer_to_engine ignores the code: an unregistered host pool failed every "
        "transfer later instead of the startup",
        upstream="register_buffer_to_engine raising when batch_register returns non-zero",
    ),
    HookSpec(
        "sglang.srt.managers.schedule_batch.Req.load_kv_cache", "AFTER", lambda: _load_kv_cache_after,
        why="PD decode resumes retracted requests without admit_request_direct; HiSparse must admit them",
        upstream="resume_retracted_reqs calling the coordinator's admit_request_direct",
    ),
    HookSpec(
        "sglang.srt.managers.tp_worker.TpModelWorker.get_worker_info", "AFTER", lambda: _get_worker_info_after,
        why="max_req_len / max_req_input_len come from the device pool; a HiSparse PD decode instance holds "
        "requests in the logical (host) pool (SGLang issue #30401)",
        upstream="request-length limits from the allocator's logical capacity (PRs #24764, #33876, #28753)",
    ),
    HookSpec(
        "sglang.srt.managers.scheduler.Scheduler.init_req_max_new_tokens", "AROUND",
        lambda: _init_req_max_new_tokens,
        why="clamps max_new_tokens by the device pool: a PD decode request longer than it gets 0 new tokens",
        upstream="the clamp using the decode instance's logical capacity (SGLang issue #30401)",
    ),
    HookSpec(
        "sglang.srt.managers.scheduler.Scheduler._add_request_to_queue", "BEFORE", lambda: _add_request_to_queue_before,
        why="the rejection of a prompt longer than a KV pool does not say which pool or how to admit it",
        upstream="a rejection message naming the limiting pool",
    ),
    HookSpec(
        "sglang.srt.disaggregation.decode.DecodePreallocQueue.__init__", "AFTER",
        lambda: _decode_prealloc_queue_init_after,
        why="_check_if_req_exceed_kv_capacity rejects new and retracted requests longer than the device pool",
        upstream="the capacity check using the logical pool under HiSparse (done in 0.5.18: max_token_pool_size)",
        versions=">=0.5.17,<0.5.18",
    ),
    HookSpec(
        "sglang.srt.disaggregation.decode.DecodePreallocQueue.resume_retracted_reqs", "AROUND",
        lambda: _resume_retracted_reqs,
        why="resumes on the logical budget alone; admitting a resumed request without device pages crashed",
        upstream="resume_retracted_reqs checking the HiSparse device budget, as pop_preallocated does",
    ),
    HookSpec(
        "sglang.srt.disaggregation.decode.DecodeTransferQueue.pop_transferred", "AROUND", lambda: _pop_transferred,
        why="transferred requests are admitted without a device check; resident requests may have taken the pages",
        upstream="admission of transferred requests deferred while the HiSparse device budget is short",
    ),
    HookSpec(
        "sglang.srt.managers.scheduler_components.metrics_reporter.SchedulerMetricsReporter.report_decode_stats",
        "AFTER", lambda: _report_decode_stats_after,
        why="log hit rate, bytes moved and modes with every decode log line; Prometheus metrics with --enable-metrics",
        upstream="a metrics extension point for the sparse coordinator",
    ),
)


# Every hook, in registry order: the core ones above, then the speculative verify step of 0.5.17 - 0.5.21
# (hooks_speculative.py, docs/speculative.md 2.7).
HOOKS: tuple[HookSpec, ...] = (*_CORE_HOOKS, *SPECULATIVE_HOOKS)


# On an SGLang outside the supported range only this guard is registered (main process).
UNSUPPORTED_SGLANG_GUARD = HookSpec(
    "sglang.srt.arg_groups.hisparse_hook.validate_hisparse", "REPLACE", lambda: _refuse_unsupported_sglang,
    why="an SGLang outside the supported range must not run --enable-hisparse half-hooked",
    upstream="plugins declaring the SGLang versions they support",
    scheduler_only=False,
    versions="",  # any release
)


def specs_for(role: str, sglang_version: str) -> list[HookSpec]:
    """The hooks a process of ``role`` (``compat.process_role``) registers under ``sglang_version``."""
    if role == "light":
        return []
    if not compat.is_supported(sglang_version):
        return [UNSUPPORTED_SGLANG_GUARD] if role == "main" else []
    return [
        spec for spec in HOOKS if spec.applies_to(sglang_version) and (role == "scheduler" or not spec.scheduler_only)
    ]


def register_all(role: str, sglang_version: str) -> list[str]:
    """Register the hooks of :func:`specs_for` with SGLang's HookRegistry; returns their targets."""
    specs = specs_for(role, sglang_version)
    if not specs:
        return []
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for spec in specs:
        HookRegistry.register(spec.target, spec.factory(), getattr(HookType, spec.hook_type))
    return [spec.target for spec in specs]
