"""Startup validation of a HiSparse server, in the main process before any model is loaded.

Every rejected setup raises a typed error naming the offending value and the fix. Besides the setups
HiSparse cannot run at all, it refuses what newer SGLang releases serve with their in-tree HiSparse
but hisparse-sglang does not (docs/sglang-versions.md): DeepSeek-V4, MiniMax-M3 sparse attention
(0.5.21+), DSA models with KDA linear-attention layers (GLM-5.3 / Glm5Next, 0.5.20+) or pooled indexer
keys, the flashinfer_sparse_mla decode backend and the HiCache host-pool retraction backup (0.5.18+),
and the speculative-decoding setups outside docs/speculative.md 2.1 (EAGLE / NEXTN, topk 1, a number
of steps whose verify positions the kernel serves, not adaptive; SGLang 0.5.17 - 0.5.21 through the
hooks of hooks_speculative.py, 0.5.22+ through SGLang's own calls). Each message
names the feature and the way out. Since this validation replaces SGLang's ``validate_hisparse``,
SGLang's own speculative rules for HiSparse (topk 1, not adaptive) are among these.
"""

from __future__ import annotations

import functools

from hisparse_sglang.config import HiSparseConfig, parse_config_text
from hisparse_sglang.errors import HiSparseConfigError, UnsupportedSetupError
from hisparse_sglang.integration.sglang import compat
from hisparse_sglang.ops.swap_in_plan import MAX_VERIFY_POSITIONS

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
    config = HiSparseConfig.from_dict(values, model_index_topk=model_index_topk)
    return config, "page_size" in values


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
    config = hisparse_config(args, model_config)
    _check_speculative(args, config)
    return config


# --speculative-algorithm values hisparse-sglang serves: SGLang's EAGLE worker with the model's NextN
# (MTP) layer as the draft; SGLang resolves NEXTN to EAGLE.
SPECULATIVE_ALGORITHMS = ("EAGLE", "NEXTN")
# Draft steps per verify the design covers (docs/speculative.md 2.1): T = steps + 1 <= 4 verify positions.
MAX_SPECULATIVE_STEPS = 3


def _check_speculative(args, config: HiSparseConfig) -> None:
    """Speculative decoding (docs/speculative.md 2.1): EAGLE / NEXTN with ``--speculative-eagle-topk 1``,
    ``T = steps + 1`` verify positions with ``1 <= steps <= 3`` and ``T`` at most what the verify swap-in
    kernel serves (``swap_in_plan.MAX_VERIFY_POSITIONS``), not adaptive, not multi-layer, the plan stream
    off, on every release of ``compat.SPECULATIVE_SGLANG``. ``args`` is the resolved view
    (SGLang's automatic choice of steps, topk and draft tokens included)."""
    algorithm = getattr(args, "speculative_algorithm", None)
    if algorithm is None or str(algorithm).upper() == "NONE":
        return
    installed = compat.sglang_version()
    if not compat.serves_speculative_decoding(installed):
        raise UnsupportedSetupError(
            f"hisparse-sglang serves speculative decoding (--speculative-algorithm {algorithm}) with "
            f"sglang{compat.SPECULATIVE_SGLANG}, not with the installed {installed}: install one of those "
            f"releases (pip install 'sglang{compat.SPECULATIVE_SGLANG},<0.5.24'), or remove --speculative-algorithm."
        )
    if str(algorithm).upper() not in SPECULATIVE_ALGORITHMS:
        raise UnsupportedSetupError(
            f"hisparse-sglang serves --speculative-algorithm EAGLE or NEXTN (the model's MTP layer as the "
            f"draft), not {algorithm}: use one of them, remove --speculative-algorithm, or {_IN_TREE}."
        )
    if getattr(args, "speculative_adaptive", False):
        raise UnsupportedSetupError(
            "hisparse-sglang does not serve --speculative-adaptive (the number of verify positions is fixed "
            "when the server starts): remove --speculative-adaptive."
        )
    if getattr(args, "enable_multi_layer_eagle", False):
        raise UnsupportedSetupError(
            "hisparse-sglang serves one draft layer (the model's NextN layer), not --enable-multi-layer-eagle: "
            "remove --enable-multi-layer-eagle."
        )
    topk = getattr(args, "speculative_eagle_topk", None)
    if topk != 1:
        raise UnsupportedSetupError(
            f"hisparse-sglang serves linear drafts only (--speculative-eagle-topk 1), got "
            f"--speculative-eagle-topk {topk}: use --speculative-eagle-topk 1."
        )
    steps = getattr(args, "speculative_num_steps", None)
    draft_tokens = getattr(args, "speculative_num_draft_tokens", None)
    most = MAX_VERIFY_POSITIONS - 1
    served = f"--speculative-num-steps {most} --speculative-num-draft-tokens {most + 1}"
    if not isinstance(steps, int) or not 1 <= steps <= MAX_SPECULATIVE_STEPS:
        raise UnsupportedSetupError(
            f"hisparse-sglang serves --speculative-num-steps 1 to {MAX_SPECULATIVE_STEPS} with HiSparse, got "
            f"--speculative-num-steps {steps}: use {served}."
        )
    if draft_tokens != steps + 1:
        raise UnsupportedSetupError(
            f"with --speculative-eagle-topk 1 every draft step adds one verify position: --speculative-num-steps "
            f"{steps} needs --speculative-num-draft-tokens {steps + 1}, got {draft_tokens}; set it to {steps + 1}."
        )
    if draft_tokens > MAX_VERIFY_POSITIONS:
        raise UnsupportedSetupError(
            f"--speculative-num-steps {steps} ({draft_tokens} verify positions per request) is not served yet: "
            f"hisparse-sglang's verify swap-in kernel handles at most {MAX_VERIFY_POSITIONS} positions; use "
            f"{served}, or {_IN_TREE} (2 to 4 draft tokens)."
        )
    if config.share_host_pool_across_tp and (getattr(args, "tp_size", 1) or 1) > 1:
        raise UnsupportedSetupError(
            "speculative decoding with a host pool shared by the TP ranks is not supported (a rank could read a "
            "host row before another rank's commit of the previous verify lands): set share_host_pool_across_tp "
            "to false in --hisparse-config."
        )
    from sglang.srt.environ import envs

    if envs.SGLANG_ENABLE_OVERLAP_PLAN_STREAM.get():
        raise UnsupportedSetupError(
            "hisparse-sglang orders a verify step's device work on the forward stream; "
            "SGLANG_ENABLE_OVERLAP_PLAN_STREAM=1 moves the verify preparation to another stream: unset it."
        )


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
