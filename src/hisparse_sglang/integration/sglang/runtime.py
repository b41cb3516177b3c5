"""HiSparseRuntime: everything hisparse-sglang holds in one SGLang scheduler process (one TP rank).

SGLang builds the pieces in its own order, through the classes and hooks this package installs:

1. the KV pool (:class:`HiSparseDevicePool`, in place of SGLang's HiSparse pool): it creates the
   runtime, which owns the location -> device-row table the pool translates through;
2. the token allocator (:class:`HiSparseTokenAllocator`): SGLang passes it the pool as ``kvcache``,
   so it receives the same runtime at construction;
3. the coordinator, in the model runner (the ``maybe_init_hisparse_coordinator`` hook):
   :meth:`HiSparseRuntime.start` has ``build.build`` make the host pool, the device buffers, the CUDA ops
   of this GPU (``ops.swap_in.CudaOps``: workspace, checked launch plans, occupancy), the streams and the
   framework-free coordinator after the start-up checks, and returns the object SGLang keeps as
   ``hisparse_coordinator``, which forwards to them.

The SGLang-facing classes only forward to the runtime; nothing reaches into another adapter or sets
attributes on it, and no state lives at module level. Every hook finds the runtime with
:func:`runtime_of` on the SGLang object it receives (a scheduler, model runner, batch, tree cache,
allocator or coordinator).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging

import torch

from hisparse_sglang.config import HiSparseConfig
from hisparse_sglang.memory.allocator import KVAllocator
from hisparse_sglang.memory.quarantine import RowQuarantine

logger = logging.getLogger(__name__)

__all__ = ["HiSparseRuntime", "PerForward", "RequestLengthLimit", "runtime_of"]


class PerForward:
    """A value derived from one tensor of a forward, computed at the forward's first layer and reused by its later
    layers.

    SGLang hands every layer of a forward the same tensor object (the KV write's locations, the verify's page
    table), which nothing rebinds during the forward, so a value computed from it at the first layer holds for
    the rest. :meth:`get` computes anew at the pool's first layer and for any tensor other than the last one
    seen: under CUDA-graph capture the graph records the first layer's computation and the later layers read its
    output; a forward whose first layer does not ask still gets a fresh value for a new tensor.
    """

    def __init__(self) -> None:
        self._of: torch.Tensor | None = None
        self._value = None

    def get(self, of: torch.Tensor, first_layer: bool, compute):
        """``compute()``'s value for tensor ``of``, computed now if ``first_layer`` or ``of`` is new."""
        if first_layer or of is not self._of:
            self._value, self._of = compute(), of
        return self._value


@dataclasses.dataclass(frozen=True)
class RequestLengthLimit:
    """The prompt limit of this scheduler process when a KV pool (not the context length) sets it.

    Attributes:
        max_req_input_len: prompts of this many tokens or more are rejected (SGLang's value).
        note: what sets the limit and how to raise it, appended to SGLang's rejection message.
    """

    max_req_input_len: int
    note: str


class HiSparseRuntime:
    """The state of hisparse-sglang in one scheduler process.

    Args:
        host_to_device_ratio: logical (and host) tokens per device token (SGLang passes it to the pool).

    Attributes:
        rows: logical (= host) and device rows (``KVAllocator``), created with the allocator.
        quarantine: host rows of PD requests whose transfer did not complete, held back before reuse.
        config: the validated ``--hisparse-config`` (once started).
        coordinator: the SGLang-facing coordinator (``hisparse_coordinator``; once started).

    The pool-set prompt limit (:meth:`set_request_limit`, read by :meth:`explain_rejection`) and the
    Prometheus metrics (:meth:`export_metrics`) are the runtime's own, changed only through those methods.
    """

    def __init__(self, host_to_device_ratio: int) -> None:
        self.host_to_device_ratio = host_to_device_ratio
        self.rows: KVAllocator | None = None
        self.quarantine: RowQuarantine | None = None
        self.config: HiSparseConfig | None = None
        self.coordinator = None
        self._request_limit: RequestLengthLimit | None = None
        self._metrics = None
        self._pool = None
        self._allocator = None
        # 0.5.17 - 0.5.21 only (hooks_speculative.py): while SGLang allocates a speculative reserve, its
        # alloc_extend must hand out logical locations only; while a TARGET_VERIFY forward_extend runs, the
        # pool's one translation of its page table returns the verify swap-in's rows instead.
        self.reserving_logical_only = False
        self._verify_rows: torch.Tensor | None = None
        # Whether the verify forward's top-k is SGLang's fused one through the coordinator's verify page table
        # (hook H5 decides per layer, H4's swap-in reads it), and that table, built once per forward.
        self.verify_top_k_fused = False
        self._verify_page_table = PerForward()
        self._logged_verify_top_k: bool | None = None

    # ---------------------------------------------------------------- construction, in SGLang's order
    def attach_pool(self, pool) -> None:
        self._pool = pool

    def create_rows(self, device_tokens: int, page_size: int, device, sort_frees: bool) -> KVAllocator:
        """The logical and device rows of this process (called once, by the allocator SGLang builds)."""
        self.rows = KVAllocator(
            host_pages=host_pages_for(device_tokens, self.host_to_device_ratio, page_size),
            device_pages=device_tokens // page_size + 1,
            page_size=page_size,
            device=device,
            sort_frees=sort_frees,
        )
        self.quarantine = RowQuarantine(0.0, page_size)
        return self.rows

    def attach_allocator(self, allocator) -> None:
        self._allocator = allocator

    def start(
        self, config: HiSparseConfig, req_to_token_pool, device, tp_group=None, dp_attention: bool = False,
        num_draft_tokens: int = 0,
    ):
        """Build everything of this process (``build.build``: the host pool, private or shared by the TP ranks
        of the node, the device buffers, the ops, the streams, the coordinator core) and the SGLang-facing
        coordinator that forwards to it (what SGLang keeps as ``model_runner.hisparse_coordinator``), which
        it returns. ``num_draft_tokens``: the verify positions of speculative decoding, 0 without it."""
        from hisparse_sglang.integration.sglang import build
        from hisparse_sglang.integration.sglang.coordinator import SGLangHiSparseCoordinator

        self.config = config
        self.quarantine.seconds = config.pd_quarantine_s
        parts = build.build(
            config, req_to_token_pool, self._allocator, self._pool, device, tp_group=tp_group,
            dp_attention=dp_attention, num_draft_tokens=num_draft_tokens,
        )
        self.coordinator = SGLangHiSparseCoordinator(
            self, config, parts, self._allocator, device, tp_group=tp_group, num_draft_tokens=num_draft_tokens
        )
        return self.coordinator

    # ---------------------------------------------------------------- what the adapters ask
    @property
    def started(self) -> bool:
        return self.coordinator is not None

    @property
    def core(self):
        """The framework-free coordinator, or None before :meth:`start`."""
        return self.coordinator.core if self.coordinator is not None else None

    @property
    def device_row_of_loc(self) -> torch.Tensor:
        return self.rows.device_row_of_loc

    @contextlib.contextmanager
    def logical_only_reserve(self):
        """Within: the allocator's ``alloc_extend`` allocates logical locations only (what 0.5.22+'s
        ``alloc_for_spec_decode`` asks for with ``alloc_logical_only``; hook H1)."""
        self.reserving_logical_only = True
        try:
            yield
        finally:
            self.reserving_logical_only = False

    @contextlib.contextmanager
    def verify_rows_for_translation(self, rows: torch.Tensor):
        """Within: the pool's next ``translate_loc_to_hisparse_device`` returns ``rows`` (int32 ``[B * T, K]``,
        the verify swap-in's device rows) instead of translating its argument (hook H4); the hand-over is
        dropped on exit whether or not it was taken."""
        self._verify_rows = rows
        try:
            yield
        finally:
            self._verify_rows = None

    def fused_verify_page_table(self, req_pool_indices: torch.Tensor, page_table: torch.Tensor, layer_id: int):
        """The page table the fused top-k of this TARGET_VERIFY forward maps through (hook H5; the coordinator's
        ``verify_page_table``), built once per forward (:class:`PerForward`: SGLang's logical page table is one
        tensor per forward). The forward's swap-ins then take a resident request's entries as device rows
        (:attr:`verify_top_k_fused`)."""
        self._set_verify_top_k(True)
        return self._verify_page_table.get(
            page_table, layer_id == self._pool.start_layer,
            lambda: self.coordinator.verify_page_table(req_pool_indices, page_table),
        )

    def unfused_verify_top_k(self) -> None:
        """This TARGET_VERIFY forward's top-k yields positions only (SGLang's unfused top-k; hook H5)."""
        self._set_verify_top_k(False)

    def _set_verify_top_k(self, fused: bool) -> None:
        self.verify_top_k_fused = fused
        if fused != self._logged_verify_top_k:  # the first verify forward (a graph capture) and any change
            self._logged_verify_top_k = fused
            logger.info(
                "HiSparse: the speculative verify's top-k is "
                + ("SGLang's fused v2 kernel through the verify page table (resident requests' entries are device "
                   "rows)" if fused else "SGLang's unfused top-k (positions; docs/speculative.md 2.7)")
            )

    def take_verify_rows(self, loc: torch.Tensor) -> torch.Tensor | None:
        """The rows :meth:`verify_rows_for_translation` handed over (once), or None. ``loc``, the page table
        the caller would translate, must have their shape."""
        rows, self._verify_rows = self._verify_rows, None
        if rows is not None and tuple(loc.shape) != tuple(rows.shape):
            raise ValueError(
                f"the verify forward translates a page table of shape {tuple(loc.shape)} but the verify swap-in "
                f"returned rows of shape {tuple(rows.shape)}; this SGLang's DSA forward_extend does not match "
                f"hooks_speculative.py (remove --speculative-algorithm)."
            )
        return rows

    def remember_preallocated(self, slot: int, locations) -> None:
        """PD decode: the logical locations SGLang preallocated for a request (the host rows the
        prefill instance writes); None when the logical pool had no room."""
        self.coordinator.mem_pool_host.preallocated[slot] = locations

    def set_request_limit(self, max_req_input_len: int, note: str | None) -> None:
        """Records the prompt limit SGLang computed for this process (``get_worker_info``) and, when a KV
        pool sets it, the note that explains it (``note``; None when the context length sets it)."""
        self._request_limit = RequestLengthLimit(max_req_input_len, note) if note else None

    def explain_rejection(self, message: str | None, max_req_input_len: int) -> str | None:
        """SGLang's rejection of a prompt longer than ``max_req_input_len`` (``validate_input_length``'s
        message) with this process's note appended, when that limit is the one a KV pool sets; any
        other message is returned unchanged."""
        limit = self._request_limit
        if (
            not message or limit is None or limit.max_req_input_len != max_req_input_len
            or f"the maximum allowed length ({max_req_input_len} tokens)" not in message or limit.note in message
        ):
            return message
        return f"{message} {limit.note}"

    def export_metrics(self, values: dict, labels: dict) -> None:
        """Export one report's figures (``SGLangHiSparseCoordinator.report()``) as this process's
        Prometheus metrics with ``labels``; the metrics are created on the first export (in the scheduler
        process, after SGLang set ``PROMETHEUS_MULTIPROC_DIR``), named by the first export's label names."""
        if self._metrics is None:
            from hisparse_sglang.integration.sglang.metrics import PrometheusExporter

            self._metrics = PrometheusExporter(list(labels))
        self._metrics.export(values, labels)


def host_pages_for(device_tokens: int, host_to_device_ratio: int, page_size: int) -> int:
    """Pages of the logical (= host) space for a device pool of ``device_tokens``, page 0 included."""
    return device_tokens * host_to_device_ratio // page_size + 1


# The SGLang attributes through which an object reaches the component that holds the runtime, tried in
# this order: the first one the object has decides (a batch whose ``hisparse_coordinator`` is None has
# no runtime, whatever its allocator).
_HOLDERS = ("hisparse_coordinator", "token_to_kv_pool_allocator")
_ABSENT = object()


def runtime_of(sglang_object) -> HiSparseRuntime | None:
    """The runtime of this process behind ``sglang_object``, the one lookup every hook uses.

    * a pool, allocator or coordinator this package built: its own ``runtime``;
    * a scheduler, model runner or ``ScheduleBatch``: the runtime of its ``hisparse_coordinator``
      (None while that is None, e.g. before the model runner starts the coordinator);
    * a tree cache (anything with a ``token_to_kv_pool_allocator`` and no ``hisparse_coordinator``):
      the runtime of that allocator.

    None for SGLang's own objects (the in-tree HiSparse's, or HiSparse off) and for None.
    """
    runtime = getattr(sglang_object, "runtime", None)
    if isinstance(runtime, HiSparseRuntime):
        return runtime
    for name in _HOLDERS:
        holder = getattr(sglang_object, name, _ABSENT)
        if holder is not _ABSENT:
            runtime = getattr(holder, "runtime", None)
            return runtime if isinstance(runtime, HiSparseRuntime) else None
    return None
