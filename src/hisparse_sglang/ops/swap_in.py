"""The CUDA swap-in and row-copy ops (same signatures and semantics as ``ops.reference``).

The kernels are compiled on first use (``ops.jit``). Everything here runs on torch's current
CUDA stream and is CUDA-graph capturable once :func:`reserve` has sized the workspace.

``module`` (``swap_in``, ``copy_rows``, ``choose_splits``, ``resident_ctas``): the kernel library to
launch, default ``jit.load_module()``; benchmarks pass a variant build,
``jit.load_module(defines=(...))``, to time or trace it without changing what anyone else runs.
"""

from __future__ import annotations

from typing import Sequence

import torch

from hisparse_sglang.config import DEFAULT_PAGE_SIZE
from hisparse_sglang.errors import HiSparseError
from hisparse_sglang.ops.jit import load_module
from hisparse_sglang.ops.reference import BIND_BUFFER_SLOT
from hisparse_sglang.ops.swap_in_limits import DEFAULT_THREADS, check_swap_in_fits, shared_memory_per_block
from hisparse_sglang.ops.tables import SwapInTables

__all__ = [
    "swap_in", "copy_rows", "backup_newest", "bind_rows", "reserve", "choose_splits", "resident_ctas",
    "launch_plan", "DEFAULT_THREADS", "BIND_BUFFER_SLOT",
]

MAX_SPLITS = 65
TARGET_COPIERS = 64

class _Workspace:
    """Per-device scratch of the swap-in kernel: per batch row, the flag, done counter and lookup
    counter through which the CTAs of one request hand the plan over. The kernel leaves it all
    zero after every launch, so it is zeroed only when allocated; its layout depends on its
    capacity alone. Replaced tensors are kept alive: captured CUDA graphs may still point at them.
    """

    def __init__(self) -> None:
        self.sync = None
        self.retired: list[torch.Tensor] = []

    def get(self, device: torch.device, batch: int) -> torch.Tensor:
        if self.sync is None or self.sync.numel() < 3 * batch:
            if torch.cuda.is_current_stream_capturing():
                raise HiSparseError(
                    f"swap-in workspace for batch {batch} was not reserved before CUDA-graph capture; "
                    f"call hisparse_sglang.ops.swap_in.reserve() first."
                )
            if self.sync is not None:
                self.retired.append(self.sync)
            self.sync = torch.zeros(3 * batch, dtype=torch.int32, device=device)
        return self.sync


_workspaces: dict[torch.device, _Workspace] = {}
_layer_pointers: dict[tuple[int, ...], torch.Tensor] = {}
_occupancy: dict[tuple, int] = {}  # (threads, top_k, buffer_size, device index, module or None)
_launch_plans: dict[tuple[int, int, int, int], torch.Tensor] = {}
_multiprocessors: dict[int, int] = {}
_empty_counters: dict[torch.device, torch.Tensor] = {}


def _normalized(device: torch.device | str) -> torch.device:
    """``cuda`` and ``cuda:N`` of the current device name the same workspace."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _workspace_for(device: torch.device) -> "_Workspace":
    key = _normalized(device)
    workspace = _workspaces.get(key)
    if workspace is None:
        workspace = _workspaces[key] = _Workspace()
    return workspace


def reserve(
    device: torch.device | str,
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
    device = _normalized(device)
    _workspace_for(device).get(device, max_batch)
    if buffer_size is not None:
        launch_plan(top_k, buffer_size, threads or DEFAULT_THREADS, device, page_size)
        choose_splits(1, top_k, buffer_size, threads or DEFAULT_THREADS, device)


def launch_plan(
    top_k: int, buffer_size: int, threads: int, device: torch.device, page_size: int = DEFAULT_PAGE_SIZE
) -> torch.Tensor:
    """The kernel's shared-memory plan for this shape (int64 CPU tensor, swap_in_limits.PLAN_FIELDS),
    checked once per shape and GPU against the GPU's shared memory per block.

    Raises:
        HiSparseConfigError: the shape needs more shared memory than the GPU has per block.
    """
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (top_k, buffer_size, threads, index)
    plan = _launch_plans.get(key)
    if plan is None:
        checked = check_swap_in_fits(
            top_k, buffer_size, page_size, threads, limit=shared_memory_per_block(index),
            device_name=torch.cuda.get_device_name(index),
        )
        plan = _launch_plans[key] = torch.tensor(checked.as_ints(), dtype=torch.int64)
    return plan


def resident_ctas(top_k: int, buffer_size: int, threads: int, device: torch.device, *, module=None) -> int:
    """How many swap-in CTAs of this shape the GPU runs at once (multiprocessors x occupancy) in
    ``module``'s kernel (default ``load_module()``; a variant build may use other resources)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (threads, top_k, buffer_size, index, module)
    if key not in _occupancy:
        plan = launch_plan(top_k, buffer_size, threads, torch.device("cuda", index))
        kernels = load_module() if module is None else module
        _occupancy[key] = int(kernels.swap_in_occupancy(threads, plan))
        _multiprocessors[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return max(1, _multiprocessors[index] * _occupancy[key])


def choose_splits(
    batch: int, top_k: int, buffer_size: int, threads: int, device: torch.device, *, module=None
) -> int:
    """CTAs per request: a planner, plus copier CTAs while the batch is small and they fit.

    Copiers start reading a request's missed host rows at once, while its planner still chooses
    the slots; without them the planner copies after planning. About 64 copiers in all: bs 1 -> 65
    CTAs, 8 -> 9, 32 -> 3, 64 -> 2, 128 -> 1 on an H100. Measured there with `bench_swap_in.py sweep`
    (benchmarks/results/swap_in_sweep_H100_2026-11-23.md): at bs 8, 9 CTAs per request against 3
    took 28.1 against 30.6 us at 5 % misses, 85.3 against 86.8 at 20 % and 379.4 against 382.2 at
    100 %; at bs 1, 65 against 17 took 55.9 against 58.0 us at 100 %; with no miss every split was
    within 0.2 us. Every CTA of the grid must be co-resident (copiers wait for their planner, the
    planner for its copiers), which caps the split at large batches.
    """
    resident = resident_ctas(top_k, buffer_size, threads, device, module=module)
    batch = max(batch, 1)
    splits = min(MAX_SPLITS, 1 + -(-TARGET_COPIERS // batch))
    while splits > 1 and batch * splits > resident:
        splits -= 1
    return splits


def swap_in(
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
    late_copiers_ns: int = 0,
    module=None,
) -> torch.Tensor:
    """CUDA twin of :func:`hisparse_sglang.ops.reference.swap_in` (see there for shapes and rules).

    ``tables.host_kv`` must be pinned host memory; every other tensor lives on the GPU. ``splits`` is
    the number of CTAs per request (default :func:`choose_splits`). ``late_copiers_ns`` is a
    test hook: copier CTAs sleep this long before their lookups, so the planner must wait for them;
    results must not change. ``module``: the kernel library to launch (default ``load_module()``).
    """
    batch, k = top_k.shape
    device = top_k.device
    if out is None:
        out = torch.empty((batch, k), dtype=torch.int32, device=device)
    threads = threads or DEFAULT_THREADS
    buffer_size = tables.slot_tokens.shape[1]
    plan = launch_plan(k, buffer_size, threads, device)
    if splits is None:
        splits = choose_splits(batch, k, buffer_size, threads, device, module=module)
    elif splits > 1:
        resident = resident_ctas(k, buffer_size, threads, device, module=module)
        if batch * splits > resident:
            raise HiSparseError(
                f"swap_in with splits={splits} needs {batch * splits} co-resident CTAs for batch {batch}, but this "
                f"GPU runs at most {resident} at once (the CTAs of a request wait for each other); pass a smaller "
                f"splits or leave it to choose_splits()."
            )
    if counters is None:
        counters = _empty_counters.setdefault(device, torch.empty(0, dtype=torch.int64, device=device))
    sync = _workspace_for(device).get(device, batch)
    (load_module() if module is None else module).swap_in(
        top_k,
        seq_lens,
        req_pool_indices,
        num_real_reqs,
        *tables.tensors(),
        out,
        counters,
        sync,
        plan,
        splits,
        threads,
        late_copiers_ns,
        torch.cuda.current_stream(device).cuda_stream,
    )
    return out


def _pointers(layers: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """uint64 table of the layers' base pointers on ``device``: cached on a LayerSet, else by pointers."""
    tables = getattr(layers, "pointer_tables", None)
    if tables is not None:
        key = device
    else:
        tables = _layer_pointers
        key = tuple(t.data_ptr() for t in layers) + (device.index or 0,)
    pointers = tables.get(key)
    if pointers is None:
        pointers = tables[key] = torch.tensor([t.data_ptr() for t in layers], dtype=torch.uint64).to(device)
    return pointers


def copy_rows(
    src_layers: Sequence[torch.Tensor],
    dst_layers: Sequence[torch.Tensor],
    src_rows: torch.Tensor,
    dst_rows: torch.Tensor,
    *,
    max_blocks: int = 0,
    module=None,
) -> None:
    """CUDA twin of :func:`hisparse_sglang.ops.reference.copy_rows` (one launch for every layer).

    Host tensors must be pinned; ``src_rows`` and ``dst_rows`` must be on the GPU. ``max_blocks``
    caps the grid (0: four blocks per multiprocessor). ``module``: the kernel library to launch
    (default ``load_module()``).
    """
    if src_rows.numel() == 0:
        return
    # The GPU the copy runs on; rows passed on the CPU are then refused by the binding, by name.
    device = next((t.device for t in (src_rows, dst_rows) if t.is_cuda), None) or _normalized("cuda")
    first = src_layers[0]
    row_bytes = first.numel() // first.shape[0] * first.element_size()
    (load_module() if module is None else module).copy_rows(
        _pointers(src_layers, device),
        _pointers(dst_layers, device),
        src_rows,
        dst_rows,
        row_bytes,
        max_blocks,
        torch.cuda.current_stream(device).cuda_stream,
    )


def backup_newest(
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
    load_module().backup_newest(
        req_pool_indices, seq_lens, num_real_reqs, req_to_token, device_row_of_loc, device_kv, host_kv,
        1 if fence_system else 0, torch.cuda.current_stream(req_pool_indices.device).cuda_stream,
    )


def bind_rows(
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
    load_module().bind_rows(
        plan, new_locs, new_pages, device_row_of_loc, buffer_of_req, slot_rows, buffer_size, page_size,
        torch.cuda.current_stream(plan.device).cuda_stream,
    )
