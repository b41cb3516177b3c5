"""Startup validation through the hook that replaces SGLang's validate_hisparse (main process)."""

import pathlib
import types

import pytest

from hisparse_sglang.errors import HiSparseConfigError, UnsupportedSetupError

pytestmark = pytest.mark.sglang


def server_args(architecture="DeepseekV32ForCausalLM", index_topk=2048, hf_config=None, **overrides):
    hf_config = hf_config or types.SimpleNamespace(architectures=[architecture], index_topk=index_topk)
    values = dict(
        enable_hisparse=True,
        hisparse_config='{"top_k": 2048, "device_buffer_size": 4096, "host_to_device_ratio": 10}',
        disable_radix_cache=True,
        disaggregation_mode="null",
        speculative_algorithm=None,
        pp_size=1,
        enable_mixed_chunk=False,
        kv_cache_dtype="bfloat16",
        dsa_decode_backend="flashmla_sparse",
        dsa_prefill_backend="flashmla_sparse",
        page_size=64,
    )
    values.update(overrides)
    args = types.SimpleNamespace(**values)
    # How SGLang's validate_hisparse reaches the model: get_model_config() up to 0.5.18; from 0.5.19
    # model_config_of(), which hands back a ModelConfig a fixture stored on the record. A text-only
    # model's hf_text_config is its hf_config.
    model_config = types.SimpleNamespace(hf_config=hf_config, hf_text_config=hf_config)
    args.get_model_config = lambda: model_config
    args._model_config = model_config
    return args


def validate(args):
    from hisparse_sglang.integration.sglang.hooks import _validate_hisparse

    _validate_hisparse(args)


def test_supported_setups_pass():
    validate(server_args())
    validate(server_args(kv_cache_dtype="fp8_e4m3", dsa_decode_backend="flashmla_kv", dsa_prefill_backend="flashmla_kv"))
    validate(server_args(kv_cache_dtype="auto", dsa_decode_backend=None, dsa_prefill_backend=None))
    validate(server_args(disaggregation_mode="decode"))
    validate(server_args(hisparse_config=None))
    validate(server_args(speculative_algorithm="NONE", disaggregation_decode_retraction_backup="cpu_tensor"))


def test_disabled_hisparse_is_not_checked():
    validate(server_args(enable_hisparse=False, architecture="LlamaForCausalLM", disable_radix_cache=False))


CASES = [
    (dict(architecture="LlamaForCausalLM"), UnsupportedSetupError, "LlamaForCausalLM is not one"),
    (dict(architecture="DeepseekV4ForCausalLM"), UnsupportedSetupError, "not DeepSeek-V4"),
    (dict(disable_radix_cache=False), UnsupportedSetupError, "--disable-radix-cache"),
    (dict(disaggregation_mode="prefill"), UnsupportedSetupError, "remove it from the prefill instance"),
    (dict(architecture="MiniMaxM3SparseForCausalLM"), UnsupportedSetupError, "not MiniMax-M3"),
    (dict(dcp_size=2), UnsupportedSetupError, "--dcp-size 2"),
    (dict(disaggregation_decode_retraction_backup="host_pool"), UnsupportedSetupError, "cpu_tensor"),
    (dict(kv_cache_dtype="fp8_e4m3", dsa_decode_backend="flashinfer_sparse_mla", dsa_prefill_backend="flashmla_kv"),
     UnsupportedSetupError, "--dsa-decode-backend flashmla_kv, got 'flashinfer_sparse_mla'"),
    (dict(pp_size=2), UnsupportedSetupError, "--pp-size 2"),
    (dict(enable_mixed_chunk=True), UnsupportedSetupError, "--enable-mixed-chunk"),
    (dict(kv_cache_dtype="fp8_e5m2"), UnsupportedSetupError, "'fp8_e5m2'"),
    (dict(dsa_decode_backend="flashmla_kv"), UnsupportedSetupError, "--dsa-decode-backend flashmla_sparse"),
    (dict(kv_cache_dtype="fp8_e4m3", dsa_decode_backend="flashmla_sparse", dsa_prefill_backend="flashmla_kv"),
     UnsupportedSetupError, "--dsa-decode-backend flashmla_kv"),
    (dict(dsa_prefill_backend="tilelang"), UnsupportedSetupError, "--dsa-prefill-backend"),
    (dict(hisparse_config="{top_k: 1}"), HiSparseConfigError, "not valid JSON"),
    (dict(hisparse_config='{"top_k": 1024}'), HiSparseConfigError, "index_topk (2048)"),
    (dict(hisparse_config='{"device_buffer_size": 4100}'), HiSparseConfigError, "multiple of page_size"),
    (dict(hisparse_config='{"device_buffer_size": 1000}'), HiSparseConfigError, "must be >= top_k (2048)"),
    (dict(hisparse_config='{"page_size": 32, "device_buffer_size": 4096}'), HiSparseConfigError, "page size (64)"),
    (dict(hisparse_config='{"host_to_device_ration": 10}'), HiSparseConfigError, "host_to_device_ratio"),
]


@pytest.mark.parametrize("overrides,error,fragment", CASES, ids=[str(c[0])[:50] for c in CASES])
def test_unsupported_setups_fail_with_a_fix(overrides, error, fragment):
    with pytest.raises(error) as info:
        validate(server_args(**overrides))
    assert fragment in str(info.value), str(info.value)


def test_parse_hisparse_config_replacement_returns_sglang_sparse_config():
    from sglang.srt.mem_cache.sparsity.core.sparse_coordinator import SparseConfig

    from hisparse_sglang.integration.sglang.hooks import _parse_hisparse_config

    config = _parse_hisparse_config(server_args())
    assert isinstance(config, SparseConfig)
    assert (config.top_k, config.device_buffer_size, config.host_to_device_ratio) == (2048, 4096, 10)
    with pytest.raises(HiSparseConfigError):
        _parse_hisparse_config(server_args(hisparse_config='{"resident_first": "yes"}'))


TINY_MODELS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "models"


@pytest.mark.parametrize("name", ["tiny-dsv32", "tiny-glm5"])
def test_tiny_models_parse_with_sglang_and_are_accepted(name):
    """The shipped tiny configs, read by SGLang's ModelConfig, are DSA models our validation accepts."""
    from sglang.srt.configs.model_config import AttentionArch, ModelConfig

    from hisparse_sglang.integration.sglang import compat

    model_config = ModelConfig(str(TINY_MODELS / name))
    assert model_config.attention_arch == AttentionArch.MLA and model_config.num_hidden_layers == 4
    assert (model_config.kv_lora_rank, model_config.qk_rope_head_dim) == (512, 64)
    assert compat.model_kind(model_config.hf_config) == {
        "dsa": True, "dsv4": False, "minimax_sparse": False, "kda_hybrid": False, "index_kpool": 1
    }
    validate(server_args(hf_config=model_config.hf_config))
    validate(server_args(hf_config=model_config.hf_config, kv_cache_dtype="fp8_e4m3",
                         dsa_decode_backend="flashmla_kv", dsa_prefill_backend="flashmla_kv"))


def test_validation_and_sglangs_sparse_config_take_top_k_from_a_model_whose_index_topk_is_not_2048(tmp_path):
    """No top_k in --hisparse-config: validation (main process) and the SparseConfig SGLang sizes its
    pools by both use the model's index_topk, 512, and its default buffer (1024, not 2048's 4096)."""
    import json

    from sglang.srt.configs.model_config import ModelConfig

    from hisparse_sglang.integration.sglang import compat
    from hisparse_sglang.integration.sglang.hooks import _parse_hisparse_config
    from hisparse_sglang.integration.sglang.validation import validate_server_args

    config = json.loads((TINY_MODELS / "tiny-dsv32" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "index_topk": 512}))
    model_config = ModelConfig(str(tmp_path))
    assert model_config.hf_text_config.index_topk == 512
    for text, buffer in (('{"host_to_device_ratio": 4}', 1024), ('{"device_buffer_size": 512}', 512)):
        args = server_args(hf_config=model_config.hf_config, hisparse_config=text)
        validate(args)
        settings, model = compat.validation_inputs(args)
        validated = validate_server_args(
            settings, model, kv_cache_dtype="bfloat16", **compat.model_kind(model.hf_config)
        )
        sparse = _parse_hisparse_config(args)
        assert (validated.top_k, validated.device_buffer_size) == (512, buffer)
        assert (sparse.top_k, sparse.device_buffer_size) == (512, buffer)
    with pytest.raises(HiSparseConfigError, match=r"differs from the model's index_topk \(512\)"):
        _parse_hisparse_config(server_args(hf_config=model_config.hf_config, hisparse_config='{"top_k": 2048}'))


# Each architecture and the first supported release that serves it as DeepSeek Sparse Attention (read in
# the wheels' is_deepseek_dsa; docs/sglang-versions.md, "Models"), or None for none of them. With an
# index_topk, validation accepts the model exactly from that release on.
DSA_FROM = {
    "DeepseekV3ForCausalLM": "0.5.17", "DeepseekV32ForCausalLM": "0.5.17", "DeepseekV3ForCausalLMNextN": "0.5.17",
    "MistralLarge3ForCausalLM": "0.5.17", "PixtralForConditionalGeneration": "0.5.17",
    "GlmMoeDsaForCausalLM": "0.5.17", "GlmMoeDsaForCausalLMNextN": "0.5.17", "LongcatFlashForCausalLM": "0.5.17",
    "LongcatFlashForCausalLMNextN": "0.5.17",
    "Dots3NoteForCausalLM": "0.5.19", "Dots3NoteForCausalLMNextN": "0.5.19",
    "Glm5NextForConditionalGeneration": "0.5.20", "Glm5NextForConditionalGenerationNextN": "0.5.20",
    "HYV4ForCausalLM": "0.5.20", "HYV4ForCausalLMNextN": "0.5.20",
    "DeepseekV2ForCausalLM": None, "Glm4MoeForCausalLM": None, "LlamaForCausalLM": None, "Qwen3ForCausalLM": None,
}


def installed_release():
    from importlib.metadata import version

    from packaging.version import Version

    return Version(Version(version("sglang")).base_version)


@pytest.mark.parametrize("architecture,dsa_from", DSA_FROM.items())
def test_a_model_is_accepted_exactly_from_the_release_that_serves_it_as_dsa(architecture, dsa_from):
    from packaging.version import Version

    accepted = dsa_from is not None and installed_release() >= Version(dsa_from)
    if accepted:
        validate(server_args(architecture=architecture))
    else:
        with pytest.raises(UnsupportedSetupError, match=f"{architecture} is not one"):
            validate(server_args(architecture=architecture))
    # Without an index_topk no release serves it as DSA.
    with pytest.raises(UnsupportedSetupError, match=f"{architecture} is not one"):
        validate(server_args(hf_config=types.SimpleNamespace(architectures=[architecture])))


def test_dsa_models_with_kda_layers_or_pooled_index_keys_are_refused_by_name():
    from sglang.srt.configs import model_config

    glm53 = types.SimpleNamespace(
        architectures=["Glm5NextForConditionalGeneration"], index_topk=2048,
        linear_attn_config={"kda_layers": [0, 1, 2], "full_attn_layers": [3]},
    )
    with pytest.raises(UnsupportedSetupError, match="Glm5NextForConditionalGeneration") as info:
        validate(server_args(hf_config=glm53))
    if hasattr(model_config, "uses_kda_attention"):  # 0.5.20+ serves it as DSA
        assert "KDA linear-attention layers" in str(info.value) and "in-tree HiSparse" in str(info.value)
    pooled = types.SimpleNamespace(architectures=["DeepseekV32ForCausalLM"], index_topk=2048, index_kpool=4)
    if hasattr(model_config, "get_dsa_index_kpool"):  # 0.5.20+ pools indexer keys
        with pytest.raises(UnsupportedSetupError, match="DeepseekV32ForCausalLM pools its indexer keys .index_kpool 4."):
            validate(server_args(hf_config=pooled))
    else:  # earlier releases ignore the field
        validate(server_args(hf_config=pooled))


# Speculative decoding (docs/speculative.md 2.1): each setup with its verdict on every supported release
# (0.5.17 - 0.5.21 through hooks_speculative.py, 0.5.22+ through SGLang's own calls), written out (None: accepted; else the error and fragments of its message). T = steps + 1 verify positions;
# the verify swap-in kernel serves T <= 4 (in groups of positions from T = 3 at top_k 2048), and the buffer must
# hold T x top_k.
EAGLE_1 = dict(speculative_algorithm="EAGLE", speculative_num_steps=1, speculative_eagle_topk=1, speculative_num_draft_tokens=2)
WAY_OUT = "use --speculative-num-steps 3 --speculative-num-draft-tokens 4"
SPECULATIVE_CASES = {
    "EAGLE 1 step": (EAGLE_1, None),
    "NEXTN 1 step": (dict(EAGLE_1, speculative_algorithm="NEXTN"), None),
    "fp8 KV": (dict(EAGLE_1, kv_cache_dtype="fp8_e4m3", dsa_decode_backend="flashmla_kv",
                    dsa_prefill_backend="flashmla_kv"), None),
    "PD decode": (dict(EAGLE_1, disaggregation_mode="decode"), None),
    "default buffer (2 x top_k)": (dict(EAGLE_1, hisparse_config=None), None),
    "buffer exactly T x top_k": (dict(EAGLE_1, hisparse_config='{"device_buffer_size": 4096}'), None),
    "shared host pool, one TP rank": (dict(EAGLE_1, hisparse_config='{"share_host_pool_across_tp": true}', tp_size=1), None),
    "2 steps, buffer 3 x top_k": (dict(EAGLE_1, speculative_num_steps=2, speculative_num_draft_tokens=3,
                                       hisparse_config='{"device_buffer_size": 6144}'), None),
    "3 steps, buffer 4 x top_k (the recommended DeepSeek launch)": (
        dict(EAGLE_1, speculative_num_steps=3, speculative_num_draft_tokens=4, hisparse_config='{"device_buffer_size": 8192}'),
        None),
    "3 steps, default buffer (2 x top_k)": (
        dict(EAGLE_1, speculative_num_steps=3, speculative_num_draft_tokens=4, hisparse_config=None), None),
    "2 steps, default buffer (2 x top_k)": (
        dict(EAGLE_1, speculative_num_steps=2, speculative_num_draft_tokens=3, hisparse_config=None), None),
    "3 steps, buffer 2 x top_k": (dict(EAGLE_1, speculative_num_steps=3, speculative_num_draft_tokens=4,
                                       hisparse_config='{"device_buffer_size": 4096}'), None),
    "4 steps": (dict(EAGLE_1, speculative_num_steps=4, speculative_num_draft_tokens=5),
                (UnsupportedSetupError, ["--speculative-num-steps 1 to 3", "got --speculative-num-steps 4", WAY_OUT])),
    "0 steps": (dict(EAGLE_1, speculative_num_steps=0, speculative_num_draft_tokens=1),
                (UnsupportedSetupError, ["got --speculative-num-steps 0"])),
    "steps unresolved": (dict(EAGLE_1, speculative_num_steps=None, speculative_num_draft_tokens=None),
                         (UnsupportedSetupError, ["got --speculative-num-steps None"])),
    "topk 2": (dict(EAGLE_1, speculative_eagle_topk=2),
               (UnsupportedSetupError, ["--speculative-eagle-topk 2: use --speculative-eagle-topk 1"])),
    "tree of topk 4": (dict(EAGLE_1, speculative_num_steps=3, speculative_eagle_topk=4, speculative_num_draft_tokens=8),
                       (UnsupportedSetupError, ["--speculative-eagle-topk 4: use --speculative-eagle-topk 1"])),
    "topk unresolved": (dict(EAGLE_1, speculative_eagle_topk=None),
                        (UnsupportedSetupError, ["--speculative-eagle-topk None"])),
    "3 draft tokens for 1 step": (dict(EAGLE_1, speculative_num_draft_tokens=3),
                                  (UnsupportedSetupError, ["needs --speculative-num-draft-tokens 2, got 3"])),
    "adaptive": (dict(EAGLE_1, speculative_adaptive=True), (UnsupportedSetupError, ["remove --speculative-adaptive"])),
    "multi-layer EAGLE": (dict(EAGLE_1, enable_multi_layer_eagle=True),
                          (UnsupportedSetupError, ["remove --enable-multi-layer-eagle"])),
    "EAGLE3": (dict(EAGLE_1, speculative_algorithm="EAGLE3"), (UnsupportedSetupError, ["EAGLE or NEXTN", "not EAGLE3"])),
    "STANDALONE": (dict(EAGLE_1, speculative_algorithm="STANDALONE"), (UnsupportedSetupError, ["not STANDALONE"])),
    "NGRAM": (dict(EAGLE_1, speculative_algorithm="NGRAM"), (UnsupportedSetupError, ["not NGRAM"])),
    "DFLASH": (dict(EAGLE_1, speculative_algorithm="DFLASH"), (UnsupportedSetupError, ["not DFLASH"])),
    "FROZEN_KV_MTP": (dict(EAGLE_1, speculative_algorithm="FROZEN_KV_MTP"), (UnsupportedSetupError, ["not FROZEN_KV_MTP"])),
    "buffer of top_k, below T x top_k": (dict(EAGLE_1, hisparse_config='{"device_buffer_size": 2048}'), None),
    "shared host pool, TP 2": (dict(EAGLE_1, hisparse_config='{"share_host_pool_across_tp": true}', tp_size=2),
                               (UnsupportedSetupError, ["set share_host_pool_across_tp to false"])),
}


@pytest.mark.parametrize("name", SPECULATIVE_CASES)
def test_speculative_setups_get_their_verdict(name):
    overrides, verdict = SPECULATIVE_CASES[name]
    if verdict is None:
        validate(server_args(**overrides))
        return
    error, fragments = verdict
    with pytest.raises(error) as info:
        validate(server_args(**overrides))
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)


def test_speculative_decoding_is_refused_with_sglangs_overlap_plan_stream(monkeypatch):
    monkeypatch.setenv("SGLANG_ENABLE_OVERLAP_PLAN_STREAM", "1")
    with pytest.raises(UnsupportedSetupError, match="SGLANG_ENABLE_OVERLAP_PLAN_STREAM=1.*unset it"):
        validate(server_args(**EAGLE_1))
    validate(server_args())  # without speculative decoding the variable does not matter
    monkeypatch.setenv("SGLANG_ENABLE_OVERLAP_PLAN_STREAM", "0")
    validate(server_args(**EAGLE_1))


def test_speculative_decoding_is_refused_on_a_release_outside_the_served_range(monkeypatch):
    from hisparse_sglang.integration.sglang import compat

    assert [compat.serves_speculative_decoding(v) for v in ("0.5.16", "0.5.17", "0.5.21", "0.5.23", "0.5.24")] == [
        False, True, True, True, False]
    assert [compat.speculative_verify_is_hooked(v) for v in ("0.5.17", "0.5.21", "0.5.22", "0.5.23")] == [
        True, True, False, False]
    monkeypatch.setattr(compat, "serves_speculative_decoding", lambda installed=None: False)
    with pytest.raises(UnsupportedSetupError, match="remove --speculative-algorithm"):
        validate(server_args(**EAGLE_1))
