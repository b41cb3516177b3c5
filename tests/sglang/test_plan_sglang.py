"""hisparse-plan's GPU pool arithmetic against SGLang's own sizing code, on the CPU: SGLang's
DefaultPoolConfigurator (the bytes per token of a DSA model's KV pool, with and without HiSparse's indexer
keys for the logical pool) and its default request slots, for the tiny models' real ModelConfig; and the
plan's PD decode limit against limits.decode_request_capacity on the coordinator built from SGLang's pools."""

from __future__ import annotations

import types
from pathlib import Path

import drive
import pytest
import torch

from hisparse_sglang import plan
from hisparse_sglang.integration.sglang import limits

pytestmark = pytest.mark.sglang

REPO = Path(__file__).resolve().parents[2]
MODELS = [REPO / "benchmarks" / "models" / name for name in ("tiny-dsv32", "tiny-glm5")]
KV_DTYPES = {
    "bf16": (torch.bfloat16, "bfloat16", "flashmla_sparse"),
    "fp8": (torch.float8_e4m3fn, "fp8_e4m3", "flashmla_kv"),
}


def sglang_configurator(model_dir: Path, kv_dtype: str, ratio: int | None, spec_algorithm=None, draft_layers=0):
    """SGLang's pool configurator for the model, the KV dtype and (ratio not None) --enable-hisparse; with a
    ``spec_algorithm`` (EAGLE) the target's, its draft of ``draft_layers`` NextN layers."""
    from sglang.srt import runtime_context
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_executor.pool_configurator import DefaultPoolConfigurator
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    dtype, name, backend = KV_DTYPES[kv_dtype]
    values = {"kv_cache_dtype": name, "dsa_prefill_backend": backend, "dsa_decode_backend": backend,
              "enable_hisparse": ratio is not None}
    if ratio is not None:
        values["hisparse_config"] = f'{{"host_to_device_ratio": {ratio}}}'
    server_args = drive.unresolved_server_args(**values)
    runtime_context.publish(server_args, role="scheduler")
    model_config = ModelConfig(str(model_dir))
    layers = model_config.num_hidden_layers
    # What SGLang's KVCacheConfigurator hands its pool configurator, for one rank of a TP-1 server.
    kv_cache_configurator = types.SimpleNamespace(
        kv_cache_dtype_str=name, kv_cache_dtype=dtype, model_config=model_config, server_args=server_args,
        use_mla_backend=True,
        layer_info=types.SimpleNamespace(num_effective_layers=layers, start_layer=0, end_layer=layers),
        spec_algorithm=spec_algorithm or SpeculativeAlgorithm.NONE, is_draft_worker=False,
        spec_aux_config=types.SimpleNamespace(eagle_draft_num_layers=draft_layers),
        fused_entry_bytes=lambda kind: None,  # 0.5.23's EAGLE budget asks it first (None: no fused pool entry)
        ps=types.SimpleNamespace(pp_size=1, attn_dp_size=1),
        mambaish_config=None, attn_dp_size=1,
    )
    with get_parallel().override(attn_tp_size=1):
        return DefaultPoolConfigurator(kv_cache_configurator), kv_cache_configurator


@pytest.fixture(autouse=True)
def reset_published_config():
    from sglang.srt import runtime_context

    yield
    runtime_context.reset_context()


@pytest.mark.parametrize("model_dir", MODELS, ids=lambda path: path.name)
@pytest.mark.parametrize("kv_dtype", sorted(KV_DTYPES))
@pytest.mark.parametrize("ratio", [None, 1, 8, 13])
def test_bytes_per_token_and_pool_size_equal_sglangs(model_dir, kv_dtype, ratio):
    configurator, _ = sglang_configurator(model_dir, kv_dtype, ratio)
    shape = plan.model_shape(str(model_dir))
    assert plan.bytes_per_device_token(shape, kv_dtype, ratio or 1) == configurator._cell_size
    for budget_gib in (0.5, 7.3, 61.25):
        spec = plan.PlanInput(model=shape, gpu_mem_gib=budget_gib, host_mem_gib=10_000, tp=1, kv_dtype=kv_dtype,
                              mem_fraction_static=1.0, weights_gib=0.0,
                              hisparse_config=f'{{"host_to_device_ratio": {ratio or 1}}}')
        result = plan.plan(spec)
        expected = configurator.calculate_pool_sizes(int(budget_gib * 2**30), 64).max_total_num_tokens
        assert (result.device_tokens_with if ratio else result.device_tokens_without) == expected


@pytest.mark.parametrize("tokens, context, requested", [(131072, 65536, None), (40960, 65536, None),
                                                        (2_000_000, 163840, None), (131072, 65536, 64)])
def test_request_slots_equal_sglangs_default(tokens, context, requested):
    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator

    _, kv_cache_configurator = sglang_configurator(MODELS[0], "bf16", 8)
    kv_cache_configurator.model_config = types.SimpleNamespace(context_len=context)
    from sglang.srt import runtime_context

    runtime_context.publish(drive.unresolved_server_args(max_running_requests=requested), role="scheduler")
    expected = KVCacheConfigurator.resolve_max_num_reqs(kv_cache_configurator, tokens)
    assert plan._request_slots(tokens, context, requested, dp=1) == expected


@pytest.mark.parametrize("reserved", [0, 512, 8000])
def test_pd_decode_longest_request_equals_the_coordinators_limit(reserved):
    from test_coordinator_sglang import PAGE, Stack, publish_server_args

    publish_server_args()
    stack = Stack(device_tokens=PAGE * 40, ratio=4, buffer_size=256, top_k=128)
    capacity = limits.decode_request_capacity(stack.coordinator, reserved)
    shape = plan.ModelShape("stack", layers=2, kv_lora_rank=512, qk_rope_head_dim=64, index_topk=128,
                            index_head_dim=128, context_length=1 << 20)
    result = plan.plan(plan.PlanInput(
        model=shape, gpu_mem_gib=80, host_mem_gib=100, tp=1, max_total_tokens=PAGE * 40, weights_gib=None,
        hisparse_config='{"host_to_device_ratio": 4, "device_buffer_size": 256}', pd_decode=True,
        num_reserved_decode_tokens=reserved, prompt_len=100, output_len=10,
    ))
    assert result.longest_request_with == capacity
    assert result.logical_tokens == stack.allocator.rows.logical.capacity_rows
    assert result.host_rows == stack.allocator.rows.num_locs


@pytest.mark.parametrize("model_dir", MODELS, ids=lambda path: path.name)
@pytest.mark.parametrize("kv_dtype", sorted(KV_DTYPES))
@pytest.mark.parametrize("ratio", [1, 8])
def test_bytes_per_token_with_mtp_equal_sglangs_budget_with_the_draft_hook(model_dir, kv_dtype, ratio):
    """With EAGLE / NextN MTP SGLang's configurator counts the draft layer beside the target's, and on 0.5.17 -
    0.5.21 the plugin's H8 (limits.count_draft_kv_at_logical_size) adds what the draft pool over the logical
    space needs beyond it (0.5.22+ count it themselves): the plan's bytes per device token and pool size are
    that budget."""
    import dataclasses

    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from hisparse_sglang.integration.sglang import compat

    configurator, kvc = sglang_configurator(model_dir, kv_dtype, ratio, SpeculativeAlgorithm.EAGLE, draft_layers=1)
    assert compat.hisparse_enabled()
    if compat.speculative_verify_is_hooked():  # H8 (0.5.17 - 0.5.21), as the hook runs it after __init__
        limits.count_draft_kv_at_logical_size(configurator, kvc)
    # the tiny models' config.json has no NextN layer; the e2e harness serves them with one (as here)
    shape = dataclasses.replace(plan.model_shape(str(model_dir)), nextn_layers=1)
    spec = plan.PlanInput(model=shape, gpu_mem_gib=7.3, host_mem_gib=10_000, tp=1, kv_dtype=kv_dtype,
                          mem_fraction_static=1.0, weights_gib=0.0, speculative_num_draft_tokens=4,
                          hisparse_config=f'{{"host_to_device_ratio": {ratio}}}')
    result = plan.plan(spec)
    assert result.bytes_per_token_with == configurator._cell_size
    expected = configurator.calculate_pool_sizes(int(7.3 * 2**30), 64).max_total_num_tokens
    assert result.device_tokens_with == expected
    # the host pool holds the target's layers only: the draft's KV stays on the GPU (docs/speculative.md 2.6)
    plain = plan.plan(dataclasses.replace(spec, speculative_num_draft_tokens=1))
    assert result.host_pool_gib / result.host_rows == pytest.approx(plain.host_pool_gib / plain.host_rows)
