"""The CUDA swap-in and row-copy ops (same signatures and semantics as ``ops.reference``).

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
from hisparse_sglang.ops.reference import BIND_BUFFER_SLOT
from hisparse_sglang.ops.swap_in_plan import (
    DEFAULT_THREADS,
    SYNC_COUNTERS_PER_ROW,
    check_swap_in_fits,
    shared_memory_per_block,
)
from hisparse_sglang.ops.tables import SwapInTables

__all__ = ["CudaOps", "DEFAULT_THREADS", "BIND_BUFFER_SLOT", "MAX_SPLITS", "TARGET_COPIERS"]

MAX_SPLITS = 65
TARGET_COPIERS = 64


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
        self._occupancy: dict[tuple[int, int, int], int] = {}
        self._multiprocessors = torch.cuda.get_device_properties(device).multi_processor_count
        self._no_counters = torch.empty(0, dtype=torch.int64, device=device)
        self._layer_pointers: dict[tuple[int, ...], torch.Tensor] = {}

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
    ) -> None:
        """Allocate the swap-in workspace for batches up to ``max_batch``, check that the kernel fits
        this GPU for the shape and query its occupancy for ``threads`` per block (call before CUDA-graph
        capture; a shape that does not fit raises HiSparseConfigError naming the key and the fix, the
        largest device_buffer_size that fits in multiples of ``page_size``)."""
        self._workspace(max_batch)
        if buffer_size is not None:
            self.launch_plan(top_k, buffer_size, threads or DEFAULT_THREADS, page_size)
            self.choose_splits(1, top_k, buffer_size, threads or DEFAULT_THREADS)

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

    def resident_ctas(self, top_k: int, buffer_size: int, threads: int) -> int:
        """How many swap-in CTAs of this shape the GPU runs at once (multiprocessors x occupancy)."""
        key = (threads, top_k, buffer_size)
        if key not in self._occupancy:
            plan = self.launch_plan(top_k, buffer_size, threads)
            self._occupancy[key] = int(self.module.swap_in_occupancy(threads, plan))
        return max(1, self._multiprocessors * self._occupancy[key])

    def choose_splits(self, batch: int, top_k: int, buffer_size: int, threads: int) -> int:
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
        """
        resident = self.resident_ctas(top_k, buffer_size, threads)
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
            torch.cuda.current_stream(self.device).cuda_stream,
        )
        return out

    def _pointers(self, layers: Sequence[torch.Tensor]) -> torch.Tensor:
        """uint64 table of the layers' base pointers on this GPU: kept on a LayerSet, else here by pointers."""
        tables = getattr(layers, "pointer_tables", None)
        if tables is not None:
            key = self.device
        else:
            tables = self._layer_pointers
            key = tuple(t.data_ptr() for t in layers)
        pointers = tables.get(key)
        if pointers is None:
            pointers = tables[key] = torch.tensor([t.data_ptr() for t in layers], dtype=torch.uint64).to(self.device)
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
        first = src_layers[0]
        row_bytes = first.numel() // first.shape[0] * first.element_size()
        self.module.copy_rows(
            self._pointers(src_layers),
            self._pointers(dst_layers),
            src_rows,
            dst_rows,
            row_bytes,
            max_blocks,
            torch.cuda.current_stream(self.device).cuda_stream,
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
            1 if fence_system else 0, torch.cuda.current_stream(self.device).cuda_stream,
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
            torch.cuda.current_stream(self.device).cuda_stream,
        )
