"""Everything that depends on the SGLang version, in one place.

hisparse-sglang supports every SGLang release in :data:`SUPPORTED_SGLANG` (0.5.17 to 0.5.23;
``docs/sglang-versions.md`` lists each difference between them and how it is handled here). The
rest of the package calls the accessors below instead of reading fields or calling functions whose
name, place or signature changed between those releases. Differences that only the tests meet (building
and stepping SGLang's own objects) are kept with them, in ``tests/sglang/drive.py``.
"""

from __future__ import annotations

import contextlib
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
# The releases on which hisparse-sglang serves speculative decoding (EAGLE / NEXTN, topk 1). From 0.5.22
# SGLang's EAGLE worker calls the HiSparse coordinator's verify step itself (prepare_spec_verify, the 3-D
# swap_in_selected_pages, commit_spec_accept_tokens: docs/speculative.md 1.2, 2.8); on the releases of
# SPECULATIVE_HOOKED_SGLANG the hooks of hooks_speculative.py make the same calls (docs/speculative.md 2.7).
SPECULATIVE_SGLANG = ">=0.5.17"
SPECULATIVE_HOOKED_SGLANG = ">=0.5.17,<0.5.22"


@functools.cache
def sglang_version() -> str | None:
    """The installed SGLang's version string, or None when SGLang is not installed."""
    try:
        return version("sglang")
    except PackageNotFoundError:
        return None


@functools.cache
def _in_range(installed: str, specifier: str) -> bool:
    """Whether the version string ``installed`` is in ``specifier`` (False for an invalid version). Cached:
    the scheduler asks about the installed release on every speculative step (``next_spec_allocated_lens``)."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        return Version(installed) in SpecifierSet(specifier)
    except InvalidVersion:
        return False


def is_supported(installed: str | None) -> bool:
    """True if ``installed`` (a version string, None: not installed) is in :data:`SUPPORTED_SGLANG`."""
    return installed is not None and _in_range(installed, SUPPORTED_SGLANG)


def serves_speculative_decoding(installed: str | None = None) -> bool:
    """Whether hisparse-sglang serves speculative decoding on ``installed`` (default: the installed
    SGLang): a supported release in :data:`SPECULATIVE_SGLANG`."""
    installed = sglang_version() if installed is None else installed
    return is_supported(installed) and _in_range(installed, SPECULATIVE_SGLANG)


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


def kv_committed_len(req) -> int:
    """Tokens whose KV is committed (``req.kv_committed_len``; ``req.kv.kv_committed_len`` from 0.5.19)."""
    return int(req.kv.kv_committed_len if hasattr(req.kv, "kv_committed_len") else req.kv_committed_len)


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
    model's ``ModelConfig`` (:func:`model_config`)."""
    try:
        from sglang.srt.arg_groups.model_override_base import resolved_view
    except ImportError:  # 0.5.17, 0.5.18
        from sglang.srt.arg_groups.overrides import resolved_view
    return resolved_view(server_args), model_config(server_args)


def published_server_args():
    """This process's published server-argument record (``get_server_args()``), for the readers SGLang
    calls without one (from 0.5.19 ``parse_hisparse_config()`` takes no argument)."""
    from sglang.srt.runtime_context import get_server_args

    return get_server_args()


def model_config(server_args=None):
    """SGLang's ``ModelConfig`` of the server being started, built on first use and memoized by SGLang
    on its server-argument record: ``get_model_config()`` up to 0.5.18, ``model_override_base.model_config_of``
    from 0.5.19 (which also takes a view).

    Args:
        server_args: the record or view SGLang passed; None: this process's published record
            (``get_server_args()``; from 0.5.19 ``parse_hisparse_config()`` takes no argument).
    """
    if server_args is None:
        server_args = published_server_args()
    try:
        from sglang.srt.arg_groups.model_override_base import model_config_of
    except ImportError:  # 0.5.17, 0.5.18
        return server_args.get_model_config()
    return model_config_of(server_args)


def model_index_topk(model_config) -> int | None:
    """The tokens a DSA model's indexer selects per layer and step (``index_topk``), read where SGLang's
    model runner reads it: the text config of ``model_config`` (the model's own config, or the language
    model's inside a multimodal one). None: the model declares none."""
    return getattr(model_config.hf_text_config, "index_topk", None)


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
        group = model_runner.attention_tp_group if attention_dp_size() > 1 else model_runner.tp_group
    else:
        group = get_dp_tp_group()
    return getattr(group, "cpu_group", None)


def attention_dp_size() -> int:
    """How many data-parallel attention groups this scheduler's TP ranks form (1: DP attention off,
    every TP rank holds the same requests). From 0.5.22 ``ServerArgs.enable_dp_attention`` stays
    false after resolution even when attention DP is configured; the parallel context's width is
    right in every release."""
    from sglang.srt.runtime_context import get_parallel

    return int(get_parallel().attn_dp_size)


def tp_rank() -> int:
    """This scheduler's tensor-parallel rank."""
    from sglang.srt.runtime_context import get_parallel

    return int(get_parallel().tp_rank)


class CoordinatorCalls:
    """Scratch-related calls SGLang makes on ``model_runner.hisparse_coordinator`` from 0.5.22 on.

    0.5.22 added speculative decoding to its in-tree HiSparse, which gives every request extra
    device rows of per-step scratch: every prefill batch calls ``allocate_spec_scratch``
    (mem_cache/allocation.py), with or without speculation, and PD decode admission counts
    ``padded_buffer_size + spec_swap.scratch_capacity`` device rows per request. hisparse-sglang has
    no scratch: a verify step's working set lives in the request's buffer (``device_buffer_size >=
    num_draft_tokens x top_k``, checked at startup), which ``padded_buffer_size`` already counts. The
    verify step itself (``prepare_spec_verify``, ``commit_spec_accept_tokens``, the 3-D swap-in) is
    the adapter's (integration/sglang/coordinator.py); on 0.5.17 - 0.5.21 hooks_speculative.py calls it.
    """

    class _NoSpecScratch:
        scratch_capacity = 0

    spec_swap = _NoSpecScratch()

    def allocate_spec_scratch(self, req_pool_indices) -> None:
        """No speculative scratch to allocate (see the class)."""


def spec_alloc_reserve() -> int:
    """The KV length SGLang reserves beyond a request's committed length at each speculative decode step
    (``get_alloc_reserve_per_decode``): fixed by the server's speculative settings.

    Raises:
        UnsupportedSetupError: the installed release does not serve speculative decoding with
            hisparse-sglang (:func:`serves_speculative_decoding`).
    """
    if not serves_speculative_decoding():
        raise UnsupportedSetupError(
            f"hisparse-sglang serves speculative decoding on sglang{SPECULATIVE_SGLANG}, not on {sglang_version()}."
        )
    from sglang.srt.mem_cache import allocation_sizing

    return allocation_sizing.get_alloc_reserve_per_decode()


def next_spec_allocated_lens(reqs, page_size: int, reserve: int | None = None) -> list[int]:
    """Each request's ``kv_allocated_len`` once the next speculative decode step has allocated its reserve:
    what ``eagle_prepare_for_decode`` computes (0.5.22+: ``page_aligned_decode_alloc_lens`` with the
    reserve of ``get_alloc_reserve_per_decode``, both reading the published speculative settings).

    Args:
        reserve: :func:`spec_alloc_reserve`, if the caller keeps it (a server's is fixed); None: read now.

    Raises:
        UnsupportedSetupError: the installed release does not serve speculative decoding with
            hisparse-sglang (:func:`serves_speculative_decoding`).
    """
    if reserve is None:
        reserve = spec_alloc_reserve()
    from sglang.srt.mem_cache import allocation_sizing

    if hasattr(allocation_sizing, "page_aligned_decode_alloc_lens"):  # 0.5.22+
        _, allocated, _ = allocation_sizing.page_aligned_decode_alloc_lens(reqs, reserve=reserve, page_size=page_size)
        return [int(length) for length in allocated]
    # 0.5.17 - 0.5.21: eagle_prepare_for_decode computes it inline, the same rule.
    return [
        max(req_kv_allocated_len(req), -(-(kv_committed_len(req) + reserve) // page_size) * page_size)
        for req in reqs
    ]


def speculative_verify_is_hooked(installed: str | None = None) -> bool:
    """Whether the verify step reaches the coordinator through hooks_speculative.py (0.5.17 - 0.5.21)
    rather than SGLang's own calls (0.5.22+)."""
    installed = sglang_version() if installed is None else installed
    return is_supported(installed) and _in_range(installed, SPECULATIVE_HOOKED_SGLANG)


# ---------------------------------------------------------------------------------------------------
# KV memory: Mooncake registration, write locations


def host_pool_regions(pointers, lengths) -> tuple[list[int], list[int]]:
    """The addresses and lengths of hisparse-sglang's host-pool regions among those of one
    ``MooncakeTransferEngine.batch_register`` call (none: the call registers SGLang's buffers only).

    0.5.17's ``MooncakeKVManager.register_buffer_to_engine`` registers the KV regions in a call of
    their own, with the list our host pool handed over; from 0.5.18 one call registers the KV, aux
    and state regions, in a list SGLang builds anew (``_registerable_regions``, duplicates removed).
    In both, ours are the addresses of type ``mooncake.HostRegionAddress``.
    """
    from hisparse_sglang.integration.sglang.mooncake import HostRegionAddress

    ours = [(int(pointer), int(length)) for pointer, length in zip(pointers, lengths)
            if isinstance(pointer, HostRegionAddress)]
    return [pointer for pointer, _ in ours], [length for _, length in ours]


def write_locations(loc_info):
    """The logical locations a KV write targets: SGLang may pass a ``KVWriteLoc`` (locations with
    their SWA / full views) instead of the location tensor; its in-tree HiSparse pool unwraps it
    from 0.5.21 (``unwrap_write_loc`` exists in every supported release)."""
    from sglang.srt.mem_cache.memory_pool import unwrap_write_loc

    return unwrap_write_loc(loc_info)[0]


# ---------------------------------------------------------------------------------------------------
# the speculative verify step on 0.5.17 - 0.5.21 (hooks_speculative.py)


def forward_extend_topk_indices(args: tuple, kwargs: dict):
    """The ``topk_indices`` of a ``DeepseekSparseAttnBackend.forward_extend`` call, given the arguments
    after ``forward_batch`` (``save_kv_cache, q_rope, k_rope, topk_indices, ...`` in 0.5.17 - 0.5.21;
    ``RadixAttention`` passes it by keyword).

    Raises:
        UnsupportedSetupError: the call has none (a TARGET_VERIFY forward of a DSA layer always has).
    """
    topk_indices = kwargs.get("topk_indices", args[3] if len(args) > 3 else None)
    if topk_indices is None:
        raise UnsupportedSetupError(
            "a TARGET_VERIFY forward_extend of a DSA layer came without topk_indices; hisparse-sglang's verify "
            "swap-in needs them (remove --speculative-algorithm)."
        )
    return topk_indices


# The largest top-k SGLang's fused v2 top-k kernel serves (``_topk_transform_v2_paged``, 0.5.17 - 0.5.21).
_FUSED_TOP_K_MAX = 2048


def verify_top_k_fusable(indexer_metadata, top_k: int) -> bool:
    """Whether SGLang's top-k for this TARGET_VERIFY ``DSAIndexerMetadata`` would run its fused paged v2 kernel,
    which maps each selected position ``p`` through ``attn_metadata.real_page_table`` (``table[i, p // P] * P +
    p % P``): the top-k is not forced unfused (``SGLANG_DSA_FUSE_TOPK`` on, no PD IndexShare seeding), the
    transform is PAGED, the backend is sgl-kernel's with ``SGLANG_OPT_USE_TOPK_V2`` (the forward then carries
    its ``topk_v2_plan``), and ``top_k`` is at most 2048 (0.5.17 - 0.5.21)."""
    metadata = indexer_metadata
    return (
        not metadata.force_unfused_topk
        and metadata.topk_transform_method.name == "PAGED"
        and metadata.topk_backend.should_use_topk_v2()
        and getattr(metadata.attn_metadata, "topk_v2_plan", None) is not None
        and 0 < top_k <= _FUSED_TOP_K_MAX
    )


class _VerifyPageTableView:
    """SGLang's DSA attention metadata of a TARGET_VERIFY forward as its fused top-k reads it: ``real_page_table``
    is the coordinator's verify page table; every other field is the forward's own. Only the fused v2 path may
    read it: its ``page_table_1`` (the unfused transform's table) raises."""

    def __init__(self, metadata, page_table) -> None:
        self._metadata = metadata
        self.real_page_table = page_table

    @property
    def page_table_1(self):
        raise UnsupportedSetupError(
            "the TARGET_VERIFY top-k left SGLang's fused v2 path (topk_transform_v2_paged) that hisparse-sglang "
            "chose for it; set SGLANG_OPT_USE_TOPK_V2=0 to use the unfused top-k, or remove --speculative-algorithm."
        )

    def __getattr__(self, name):
        return getattr(self._metadata, name)


@functools.cache
def _fused_verify_metadata_class(base):
    """A subclass of SGLang's ``DSAIndexerMetadata`` class ``base`` whose top-k maps through a verify page table."""
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class FusedVerifyIndexerMetadata(base):
        verify_page_table: object = None

        def topk_transform(self, logits, topk, *args, **kwargs):
            view = _VerifyPageTableView(self.attn_metadata, self.verify_page_table)
            return base.topk_transform(dataclasses.replace(self, attn_metadata=view), logits, topk, *args, **kwargs)

    return FusedVerifyIndexerMetadata


def fused_verify_indexer_metadata(indexer_metadata, page_table):
    """``indexer_metadata`` (a TARGET_VERIFY ``DSAIndexerMetadata`` for which :func:`verify_top_k_fusable` holds)
    whose ``topk_transform`` runs SGLang's fused top-k through ``page_table`` instead of the logical page table;
    the indexer's own reads (its keys' pages, lengths) are unchanged."""
    import dataclasses

    cls = _fused_verify_metadata_class(type(indexer_metadata))
    fields = {field.name: getattr(indexer_metadata, field.name) for field in dataclasses.fields(indexer_metadata)}
    return cls(**fields, verify_page_table=page_table)


ALL_RESIDENT_VERIFY = "hisparse-all-resident"


def all_resident_verify_variant(variant_label: str | None) -> str:
    """The ``ShapeKey.variant_label`` of the target-verify graph without swap-ins, beside SGLang's own label of the
    same shape (None, or its LoRA variant "lora" / "nolora")."""
    return ALL_RESIDENT_VERIFY if variant_label is None else f"{variant_label}+{ALL_RESIDENT_VERIFY}"


def target_verify_graph_runner(runner) -> bool:
    """``runner`` (a ``DecodeCudaGraphRunner``) captures the target model's TARGET_VERIFY graphs."""
    return runner.capture_forward_mode.is_target_verify() and not runner.model_runner.is_draft_worker


def hisparse_enabled() -> bool:
    """``--enable-hisparse`` as this process published it."""
    from sglang.srt.runtime_context import get_memory

    return bool(get_memory().enable_hisparse)


def hisparse_disabled():
    """A context in which this process's published ``enable_hisparse`` reads false (SGLang's scoped override
    of its config bag): the draft runner's KV pool is built as SGLang's plain DSA pool there, as 0.5.22+
    builds it for every draft runner."""
    from sglang.srt.runtime_context import get_memory

    return get_memory().override(enable_hisparse=False)


@contextlib.contextmanager
def bonus_only_stash(future_map):
    """Within the block ``future_map.stash(indices, payload)`` writes the payload's bonus tokens only and keeps
    the draft buffers (top-k, hidden states) that the preceding forward published: 0.5.22's ``stash`` skips a
    payload's missing extras, 0.5.17 - 0.5.21's dereferences them. A future map whose buffers are not yet
    allocated (no forward has stashed) keeps its own ``stash``."""
    if getattr(future_map, "output_tokens_buf", None) is None or not getattr(future_map, "_forward_buf_initialized", True):
        yield
        return
    buf = future_map.output_tokens_buf

    def stash(indices, payload):
        if indices.shape[0]:
            buf[indices] = payload.bonus_tokens.to(buf.dtype)

    future_map.stash = stash
    try:
        yield
    finally:
        del future_map.stash


def staged_spec_input(future_map, spec_algorithm, req_pool_indices):
    """The draft input of requests leaving HiSparse staging: their future-map entries are their request
    slots, where the prefill's draft extend stored its outputs (what 0.5.22+'s
    ``FutureMap.make_staged_spec_input`` builds; the future map's own FIXME says its indices are the slots)."""
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
    from sglang.srt.speculative.eagle_info import EagleDraftInput

    return EagleDraftInput(
        capture_hidden_mode=CaptureHiddenMode.NULL if spec_algorithm.is_standalone() else CaptureHiddenMode.LAST,
        future_indices=req_pool_indices,
        future_dsa_topk_indices_available=getattr(future_map, "dsa_topk_indices_buf", None) is not None,
    )


def mla_kv_row_bytes(kvc) -> int:
    """Bytes of one token's MLA KV in one layer, as a KV-cache configurator ``kvc`` sizes it
    (``calculate_mla_kv_cache_dim`` takes ``server_args`` in 0.5.17 - 0.5.18, not from 0.5.19)."""
    import torch
    from sglang.srt.mem_cache.kv_cache_configurator import calculate_mla_kv_cache_dim

    extra = {"server_args": kvc.server_args} if _in_range(sglang_version() or "", "<0.5.19") else {}
    dim = calculate_mla_kv_cache_dim(model_config=kvc.model_config, kv_cache_dtype=kvc.kv_cache_dtype, **extra)
    return dim * torch._utils._element_size(kvc.kv_cache_dtype)
