"""The registry of the hooks hisparse-sglang installs into SGLang: every spec, in one place.

Every spec names its target (a dotted path that must exist in the installed SGLang), the SGLang
releases it applies to (a PEP 440 specifier within ``compat.SUPPORTED_SGLANG``), the release it was
written against, why it is needed and what upstream change would make it unnecessary. The bodies
are grouped by area in their own modules: ``hooks_startup`` (server arguments, the pool, allocator
and coordinator SGLang builds, worker info), ``hooks_scheduler`` (the scheduler's own paths),
``hooks_pd`` (the PD decode side), ``hooks_metrics`` and ``hooks_speculative`` (H1 - H9, the
speculative verify step of 0.5.17 - 0.5.21). ``tests/sglang/test_hooks.py`` checks that the target
of every spec covering the installed release resolves and that SGLang's ``load_plugins()`` applies
each of them; ``tests/sglang/test_hook_table.py`` that the table of ``docs/sglang-versions.md``
(which says what differs between the releases) is this registry's.

Importing this module imports no sglang: the bodies import it when they run, and
:func:`register_all` imports SGLang's HookRegistry.
"""

from __future__ import annotations

from hisparse_sglang.integration.sglang import compat
from hisparse_sglang.integration.sglang.hook_spec import HookSpec
from hisparse_sglang.integration.sglang.hooks_metrics import _report_decode_stats_after
from hisparse_sglang.integration.sglang.hooks_pd import (
    _alloc_for_decode_prealloc_after,
    _batch_register_after,
    _decode_prealloc_queue_init_after,
    _init_req_max_new_tokens,
    _load_kv_cache_after,
    _pop_transferred,
    _resume_retracted_reqs,
)
from hisparse_sglang.integration.sglang.hooks_scheduler import (
    _abort_request_after,
    _add_request_to_queue_before,
    _check_decode_mem,
    _release_kv_cache_before,
)
from hisparse_sglang.integration.sglang.hooks_speculative import (
    _alloc_for_spec_decode,
    _build_dsa_kv_pool,
    _build_hisparse_decode_batch,
    _capture_one_shape,
    _default_pool_configurator_init_after,
    _derive_pool_sizes_after,
    _eagle_prepare_for_verify_after,
    _eagle_sample_after,
    _forward_extend,
    _get_indexer_metadata_after,
    _resolve_lora_variant_after,
    _run_eagle_verify_after,
)
from hisparse_sglang.integration.sglang.hooks_startup import (
    _allocator_class,
    _get_worker_info_after,
    _maybe_init_hisparse_coordinator,
    _parse_hisparse_config,
    _pool_class,
    _refuse_unsupported_sglang,
    _validate_hisparse,
)

# written_against: every hook so far was written from SGLang 0.5.17's source (0.5.17 was the only release
# supported, or the development environment, when each was written; H1 - H9 were read against the unpacked
# 0.5.17 wheel, docs/speculative.md 2.7). Two were written after the range widened to 0.5.17 - 0.5.23 without
# their commits naming a release (_add_request_to_queue, the unsupported-release guard): they carry 0.5.17, the
# release every target was checked in on GPU and CPU (docs/sglang-versions.md, "How it was checked").
_HOOKED = compat.SPECULATIVE_HOOKED_SGLANG
_ATTENTION = "sglang.srt.layers.attention.dsa_backend.DeepseekSparseAttnBackend"
_CONFIGURATOR = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator"
_GRAPH_RUNNER = "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner"

# Every hook, in registry order: the core ones, then the speculative verify step of 0.5.17 - 0.5.21
# (hooks_speculative.py, docs/speculative.md 2.7).
HOOKS: tuple[HookSpec, ...] = (
    # startup: hooks_startup.py
    HookSpec(
        "sglang.srt.arg_groups.hisparse_hook.validate_hisparse", "REPLACE", lambda: _validate_hisparse,
        why="reject unsupported setups and bad --hisparse-config before model load, with typed errors naming the fix",
        upstream="a validation extension point for sparse-attention plugins",
        written_against="0.5.17",
        scheduler_only=False,
    ),
    HookSpec(
        "sglang.srt.mem_cache.sparsity.factory.parse_hisparse_config", "REPLACE", lambda: _parse_hisparse_config,
        why="one strict parse of --hisparse-config, with the model's index_topk, for SGLang and the coordinator "
        "(SGLang's accepts unknown keys and unchecked ratios, and takes top_k 2048 whatever the model's index_topk)",
        upstream="config parsing delegated to the sparse backend",
        written_against="0.5.17",
        scheduler_only=False,
    ),
    HookSpec(
        "sglang.srt.mem_cache.hisparse_memory_pool.HiSparseDSATokenToKVPool", "REPLACE", _pool_class,
        why="KV reads and writes must go through HiSparse's location -> device-row table",
        upstream="a pool factory hook in KVCacheConfigurator._build_dsa_kv_pool",
        written_against="0.5.17",
    ),
    HookSpec(
        "sglang.srt.mem_cache.allocator.hisparse.HiSparseTokenToKVPoolAllocator", "REPLACE", _allocator_class,
        why="logical locations are host rows; device rows follow resident requests and are reclaimed by demotion",
        upstream="an allocator factory hook in KVCacheConfigurator._build_token_to_kv_pool_allocator",
        written_against="0.5.17",
    ),
    HookSpec(
        "sglang.srt.model_executor.model_runner.ModelRunner.maybe_init_hisparse_coordinator", "REPLACE",
        lambda: _maybe_init_hisparse_coordinator,
        why="install hisparse-sglang's coordinator where SGLang creates its own",
        upstream="a coordinator factory keyed by the sparse backend",
        written_against="0.5.17",
    ),
    # the scheduler's paths: hooks_scheduler.py
    HookSpec(
        "sglang.srt.managers.schedule_batch.ScheduleBatch.check_decode_mem", "AROUND", lambda: _check_decode_mem,
        why="offloaded requests need no device rows for new tokens; counting them retracts requests needlessly",
        upstream="an allocator method for decode-step capacity",
        written_against="0.5.17",
    ),
    HookSpec(
        "sglang.srt.mem_cache.common.release_kv_cache", "BEFORE", lambda: _release_kv_cache_before,
        why="SGLang 0.5.17 releases some requests without request_finished (PD waiting-queue abort), leaking buffers",
        upstream="call request_finished on every release path (fixed in 0.5.23 for PD abort)",
        written_against="0.5.17",
    ),
    HookSpec(
        "sglang.srt.managers.scheduler.Scheduler.abort_request", "AFTER", lambda: _abort_request_after,
        why="SGLang 0.5.17 does not abort requests that are staging (scheduler.py TODO)",
        upstream="abort_request walking the coordinator's staging queue",
        written_against="0.5.17",
    ),
    # PD decode: hooks_pd.py
    HookSpec(
        "sglang.srt.disaggregation.decode.alloc_for_decode_prealloc_hisparse", "AFTER",
        lambda: _alloc_for_decode_prealloc_after,
        why="PD decode asks the host pool for rows before writing req_to_token; host rows are the logical locations",
        upstream="pass the preallocated locations to alloc_paged_token_slots",
        written_against="0.5.17",
    ),
    HookSpec(
        "sglang.srt.distributed.device_communicators.mooncake_transfer_engine.MooncakeTransferEngine.batch_register",
        "AFTER", lambda: _batch_register_after,
        why="MooncakeKVManager.register_buffer_to_engine ignores the code: an unregistered host pool failed every "
        "transfer later instead of the startup",
        upstream="register_buffer_to_engine raising when batch_register returns non-zero",
        written_against="0.5.17",
    ),
    HookSpec(
        "sglang.srt.managers.schedule_batch.Req.load_kv_cache", "AFTER", lambda: _load_kv_cache_after,
        why="PD decode resumes retracted requests without admit_request_direct; HiSparse must admit them",
        upstream="resume_retracted_reqs calling the coordinator's admit_request_direct",
        written_against="0.5.17",
    ),
    # startup: hooks_startup.py
    HookSpec(
        "sglang.srt.managers.tp_worker.TpModelWorker.get_worker_info", "AFTER", lambda: _get_worker_info_after,
        why="max_req_len / max_req_input_len come from the device pool; a HiSparse PD decode instance holds "
        "requests in the logical (host) pool (SGLang issue #30401)",
        upstream="request-length limits from the allocator's logical capacity (PRs #24764, #33876, #28753)",
        written_against="0.5.17",
    ),
    # PD decode: hooks_pd.py
    HookSpec(
        "sglang.srt.managers.scheduler.Scheduler.init_req_max_new_tokens", "AROUND",
        lambda: _init_req_max_new_tokens,
        why="clamps max_new_tokens by the device pool: a PD decode request longer than it gets 0 new tokens",
        upstream="the clamp using the decode instance's logical capacity (SGLang issue #30401)",
        written_against="0.5.17",
    ),
    # the scheduler's paths: hooks_scheduler.py
    HookSpec(
        "sglang.srt.managers.scheduler.Scheduler._add_request_to_queue", "BEFORE", lambda: _add_request_to_queue_before,
        why="the rejection of a prompt longer than a KV pool does not say which pool or how to admit it",
        upstream="a rejection message naming the limiting pool",
        written_against="0.5.17",
    ),
    # PD decode: hooks_pd.py
    HookSpec(
        "sglang.srt.disaggregation.decode.DecodePreallocQueue.__init__", "AFTER",
        lambda: _decode_prealloc_queue_init_after,
        why="_check_if_req_exceed_kv_capacity rejects new and retracted requests longer than the device pool",
        upstream="the capacity check using the logical pool under HiSparse (done in 0.5.18: max_token_pool_size)",
        written_against="0.5.17",
        versions=">=0.5.17,<0.5.18",
    ),
    HookSpec(
        "sglang.srt.disaggregation.decode.DecodePreallocQueue.resume_retracted_reqs", "AROUND",
        lambda: _resume_retracted_reqs,
        why="resumes on the logical budget alone; admitting a resumed request without device pages crashed",
        upstream="resume_retracted_reqs checking the HiSparse device budget, as pop_preallocated does",
        written_against="0.5.17",
    ),
    HookSpec(
        "sglang.srt.disaggregation.decode.DecodeTransferQueue.pop_transferred", "AROUND", lambda: _pop_transferred,
        why="transferred requests are admitted without a device check; resident requests may have taken the pages",
        upstream="admission of transferred requests deferred while the HiSparse device budget is short",
        written_against="0.5.17",
    ),
    # metrics: hooks_metrics.py
    HookSpec(
        "sglang.srt.managers.scheduler_components.metrics_reporter.SchedulerMetricsReporter.report_decode_stats",
        "AFTER", lambda: _report_decode_stats_after,
        why="log hit rate, bytes moved and modes with every decode log line; Prometheus metrics with --enable-metrics",
        upstream="a metrics extension point for the sparse coordinator",
        written_against="0.5.17",
    ),
    # the speculative verify step of 0.5.17 - 0.5.21 (H1 - H9), and H10 on every release: hooks_speculative.py
    HookSpec(
        "sglang.srt.mem_cache.allocation.alloc_for_spec_decode", "AROUND", lambda: _alloc_for_spec_decode,
        why="H1: the speculative reserve comes from alloc_extend, which gives offloaded requests device pages the "
        "verify binding would orphan",
        upstream="done in 0.5.22 (alloc_logical_only under HiSparse)", versions=_HOOKED,
        written_against="0.5.17",
    ),
    HookSpec(
        "sglang.srt.speculative.eagle_utils.eagle_prepare_for_verify", "AFTER", lambda: _eagle_prepare_for_verify_after,
        why="H2: no coordinator call binds the verify locations",
        upstream="0.5.22 prepare_spec_verify(batch)", versions=_HOOKED,
        written_against="0.5.17",
    ),
    HookSpec(
        "sglang.srt.speculative.eagle_worker_common.run_eagle_verify", "AFTER", lambda: _run_eagle_verify_after,
        why="H3: no coordinator call after acceptance; the accepted tokens' KV must reach the host",
        upstream="0.5.22 commit_spec_accept_tokens", versions=_HOOKED,
        written_against="0.5.17",
    ),
    HookSpec(
        "sglang.srt.speculative.eagle_worker_common.eagle_sample", "AFTER", lambda: _eagle_sample_after,
        why="H10: a verify position whose top-k the buffer could not hold with the earlier positions' is left "
        "out by the swap-in; the step must not accept it",
        upstream="a coordinator call between sampling and the accept lengths' use (none in any release)",
        written_against="0.5.17",
    ),
    HookSpec(
        f"{_ATTENTION}.forward_extend", "AROUND", lambda: _forward_extend,
        why="H4: the verify translates locations (row 0 for an offloaded request's history) instead of swapping in",
        upstream="0.5.22 3-D swap_in_selected_pages in TARGET_VERIFY", versions=_HOOKED,
        written_against="0.5.17",
    ),
    HookSpec(
        f"{_ATTENTION}.get_indexer_metadata", "AFTER", lambda: _get_indexer_metadata_after,
        why="H5: the verify's fused top-k yields locations; H4's swap-in needs positions (or device rows)",
        upstream="0.5.22 forces the unfused top-k for TARGET_VERIFY", versions=_HOOKED,
        written_against="0.5.17",
    ),
    HookSpec(
        f"{_CONFIGURATOR}._build_dsa_kv_pool", "AROUND", lambda: _build_dsa_kv_pool,
        why="H6: the draft runner would build a HiSparse pool (a second HiSparse runtime, no location table)",
        upstream="0.5.22 builds the HiSparse pool only when not is_draft_worker", versions=_HOOKED,
        written_against="0.5.17",
    ),
    HookSpec(
        f"{_CONFIGURATOR}._derive_pool_sizes", "AFTER", lambda: _derive_pool_sizes_after,
        why="H7: the draft pool has the device size but is indexed by logical locations",
        upstream="0.5.22 sizes it by the HiSparse allocator's size_full", versions=_HOOKED,
        written_against="0.5.17",
    ),
    HookSpec(
        "sglang.srt.model_executor.pool_configurator.DefaultPoolConfigurator.__init__", "AFTER",
        lambda: _default_pool_configurator_init_after,
        why="H8: the memory budget counts the draft layers' KV at the device size, not the logical size",
        upstream="0.5.22 draft_loc_space_scale", versions=_HOOKED,
        written_against="0.5.17",
    ),
    HookSpec(
        "sglang.srt.managers.scheduler.Scheduler._build_hisparse_decode_batch", "AROUND",
        lambda: _build_hisparse_decode_batch,
        why="H9: a request leaving staging would enter decode without its draft state, and its bonus-only "
            "stash fails in FutureMap.stash under speculation",
        upstream="0.5.22 future_map.make_staged_spec_input", versions=_HOOKED,
        written_against="0.5.17",
    ),
    HookSpec(
        f"{_GRAPH_RUNNER}.capture_one_shape", "AROUND", lambda: _capture_one_shape,
        why="H11: every verify graph holds the swap-in's launches, which a step of resident requests only (the "
            "fused top-k gives their device rows) does not need; a second graph per shape leaves them out",
        upstream="none: 0.5.22+ runs the unfused top-k in TARGET_VERIFY, whose positions every request's swap-in "
            "translates", versions=_HOOKED,
        written_against="0.5.17",
    ),
    HookSpec(
        f"{_GRAPH_RUNNER}._resolve_lora_variant", "AFTER", lambda: _resolve_lora_variant_after,
        why="H12: a verify step whose requests are all resident replays H11's graph",
        upstream="none (H11's)", versions=_HOOKED,
        written_against="0.5.17",
    ),
)


# On an SGLang outside the supported range only this guard is registered (main process).
UNSUPPORTED_SGLANG_GUARD = HookSpec(
    "sglang.srt.arg_groups.hisparse_hook.validate_hisparse", "REPLACE", lambda: _refuse_unsupported_sglang,
    why="an SGLang outside the supported range must not run --enable-hisparse half-hooked",
    upstream="plugins declaring the SGLang versions they support",
    written_against="0.5.17",
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
