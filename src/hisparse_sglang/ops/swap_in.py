"""The CUDA swap-in and row-copy ops (same signatures and semantics as ``ops.reference``).

Besides the decode step's ops (``swap_in``, ``copy_rows``, ``backup_newest``, ``bind_rows``), the verify
step of speculative decoding (``coordinator.speculative.VerifyOps``): ``swap_in_positions`` (the same
kernel over the ``G x top_k`` entries of each group of ``G`` consecutive verify positions of a request, one
launch per group; ``swap_in_plan.positions_per_group`` chooses ``G``, ``check_swap_in_positions_fits``
refuses a shape where not even one position fits), ``bind_verify_slots``, ``commit_accepted`` and
``cap_accepted``.

The kernels are compiled on first use (``ops.jit``). :class:`CudaOps` launches them on one GPU and
owns what its launches keep between calls (the swap-in workspace, the checked shared-memory plans,
the occupancy, the layer pointer tables); the HiSparse runtime builds one per scheduler process
and hands it to the coordinator in place of the reference module. Everything runs on torch's
current CUDA stream and is CUDA-graph capturable once :meth:`CudaOps.reserve` has sized the
workspace.
"""

from __future__ import annotations

from typing import Sequence

import torch

from hisparse_sglang.config import DEFAULT_PAGE_SIZE
from hisparse_sglang.errors import HiSparseError
from hisparse_sglang.ops.jit import load_module
from hisparse_sglang.ops.layers import row_bytes as layer_row_bytes
from hisparse_sglang.ops.reference import BIND_BUFFER_SLOT, NO_VERIFY_LIMIT, _check_verify_positions
from hisparse_sglang.ops.swap_in_plan import (
    DEFAULT_THREADS,
    SYNC_COUNTERS_PER_ROW,
    check_swap_in_fits,
    check_swap_in_positions_fits,
    positions_per_group,
    shared_memory_per_block,
)
from hisparse_sglang.ops.tables import SwapInTables

__all__ = [
    "CudaOps", "DEFAULT_THREADS", "BIND_BUFFER_SLOT", "MAX_SPLITS", "TARGET_COPIERS", "verify_top_k_shape",
    "commit_row_bytes",
]

# torch's accessor of the current stream's raw handle (the one Inductor's generated launchers call).
_current_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)

MAX_SPLITS = 65
TARGET_COPIERS = 64


def verify_top_k_shape(top_k: torch.Tensor, tables: SwapInTables) -> tuple[int, int, int]:
    """``(B, T, K)`` of ``swap_in_positions``' top-k, after the checks made before any launch.

    Raises:
        ValueError: ``top_k`` is not ``[B, T, K]`` with ``T, K >= 1``, or (with any buffer) ``T``
            exceeds a buffer's verify slots (``P - 1``), with the reference twin's message.
    """
    if top_k.dim() != 3 or top_k.shape[1] < 1 or top_k.shape[2] < 1:
        raise ValueError(
            f"swap_in_positions: top_k must be int32 [B, T, K] (T >= 1 verify positions of K >= 1 entries per "
            f"request); got shape {list(top_k.shape)}."
        )
    batch, num_positions, num_top_k = top_k.shape
    if tables.slot_rows.shape[0]:
        _check_verify_positions(num_positions, tables.slot_rows, tables.slot_tokens.shape[1])  # the twin's check
    return batch, num_positions, num_top_k


def commit_row_bytes(
    num_positions: int,
    slot_rows: torch.Tensor,
    buffer_size: int,
    device_layers: Sequence[torch.Tensor],
    host_layers: Sequence[torch.Tensor],
) -> int | None:
    """The KV row size ``commit_accepted`` copies, after the checks made before any launch; None
    when there are no layers (nothing to copy).

    Raises:
        ValueError: ``T`` exceeds a buffer's verify slots, the layer lists differ in length (both with
            the reference twin's message), or a device and a host layer differ in row size.
    """
    _check_verify_positions(num_positions, slot_rows, buffer_size)
    if len(device_layers) != len(host_layers):
        raise ValueError(f"{len(device_layers)} device layers but {len(host_layers)} host layers.")
    if not len(device_layers):
        return None
    # The layers of a LayerSet share one row layout: the first of each side stands for all (a LayerSet keeps it).
    row_bytes = getattr(device_layers, "row_bytes", None) or layer_row_bytes(device_layers[0])
    host_row_bytes = getattr(host_layers, "row_bytes", None) or layer_row_bytes(host_layers[0])
    if row_bytes != host_row_bytes or row_bytes % 16:
        raise ValueError(
            f"commit_accepted: device rows of {row_bytes} B but host rows of {host_row_bytes} B; both must be the "
            f"same multiple of 16 bytes."
        )
    return row_bytes


class CudaOps:
    """The CUDA twins of ``ops.reference``'s ops on one GPU, with the state their launches keep.

    * the swap-in workspace: per batch row, the plan flag and a word of counters (arrivals, lookups
      done, CTAs done) through which the CTAs of one request take their roles and hand the plan over
      (``SYNC_COUNTERS_PER_ROW`` int32). The kernel leaves it all zero after every launch, so it is
      zeroed only when allocated. Replaced tensors are kept alive: captured CUDA graphs may still
      point at them;
    * the shared-memory plan of each swap-in shape, checked once against this GPU;
    * the kernel's occupancy per shape (how many CTAs run at once: ``choose_splits`` sizes the split to it);
    * the device tables of layer base pointers for ``copy_rows`` (on a ``LayerSet`` when given one).

    Args:
        device: the GPU (``"cuda"``: the current one, resolved now).
        module: the kernel library to launch, default ``jit.load_module()``; benchmarks and tests pass
            a variant build (``jit.load_module(defines=(...))``) to time or trace it without changing
            what anyone else runs.
    """

    def __init__(self, device: torch.device | str = "cuda", module=None) -> None:
        device = torch.device(device)
        if device.type != "cuda":
            raise HiSparseError(f"CudaOps needs a CUDA device, got {device}; use hisparse_sglang.ops.reference on CPU.")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self._module = module
        self._sync: torch.Tensor | None = None
        self._retired: list[torch.Tensor] = []
        self._plans: dict[tuple[int, int, int], torch.Tensor] = {}
        self._positions_plans: dict[tuple[int, int, int, int, int], torch.Tensor] = {}
        self._occupancy: dict[tuple[int, int, int, int | None, int | None], int] = {}
        self._multiprocessors = torch.cuda.get_device_properties(device).multi_processor_count
        self._no_counters = torch.empty(0, dtype=torch.int64, device=device)
        self._layer_pointers: dict[tuple, torch.Tensor] = {}  # by (device, pointers...)

    def _stream(self) -> int:
        """The raw handle of this GPU's current stream, which every launch takes (the capture stream while
        a CUDA graph is captured). torch's raw accessor, when it has one, skips the Stream object that
        ``torch.cuda.current_stream(device)`` builds per call: the scheduler launches several ops a step."""
        if _current_raw_stream is None:
            return torch.cuda.current_stream(self.device).cuda_stream
        return _current_raw_stream(self.device.index)

    @property
    def module(self):
        """The kernel library (built on first use)."""
        if self._module is None:
            self._module = load_module()
        return self._module

    # ------------------------------------------------------------------ sizing
    def reserve(
        self,
        max_batch: int,
        top_k: int,
        buffer_size: int | None = None,
        threads: int | None = None,
        page_size: int = DEFAULT_PAGE_SIZE,
        *,
        num_positions: int | None = None,
    ) -> None:
        """Allocate the swap-in workspace for batches up to ``max_batch``, check that the kernel fits
        this GPU for the shape and query its occupancy for ``threads`` per block (call before CUDA-graph
        capture; a shape that does not fit raises HiSparseConfigError naming the key and the fix, the
        largest device_buffer_size that fits in multiples of ``page_size``). With ``num_positions``
        (``T``, speculative decoding) the shape checked is ``swap_in_positions``' (``T`` positions of
        ``top_k`` entries per request in the groups :meth:`positions_group` chooses; :meth:`positions_plan`
        says what it raises) instead of ``swap_in``'s."""
        self._workspace(max_batch)
        if buffer_size is not None:
            threads = threads or DEFAULT_THREADS
            if num_positions is None:
                self.launch_plan(top_k, buffer_size, threads, page_size)
            else:
                self.positions_plan(num_positions, top_k, buffer_size, threads, page_size)
            self.choose_splits(1, top_k, buffer_size, threads, num_positions=num_positions)

    def _workspace(self, batch: int) -> torch.Tensor:
        if self._sync is None or self._sync.numel() < SYNC_COUNTERS_PER_ROW * batch:
            if torch.cuda.is_current_stream_capturing():
                raise HiSparseError(
                    f"swap-in workspace for batch {batch} was not reserved before CUDA-graph capture; "
                    f"call CudaOps.reserve() first."
                )
            if self._sync is not None:
                self._retired.append(self._sync)
            self._sync = torch.zeros(SYNC_COUNTERS_PER_ROW * batch, dtype=torch.int32, device=self.device)
        return self._sync

    def launch_plan(self, top_k: int, buffer_size: int, threads: int, page_size: int = DEFAULT_PAGE_SIZE) -> torch.Tensor:
        """The kernel's shared-memory plan for this shape (int64 CPU tensor, swap_in_plan.PLAN_FIELDS),
        checked once per shape against this GPU's shared memory per block.

        Raises:
            HiSparseConfigError: the shape needs more shared memory than the GPU has per block.
        """
        key = (top_k, buffer_size, threads)
        plan = self._plans.get(key)
        if plan is None:
            index = self.device.index
            checked = check_swap_in_fits(
                top_k, buffer_size, page_size, threads, limit=shared_memory_per_block(index),
                device_name=torch.cuda.get_device_name(index),
            )
            plan = self._plans[key] = torch.tensor(checked.as_ints(), dtype=torch.int64)
        return plan

    def positions_group(self, num_positions: int, top_k: int, buffer_size: int) -> int:
        """``G``, the verify positions one ``swap_in_positions`` launch serves by default:
        ``swap_in_plan.positions_per_group`` with this GPU's shared memory per block (on an H100 or H200 the
        reference twin's choice: ``G = 2`` for ``T >= 2`` at top_k 2048 with ``device_buffer_size`` 4096 to
        5760, ``G = 1`` from 6144 up)."""
        return positions_per_group(num_positions, top_k, buffer_size, shared_memory_per_block(self.device.index))

    def positions_plan(
        self, num_positions: int, top_k: int, buffer_size: int, threads: int, page_size: int = DEFAULT_PAGE_SIZE,
        group: int | None = None,
    ) -> torch.Tensor:
        """The shared-memory plan of one ``swap_in_positions`` launch for ``num_positions`` (``T``) verify
        positions of ``top_k`` entries per request served in groups of ``group`` (``G``, default
        :meth:`positions_group`): the plan of ``G x top_k`` entries (int64 CPU tensor,
        swap_in_plan.PLAN_FIELDS), checked once per shape against this GPU.

        Raises:
            HiSparseConfigError: device_buffer_size below ``top_k``, or too large for the plan of one
                position on this GPU.
            ValueError: an explicit ``group`` outside ``[1, T]`` or too large for the buffer or a launch.
        """
        if group is None:
            group = self.positions_group(num_positions, top_k, buffer_size)
        key = (num_positions, top_k, buffer_size, threads, group)
        plan = self._positions_plans.get(key)
        if plan is None:
            index = self.device.index
            checked = check_swap_in_positions_fits(
                num_positions, top_k, buffer_size, page_size, threads, limit=shared_memory_per_block(index),
                device_name=torch.cuda.get_device_name(index), group=group,
            )
            plan = self._positions_plans[key] = torch.tensor(checked.as_ints(), dtype=torch.int64)
        return plan

    def resident_ctas(
        self, top_k: int, buffer_size: int, threads: int, *, num_positions: int | None = None, group: int | None = None
    ) -> int:
        """How many swap-in CTAs of this shape the GPU runs at once (multiprocessors x occupancy); with
        ``num_positions``, of ``swap_in_positions``' kernel for a launch of ``group`` (default
        :meth:`positions_group`) positions of ``top_k`` entries."""
        if num_positions is not None and group is None:
            group = self.positions_group(num_positions, top_k, buffer_size)
        key = (threads, top_k, buffer_size, num_positions, group)
        if key not in self._occupancy:
            if num_positions is None:
                plan = self.launch_plan(top_k, buffer_size, threads)
                self._occupancy[key] = int(self.module.swap_in_occupancy(threads, plan))
            else:
                plan = self.positions_plan(num_positions, top_k, buffer_size, threads, group=group)
                self._occupancy[key] = int(self.module.swap_in_positions_occupancy(threads, plan))
        return max(1, self._multiprocessors * self._occupancy[key])

    def choose_splits(
        self, batch: int, top_k: int, buffer_size: int, threads: int, *, num_positions: int | None = None,
        group: int | None = None,
    ) -> int:
        """CTAs per request: a planner, plus copier CTAs while the batch is small and they fit.

        Copiers start reading a request's missed host rows at once, while its planner still chooses
        the slots; without them the planner copies after planning. About 64 copiers in all: bs 1 -> 65
        CTAs, 8 -> 9, 32 -> 3, 64 -> 2, 128 -> 1 on an H100. Measured there with `bench_swap_in.py sweep`
        (benchmarks/results/swap_in_sweep_H100_2026-11-23.md): at bs 8, 9 CTAs per request against 3
        took 28.1 against 30.6 us at 5 % misses, 85.3 against 86.8 at 20 % and 379.4 against 382.2 at
        100 %; at bs 1, 65 against 17 took 55.9 against 58.0 us at 100 %; with no miss every split was
        within 0.2 us. The split is capped at the CTAs the GPU runs at once (``resident_ctas``, measured
        on an idle GPU) for speed only: the kernel does not need its grid co-resident to finish (roles
        follow the order in which a request's CTAs start, and a CTA waits only for CTAs that have
        started; docs/kernels.md, "Forward progress"). A CTA that starts after its planner closed the
        claims leaves, and the planner copies that chunk itself: correct, but slower than a copier.
        ``num_positions``: the split of each ``swap_in_positions`` launch (of ``group`` positions, default
        :meth:`positions_group`; the same rule, its kernel's occupancy; not tuned by a sweep of its own).
        """
        resident = self.resident_ctas(top_k, buffer_size, threads, num_positions=num_positions, group=group)
        batch = max(batch, 1)
        splits = min(MAX_SPLITS, 1 + -(-TARGET_COPIERS // batch))
        while splits > 1 and batch * splits > resident:
            splits -= 1
        return splits

    # ------------------------------------------------------------------ ops
    def swap_in(
        self,
        top_k: torch.Tensor,
        seq_lens: torch.Tensor,
        req_pool_indices: torch.Tensor,
        num_real_reqs: torch.Tensor,
        tables: SwapInTables,
        out: torch.Tensor | None = None,
        counters: torch.Tensor | None = None,
        *,
        splits: int | None = None,
        threads: int | None = None,
    ) -> torch.Tensor:
        """CUDA twin of :func:`hisparse_sglang.ops.reference.swap_in` (see there for shapes and rules).

        ``tables.host_kv`` must be pinned host memory; every other tensor lives on this GPU. ``splits``
        is the number of CTAs per request (default :meth:`choose_splits`; every value the binding
        accepts, 1 to ``kMaxSplits`` (127) of csrc/swap_in_config.h, gives the same result, whether or
        not the grid fits the GPU at once).
        """
        if top_k.device != self.device:
            raise HiSparseError(f"swap_in: top_k is on {top_k.device}, but these ops launch on {self.device}.")
        batch, k = top_k.shape
        if out is None:
            out = torch.empty((batch, k), dtype=torch.int32, device=self.device)
        threads = threads or DEFAULT_THREADS
        buffer_size = tables.slot_tokens.shape[1]
        plan = self.launch_plan(k, buffer_size, threads)
        if splits is None:
            splits = self.choose_splits(batch, k, buffer_size, threads)
        self.module.swap_in(
            top_k,
            seq_lens,
            req_pool_indices,
            num_real_reqs,
            *tables.tensors(),
            out,
            self._no_counters if counters is None else counters,
            self._workspace(batch),
            plan,
            splits,
            threads,
            self._stream(),
        )
        return out

    def swap_in_positions(
        self,
        top_k: torch.Tensor,
        seq_lens: torch.Tensor,
        req_pool_indices: torch.Tensor,
        num_real_reqs: torch.Tensor,
        tables: SwapInTables,
        out: torch.Tensor | None = None,
        counters: torch.Tensor | None = None,
        verify_limit: torch.Tensor | None = None,
        *,
        group: int | None = None,
        resident_rows: bool = False,
        splits: int | None = None,
        threads: int | None = None,
    ) -> torch.Tensor:
        """CUDA twin of :func:`hisparse_sglang.ops.reference.swap_in_positions` (see there and
        ``coordinator.speculative.VerifyOps`` for shapes and rules): one launch per group of ``group``
        (``G``) consecutive positions, ``ceil(T / G)`` launches in stream order, fixed for the shape.

        The kernel is ``swap_in``'s, run on one row of ``G x K`` entries per request and launch, so each
        row of ``top_k`` and ``out`` must hold its ``T x K`` entries contiguously (``[B, T, K]`` views of
        contiguous ``[B * T, K]`` tensors do). ``seq_lens`` is ``s``, the committed length. ``group``
        None: :meth:`positions_group`, the reference twin's default choice on an H100 or H200 (pass the
        same ``group`` to both twins elsewhere). ``verify_limit`` (int32 ``[>= B]`` on this GPU, read and
        lowered on the device) None: a fresh one with every position served. A launch of ``G`` positions
        must fit the kernel's shared-memory plan (:meth:`positions_plan`; at top_k 2048 on sm_90 one
        position fits with ``device_buffer_size`` up to 14272), refused before any launch.

        Raises:
            ValueError: ``top_k`` is not ``[B, T, K]``, ``T`` exceeds a buffer's verify slots, or
                ``group`` is outside ``[1, T]`` or too large for the buffer or a launch.
            HiSparseConfigError: :meth:`positions_plan`.
        """
        if top_k.device != self.device:
            raise HiSparseError(
                f"swap_in_positions: top_k is on {top_k.device}, but these ops launch on {self.device}."
            )
        batch, num_positions, k = verify_top_k_shape(top_k, tables)
        threads = threads or DEFAULT_THREADS
        buffer_size = tables.slot_tokens.shape[1]
        page_size = tables.slot_rows.shape[1] - buffer_size
        if group is None:
            group = self.positions_group(num_positions, k, buffer_size)
        plan = self.positions_plan(num_positions, k, buffer_size, threads, page_size, group=group)
        if out is None:
            out = torch.empty((batch, num_positions, k), dtype=torch.int32, device=self.device)
        if splits is None:
            splits = self.choose_splits(batch, k, buffer_size, threads, num_positions=num_positions, group=group)
        if verify_limit is None:
            verify_limit = torch.full((batch,), NO_VERIFY_LIMIT, dtype=torch.int32, device=self.device)
        self.module.swap_in_positions(
            top_k,
            seq_lens,
            req_pool_indices,
            num_real_reqs,
            *tables.tensors(),
            out,
            self._no_counters if counters is None else counters,
            verify_limit,
            self._workspace(batch),
            plan,
            group,
            int(resident_rows),
            splits,
            threads,
            self._stream(),
        )
        return out

    def verify_page_table(
        self,
        page_table: torch.Tensor,
        req_pool_indices: torch.Tensor,
        num_positions: int,
        buffer_of_req: torch.Tensor,
        device_row_of_loc: torch.Tensor,
        page_size: int,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """CUDA twin of :func:`hisparse_sglang.ops.reference.verify_page_table` (one launch, one thread per
        entry, no host sync; CUDA-graph capturable)."""
        if out is None:
            out = torch.empty(page_table.shape, dtype=torch.int32, device=self.device)
        self.module.verify_page_table(
            page_table, req_pool_indices, buffer_of_req, device_row_of_loc, out, num_positions, page_size,
            self._stream(),
        )
        return out

    def _pointers(self, layers: Sequence[torch.Tensor], device: torch.device | None = None) -> torch.Tensor:
        """uint64 table of the layers' base pointers on ``device`` (this GPU by default; the CPU for the table the
        host names to the copy engines): kept on a LayerSet, else here by device and pointers."""
        device = self.device if device is None else device
        tables = getattr(layers, "pointer_tables", None)
        key = device
        if tables is None:
            tables = self._layer_pointers
            key = (device, *(t.data_ptr() for t in layers))
        pointers = tables.get(key)
        if pointers is None:
            pointers = tables[key] = torch.tensor([t.data_ptr() for t in layers], dtype=torch.uint64).to(device)
        return pointers

    def copy_rows(
        self,
        src_layers: Sequence[torch.Tensor],
        dst_layers: Sequence[torch.Tensor],
        src_rows: torch.Tensor,
        dst_rows: torch.Tensor,
        *,
        max_blocks: int = 0,
    ) -> None:
        """CUDA twin of :func:`hisparse_sglang.ops.reference.copy_rows` (one launch for every layer).

        Host tensors must be pinned; ``src_rows`` and ``dst_rows`` must be on this GPU (rows on the CPU
        are refused by the binding, by name). ``max_blocks`` caps the grid (0: four blocks per
        multiprocessor).
        """
        if src_rows.numel() == 0:
            return
        # The LayerSet's row size, kept when it was built (ops.layers), or one layer's.
        row_bytes = getattr(src_layers, "row_bytes", None) or layer_row_bytes(src_layers[0])
        self.module.copy_rows(
            self._pointers(src_layers),
            self._pointers(dst_layers),
            src_rows,
            dst_rows,
            row_bytes,
            max_blocks,
            self._stream(),
        )

    def copy_row_runs(
        self, src_layers: Sequence[torch.Tensor], dst_layers: Sequence[torch.Tensor], runs: torch.Tensor
    ) -> None:
        """CUDA twin of :func:`hisparse_sglang.ops.reference.copy_row_runs`: every run of every layer by the copy
        engines, one ``cudaMemcpyAsync`` each on the current stream, issued from C++ (host tensors pinned; ``runs``
        on the CPU, checked against both layers' rows by the binding before any copy)."""
        if len(src_layers) != len(dst_layers):
            raise ValueError(f"{len(src_layers)} source layers but {len(dst_layers)} destination layers.")
        if not src_layers or runs.numel() == 0:
            return
        row_bytes = getattr(src_layers, "row_bytes", None) or layer_row_bytes(src_layers[0])
        self.module.copy_row_runs(
            self._pointers(src_layers, torch.device("cpu")),
            self._pointers(dst_layers, torch.device("cpu")),
            runs.to(torch.int64).contiguous(),
            row_bytes,
            src_layers[0].shape[0],
            dst_layers[0].shape[0],
            self._stream(),
        )

    def backup_newest(
        self,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        num_real_reqs: torch.Tensor,
        req_to_token: torch.Tensor,
        device_row_of_loc: torch.Tensor,
        device_kv: torch.Tensor,
        host_kv: torch.Tensor,
        *,
        fence_system: bool = False,
    ) -> None:
        """CUDA twin of :func:`hisparse_sglang.ops.reference.backup_newest` (one launch, no host
        work beyond it: CUDA-graph capturable). ``host_kv`` must be pinned. ``fence_system``: every
        thread ends with ``__threadfence_system()``, for the writer of a host pool that other processes
        read (docs/shared-host-pool.md, "Ordering"); False (every private pool) launches the kernel as
        before."""
        self.module.backup_newest(
            req_pool_indices, seq_lens, num_real_reqs, req_to_token, device_row_of_loc, device_kv, host_kv,
            1 if fence_system else 0, self._stream(),
        )

    def bind_rows(
        self,
        plan: torch.Tensor,
        new_locs: torch.Tensor,
        new_pages: torch.Tensor,
        device_row_of_loc: torch.Tensor,
        buffer_of_req: torch.Tensor,
        slot_rows: torch.Tensor,
        buffer_size: int,
        page_size: int,
    ) -> None:
        """CUDA twin of :func:`hisparse_sglang.ops.reference.bind_rows` (one launch)."""
        self.module.bind_rows(
            plan, new_locs, new_pages, device_row_of_loc, buffer_of_req, slot_rows, buffer_size, page_size,
            self._stream(),
        )

    def bind_verify_slots(
        self,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        num_real_reqs: torch.Tensor,
        num_positions: int,
        req_to_token: torch.Tensor,
        device_row_of_loc: torch.Tensor,
        buffer_of_req: torch.Tensor,
        slot_rows: torch.Tensor,
        buffer_size: int,
    ) -> None:
        """CUDA twin of :func:`hisparse_sglang.ops.reference.bind_verify_slots` (one launch, one thread
        per batch row and position; ``s`` and ``num_real_reqs`` read on the device, no host sync).

        Raises:
            ValueError: ``num_positions`` outside ``[1, P - 1]`` (the reference twin's message).
        """
        _check_verify_positions(num_positions, slot_rows, buffer_size)
        self.module.bind_verify_slots(
            req_pool_indices, seq_lens, num_real_reqs, num_positions, req_to_token, device_row_of_loc, buffer_of_req,
            slot_rows, buffer_size, self._stream(),
        )

    def commit_accepted(
        self,
        req_pool_indices: torch.Tensor,
        seq_lens: torch.Tensor,
        accept_lens: torch.Tensor,
        num_real_reqs: torch.Tensor,
        num_positions: int,
        req_to_token: torch.Tensor,
        device_row_of_loc: torch.Tensor,
        buffer_of_req: torch.Tensor,
        slot_rows: torch.Tensor,
        buffer_size: int,
        device_layers: Sequence[torch.Tensor],
        host_layers: Sequence[torch.Tensor],
    ) -> None:
        """CUDA twin of :func:`hisparse_sglang.ops.reference.commit_accepted` (one launch for the batch and
        every layer: one warp per row copy of the fixed ``[B, T + 1] x L`` shape, masked by the accept
        lengths on the device; no host sync). ``host_layers`` must be pinned.

        The accept lengths are read on the device only, so the twin's check of ``0 <= a <= T`` is a
        precondition here: a row with ``a`` outside it commits nothing.

        Raises:
            ValueError: ``num_positions`` outside ``[1, P - 1]``, layer lists of different lengths
                (both the reference twin's messages), or device and host rows of different sizes.
        """
        row_bytes = commit_row_bytes(num_positions, slot_rows, buffer_size, device_layers, host_layers)
        if row_bytes is None:
            return
        self.module.commit_accepted(
            req_pool_indices, seq_lens, accept_lens, num_real_reqs, num_positions, req_to_token, device_row_of_loc,
            buffer_of_req, slot_rows, buffer_size, self._pointers(device_layers), self._pointers(host_layers),
            row_bytes, self._stream(),
        )

    def cap_accepted(
        self,
        verify_limit: torch.Tensor,
        accept_lens: torch.Tensor,
        accept_index: torch.Tensor,
        counters: torch.Tensor | None = None,
    ) -> None:
        """CUDA twin of :func:`hisparse_sglang.ops.reference.cap_accepted` (one launch, one thread per batch
        row, the limits and accept lengths read on the device; no host sync). Every tensor on this GPU;
        ``accept_index`` int32 ``[B, W]`` contiguous."""
        self.module.cap_accepted(
            verify_limit, accept_lens, accept_index, self._no_counters if counters is None else counters,
            self._stream(),
        )
