"""Everything that depends on the SGLang version, in one place.

hisparse-sglang supports every SGLang release in :data:`SUPPORTED_SGLANG` (0.5.17 to 0.5.23;
``docs/sglang-versions.md`` lists each difference between them and how it is handled here). The
rest of the package calls the accessors below instead of reading fields or calling functions whose
name, place or signature changed between those releases.
"""

from __future__ import annotations

import functools
import logging
import multiprocessing
from importlib.metadata import PackageNotFoundError, version

from hisparse_sglang.errors import UnsupportedSetupError, UnsupportedSGLangError

logger = logging.getLogger(__name__)

# The releases whose hook targets, signatures and coordinator calls were checked one by one
# (docs/sglang-versions.md); pyproject.toml pins the same range.
SUPPORTED_SGLANG = ">=0.5.17,<0.5.24"
OLDEST_SGLANG = "0.5.17"
NEWEST_SGLANG = "0.5.23"
# The release the CUDA kernels and the end-to-end runs were proven on (the GPU image's torch 2.11).
GPU_PROVEN_SGLANG = "0.5.17"


@functools.cache
def sglang_version() -> str | None:
    """The installed SGLang's version string, or None when SGLang is not installed."""
    try:
        return version("sglang")
    except PackageNotFoundError:
        return None


def is_supported(installed: str | None) -> bool:
    """True if ``installed`` (a version string, None: not installed) is in :data:`SUPPORTED_SGLANG`."""
    if installed is None:
        return False
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        return Version(installed) in SpecifierSet(SUPPORTED_SGLANG)
    except InvalidVersion:
        return False


def unsupported_message(installed: str | None) -> str:
    """Why hisparse-sglang does not run with ``installed``, and the two ways out."""
    found = f"sglang {installed} is installed" if installed else "sglang is not installed"
    return (
        f"hisparse-sglang supports sglang{SUPPORTED_SGLANG} ({OLDEST_SGLANG} to {NEWEST_SGLANG}) but {found}. "
        f"Install a supported release (pip install 'sglang{SUPPORTED_SGLANG}'), or run SGLang without this "
        f"plugin (pip uninstall hisparse-sglang, or set SGLANG_PLUGINS to the other plugins' names)."
    )


def check_version(installed: str | None = None) -> None:
    """Raise :class:`UnsupportedSGLangError` unless the installed SGLang (or ``installed``) is supported."""
    installed = sglang_version() if installed is None else installed
    if not is_supported(installed):
        raise UnsupportedSGLangError(unsupported_message(installed))


# ---------------------------------------------------------------------------------------------------
# process roles

# Processes that run SGLang's load_plugins() but never touch KV memory. Since 0.5.22 the data-parallel
# controller and the detokenizer load plugins too, each right after setting this process title.
LIGHT_PROCESS_TITLES = ("sglang::detokenizer", "sglang::data_parallel_controller")


def process_title() -> str:
    """This process's title (``setproctitle``; empty when it is not installed)."""
    try:
        import setproctitle
    except ImportError:
        return ""
    return setproctitle.getproctitle() or ""


def process_role(title: str | None = None, has_parent: bool | None = None) -> str:
    """Which SGLang process is loading the plugin.

    * ``"light"``: a process that loads plugins but holds no model or KV memory (detokenizer, DP
      controller; 0.5.22+), recognised by the title SGLang sets before loading plugins;
    * ``"main"``: the process that parses and validates the server arguments (no parent process);
    * ``"scheduler"``: any other child process. SGLang's scheduler loads plugins before it sets its
      title, so it cannot be told apart by its title; a child that is not a scheduler gets the
      scheduler hooks too, which only import modules.

    Args:
        title, has_parent: the process title and whether a parent process exists (default: this
            process's).
    """
    title = process_title() if title is None else title
    if title.startswith(LIGHT_PROCESS_TITLES):
        return "light"
    if has_parent is None:
        has_parent = multiprocessing.parent_process() is not None
    return "scheduler" if has_parent else "main"


# ---------------------------------------------------------------------------------------------------
# request fields


def req_slot(req) -> int:
    """The request's slot in ReqToTokenPool (``req.req_pool_idx`` up to 0.5.22, ``req.kv.req_pool_idx`` in 0.5.23)."""
    slot = req_slot_or_none(req)
    if slot is None:
        raise ValueError(f"request {getattr(req, 'rid', '?')} has no request-pool slot")
    return slot


def req_slot_or_none(req) -> int | None:
    """:func:`req_slot`, or None for a request that holds no slot (released, or never admitted)."""
    slot = getattr(req, "req_pool_idx", None)
    if slot is None and getattr(req, "kv", None) is not None:
        slot = getattr(req.kv, "req_pool_idx", None)
    return None if slot is None else int(slot)


def req_kv_allocated_len(req) -> int:
    """Tokens with allocated logical locations (PD direct admission: the transferred prompt)."""
    return int(req.kv.kv_allocated_len)


def req_prefill_len(req) -> int:
    """Tokens computed by the prefill that just finished (``req.extend_range.end`` up to 0.5.21,
    ``req.extend_end`` from 0.5.22)."""
    extend_range = getattr(req, "extend_range", None)
    return int(extend_range.end if extend_range is not None else req.extend_end)


def abort_reason(message: str):
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    return FINISH_ABORT(message)


# ---------------------------------------------------------------------------------------------------
# server arguments and configuration


def hisparse_config_json(server_args=None) -> str | None:
    """The ``--hisparse-config`` JSON text.

    SGLang 0.5.17 and 0.5.18 call ``parse_hisparse_config(server_args)``; from 0.5.19 it takes no
    argument and reads the published memory settings (``get_memory().hisparse_config``).
    """
    if server_args is not None:
        return getattr(server_args, "hisparse_config", None)
    from sglang.srt.runtime_context import get_memory

    return get_memory().hisparse_config


def validation_inputs(server_args):
    """What ``validate_hisparse(server_args)`` reads: the resolved server-argument view and the
    model's Hugging Face config.

    SGLang passes its resolution view; up to 0.5.18 the view reaches the model through
    ``get_model_config()``, from 0.5.19 through ``model_override_base.model_config_of``.
    """
    try:
        from sglang.srt.arg_groups.model_override_base import model_config_of, resolved_view
    except ImportError:  # 0.5.17, 0.5.18
        from sglang.srt.arg_groups.overrides import resolved_view

        return resolved_view(server_args), server_args.get_model_config().hf_config
    return resolved_view(server_args), model_config_of(server_args).hf_config


def model_kind(hf_config) -> dict[str, bool | int]:
    """SGLang's classification of a model, as the installed release makes it.

    ``dsa``: DeepSeek Sparse Attention (``is_deepseek_dsa``; its list of architectures grows from
    release to release); ``dsv4``: DeepSeek-V4; ``minimax_sparse``: MiniMax-M3 sparse attention;
    ``kda_hybrid``: KDA linear-attention layers beside the sparse ones (``uses_kda_attention``,
    0.5.20+; no such model is served before); ``index_kpool``: indexer keys pooled per this many
    tokens (``get_dsa_index_kpool``, 0.5.20+; 1 before).
    """
    from sglang.srt.configs import model_config

    uses_kda_attention = getattr(model_config, "uses_kda_attention", None)
    get_dsa_index_kpool = getattr(model_config, "get_dsa_index_kpool", None)
    dsa = bool(model_config.is_deepseek_dsa(hf_config))
    return {
        "dsa": dsa,
        "dsv4": bool(model_config.is_deepseek_v4(hf_config)),
        "minimax_sparse": bool(model_config.is_minimax_sparse(hf_config)),
        "kda_hybrid": bool(uses_kda_attention(hf_config)) if uses_kda_attention else False,
        "index_kpool": int(get_dsa_index_kpool(hf_config) or 1) if get_dsa_index_kpool and dsa else 1,
    }


# ---------------------------------------------------------------------------------------------------
# scheduler-process state


def coordinator_cpu_group(model_runner):
    """The CPU process group whose ranks must take the same HiSparse decisions: the TP ranks of this
    DP rank. SGLang 0.5.22+ names it ``get_dp_tp_group()``; before, the model runner held the
    attention-TP and TP groups."""
    try:
        from sglang.srt.layers.dp_attention import get_dp_tp_group
    except ImportError:  # 0.5.17 - 0.5.21
        from sglang.srt.runtime_context import get_parallel

        group = model_runner.attention_tp_group if get_parallel().enable_dp_attention else model_runner.tp_group
    else:
        group = get_dp_tp_group()
    return getattr(group, "cpu_group", None)


def tp_rank() -> int:
    """This scheduler's tensor-parallel rank."""
    from sglang.srt.runtime_context import get_parallel

    return int(get_parallel().tp_rank)


class CoordinatorCalls:
    """Calls SGLang makes on ``model_runner.hisparse_coordinator`` in newer releases only.

    0.5.22 added speculative decoding to its in-tree HiSparse: every prefill batch calls
    ``allocate_spec_scratch`` (mem_cache/allocation.py) and PD decode admission reads
    ``spec_swap.scratch_capacity`` (the per-request device rows of the speculative scratch).
    hisparse-sglang refuses speculative decoding at startup, so there is no scratch; the verify
    calls are reached only with speculative decoding and fail with the way out.
    """

    class _NoSpecScratch:
        scratch_capacity = 0

    spec_swap = _NoSpecScratch()

    def allocate_spec_scratch(self, req_pool_indices) -> None:
        """No speculative scratch to allocate (speculative decoding is refused at startup)."""

    def prepare_spec_verify(self, batch) -> None:
        raise UnsupportedSetupError(_NO_SPECULATIVE_DECODING)

    def commit_spec_accept_tokens(self, batch=None, accept_indices=None) -> None:
        raise UnsupportedSetupError(_NO_SPECULATIVE_DECODING)


_NO_SPECULATIVE_DECODING = (
    "hisparse-sglang does not support speculative decoding, but SGLang asked its coordinator to verify "
    "draft tokens; remove --speculative-algorithm, or run without this plugin to use SGLang's in-tree "
    "HiSparse (0.5.22+)."
)
