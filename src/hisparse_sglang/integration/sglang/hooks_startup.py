"""Hook bodies for startup (``hooks.HOOKS`` declares them): server-argument validation and the
--hisparse-config parse in the main process, the classes SGLang builds for the KV pool and its
allocator, the coordinator the model runner starts, and the request-length limits of the worker info.

Imports of sglang and of the adapters happen lazily, in the process that runs the hook.
"""

from __future__ import annotations

import logging

from hisparse_sglang.errors import UnsupportedSetupError, UnsupportedSGLangError
from hisparse_sglang.integration.sglang import compat
from hisparse_sglang.integration.sglang.hook_lookup import runtime_of

logger = logging.getLogger(__name__)


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
    runtime = runtime_of(self.token_to_kv_pool_allocator)
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


def _get_worker_info_after(result, self):
    """AFTER TpModelWorker.get_worker_info: on a PD decode instance the request-length limits
    (items 4 and 5: max_req_len, max_req_input_len) come from the logical pool, not the device
    pool (item 0, kept: SGLang's invariant checks and metrics read it). Logs the limit once and
    records it for the rejection message (both modes). The arithmetic is limits'."""
    runtime = runtime_of(self.model_runner)
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
