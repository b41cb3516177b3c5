"""Startup validation of a HiSparse server, in the main process before any model is loaded.

Every rejected setup raises a typed error naming the offending value and the fix. Besides the setups
HiSparse cannot run at all, it refuses what newer SGLang releases serve with their in-tree HiSparse
but hisparse-sglang does not (docs/sglang-versions.md): speculative decoding (0.5.22+), DeepSeek-V4,
MiniMax-M3 sparse attention (0.5.21+), DSA models with KDA linear-attention layers (GLM-5.3 /
Glm5Next, 0.5.20+) or pooled indexer keys, the flashinfer_sparse_mla decode backend and the HiCache
host-pool retraction backup (0.5.18+). Each message names the feature and the way out.
"""

from __future__ import annotations

import functools

from hisparse_sglang.config import HiSparseConfig, parse_config_text
from hisparse_sglang.errors import HiSparseConfigError, UnsupportedSetupError
from hisparse_sglang.integration.sglang import compat

__all__ = ["validate_server_args", "hisparse_config", "config_from_server_args", "ALLOWED_BACKENDS"]

# KV cache dtype -> DSA backends whose decode path calls the swap-in (SGLang 0.5.17, CUDA).
ALLOWED_BACKENDS = {"bfloat16": ("flashmla_sparse",), "fp8_e4m3": ("flashmla_kv",)}
DSA_PAGE_SIZE = 64


def hisparse_config(server_args=None, model_config=None) -> HiSparseConfig:
    """The HiSparseConfig every reader of ``--hisparse-config`` gets: startup validation (main
    process), SGLang's ``parse_hisparse_config`` (the SparseConfig its KV-pool sizing reads, in each
    scheduler) and the coordinator's start (scheduler). All of them see the model's ``index_topk``
    (the default and the required value of top_k), so SGLang's view and the coordinator's cannot
    disagree, and within a process they get the same object (:func:`config_from_server_args`).

    Args:
        server_args: SGLang's server-argument record or view; None: this process's published
            settings (from 0.5.19 ``parse_hisparse_config()`` takes no argument).
        model_config: SGLang's ``ModelConfig`` where the caller holds it (the model runner's);
            None: the one SGLang memoizes on the server arguments (``compat.model_config``).

    Raises:
        HiSparseConfigError: --hisparse-config is invalid for this model and --page-size.
    """
    if model_config is None:
        model_config = compat.model_config(server_args)
    return config_from_server_args(server_args, model_index_topk=compat.model_index_topk(model_config))


def config_from_server_args(server_args, model_index_topk: int | None = None) -> HiSparseConfig:
    """HiSparseConfig from ``--hisparse-config`` (where the installed release keeps it) and the
    model's ``index_topk``, its page size checked against SGLang's ``--page-size`` when
    ``server_args`` is given (raises HiSparseConfigError naming whichever of the two the user set)."""
    config, page_size_set = _parsed(compat.hisparse_config_json(server_args), model_index_topk)
    if server_args is not None:
        _check_page_size(config.page_size, page_size_set, getattr(server_args, "page_size", None))
    return config


# SGLang asks for its SparseConfig several times while it sizes a scheduler's KV pools, then the
# coordinator starts: the text is parsed once per process and every reader gets that one frozen
# object. The result is a function of the two arguments alone (no state to go stale); an invalid
# text raises each time, since errors are not cached.
@functools.lru_cache(maxsize=4)
def _parsed(text: str | None, model_index_topk: int | None) -> tuple[HiSparseConfig, bool]:
    """(the config, whether the text sets page_size)."""
    values = parse_config_text(text)
    return HiSparseConfig.from_dict(values, model_index_topk=model_index_topk), "page_size" in values


def _check_page_size(config_page_size: int, set_in_config: bool, server_page_size: int | None) -> None:
    """HiSparse's page size is SGLang's, and SGLang's DSA KV cache uses pages of DSA_PAGE_SIZE.

    A message blames the setting the user wrote: page_size in --hisparse-config when it is there,
    else --page-size.
    """
    if server_page_size is not None and server_page_size != config_page_size:
        if set_in_config:
            also = "" if server_page_size == DSA_PAGE_SIZE else f" and use --page-size {DSA_PAGE_SIZE}"
            raise HiSparseConfigError(
                f"page_size in --hisparse-config ({config_page_size}) differs from SGLang's page size "
                f"({server_page_size}); remove page_size from --hisparse-config{also}."
            )
        raise HiSparseConfigError(
            f"--page-size {server_page_size} does not work with --enable-hisparse: SGLang's DSA KV cache, and "
            f"HiSparse with it, uses pages of {DSA_PAGE_SIZE} tokens; remove --page-size or set it to {DSA_PAGE_SIZE}."
        )
    if config_page_size != DSA_PAGE_SIZE:
        written = ["page_size in --hisparse-config"] * set_in_config + ["--page-size"] * (server_page_size is not None)
        where = " and ".join(written)
        raise HiSparseConfigError(
            f"page_size ({config_page_size}) must be {DSA_PAGE_SIZE}: SGLang's DSA KV cache uses pages of "
            f"{DSA_PAGE_SIZE}; remove {where}."
        )


_IN_TREE = (
    "run without this plugin (pip uninstall hisparse-sglang, or SGLANG_PLUGINS set to the other plugins' names) "
    "to use SGLang's in-tree HiSparse"
)


def validate_server_args(
    args,
    model_config,
    kv_cache_dtype: str,
    dsa: bool,
    dsv4: bool = False,
    minimax_sparse: bool = False,
    kda_hybrid: bool = False,
    index_kpool: int = 1,
) -> HiSparseConfig:
    """Check a HiSparse server's settings; returns the parsed config.

    Args:
        args: SGLang's ServerArgs (or its resolved view).
        model_config: SGLang's ``ModelConfig`` of the model (``compat.model_config``).
        kv_cache_dtype: the resolved KV cache dtype ("bfloat16", "fp8_e4m3", ...).
        dsa, dsv4, minimax_sparse, kda_hybrid, index_kpool: SGLang's model classification
            (``compat.model_kind``).

    Raises:
        UnsupportedSetupError: the model, a flag or a backend cannot run HiSparse.
        HiSparseConfigError: --hisparse-config is invalid.
    """
    _check_model(model_config.hf_config, dsa, dsv4, minimax_sparse, kda_hybrid, index_kpool)
    if not getattr(args, "disable_radix_cache", False):
        raise UnsupportedSetupError("--enable-hisparse requires --disable-radix-cache; add it to the command line.")
    if getattr(args, "disaggregation_mode", "null") == "prefill":
        raise UnsupportedSetupError(
            "--enable-hisparse is a decode-instance feature: remove it from the prefill instance "
            "(--disaggregation-mode prefill); the prefill instance writes KV into the decode instance's host pool."
        )
    speculative_algorithm = getattr(args, "speculative_algorithm", None)
    if speculative_algorithm and str(speculative_algorithm).upper() != "NONE":
        raise UnsupportedSetupError(
            f"hisparse-sglang does not support speculative decoding (--speculative-algorithm {speculative_algorithm}): "
            f"remove --speculative-algorithm, or {_IN_TREE} (speculative decoding with HiSparse from SGLang 0.5.22)."
        )
    if (getattr(args, "dcp_size", 1) or 1) > 1:
        raise UnsupportedSetupError(
            f"HiSparse does not support decode context parallelism (--dcp-size {args.dcp_size}); use --dcp-size 1."
        )
    if getattr(args, "disaggregation_decode_retraction_backup", None) == "host_pool":
        raise UnsupportedSetupError(
            "hisparse-sglang keeps a retracted PD request's KV in CPU tensors, not in a HiCache host pool: "
            "use --disaggregation-decode-retraction-backup cpu_tensor (or leave it unset)."
        )
    if getattr(args, "pp_size", 1) > 1:
        raise UnsupportedSetupError(
            f"HiSparse does not support pipeline parallelism (--pp-size {args.pp_size}); use --pp-size 1."
        )
    if getattr(args, "enable_mixed_chunk", False):
        raise UnsupportedSetupError(
            "HiSparse does not support --enable-mixed-chunk (decode requests would skip the per-step binding); remove it."
        )
    dtype = "bfloat16" if kv_cache_dtype in ("auto", "bf16") else kv_cache_dtype
    if dtype not in ALLOWED_BACKENDS:
        raise UnsupportedSetupError(
            f"HiSparse supports --kv-cache-dtype bfloat16 or fp8_e4m3, got {kv_cache_dtype!r}."
        )
    allowed = ALLOWED_BACKENDS[dtype]
    for attribute, flag in (("dsa_decode_backend", "--dsa-decode-backend"), ("dsa_prefill_backend", "--dsa-prefill-backend")):
        backend = getattr(args, attribute, None)
        if backend is not None and backend not in allowed:
            raise UnsupportedSetupError(
                f"hisparse-sglang with a {dtype} KV cache needs {flag} {' or '.join(allowed)}, got {backend!r}."
            )
    return hisparse_config(args, model_config)


def _check_model(hf_config, dsa: bool, dsv4: bool, minimax_sparse: bool, kda_hybrid: bool, index_kpool: int) -> None:
    """The model must be a DeepSeek Sparse Attention model (SGLang's ``is_deepseek_dsa`` in the
    installed release) with MLA on every layer and one indexer key per token."""
    architecture = ", ".join(getattr(hf_config, "architectures", None) or ["unknown"])
    if dsv4:
        raise UnsupportedSetupError(
            f"hisparse-sglang supports DeepSeek Sparse Attention models (DeepSeek-V3.2, GLM-5), not DeepSeek-V4 "
            f"({architecture}); {_IN_TREE}."
        )
    if minimax_sparse:
        raise UnsupportedSetupError(
            f"hisparse-sglang supports DeepSeek Sparse Attention models (DeepSeek-V3.2, GLM-5), not MiniMax-M3 sparse "
            f"attention ({architecture}); {_IN_TREE} (0.5.21+)."
        )
    if not dsa:
        raise UnsupportedSetupError(
            f"--enable-hisparse needs a DeepSeek Sparse Attention model (DeepSeek-V3.2, GLM-5: an index_topk "
            f"in its config); {architecture} is not one. Remove --enable-hisparse."
        )
    if kda_hybrid:
        raise UnsupportedSetupError(
            f"{architecture} has KDA linear-attention layers beside its sparse-attention layers (GLM-5.3); "
            f"hisparse-sglang serves models whose every layer is MLA with DeepSeek Sparse Attention. Remove "
            f"--enable-hisparse, or {_IN_TREE}."
        )
    if index_kpool > 1:
        raise UnsupportedSetupError(
            f"{architecture} pools its indexer keys (index_kpool {index_kpool}); hisparse-sglang needs one indexer "
            f"key per token (index_kpool 1). Remove --enable-hisparse, or {_IN_TREE}."
        )
