"""The CUDA swap-in and row-copy ops (same signatures and semantics as ``ops.reference``).

The kernels are compiled on first use (``ops.jit``). Everything here runs on torch's current
CUDA stream and is CUDA-graph capturable once :func:`reserve` has sized the workspace.
"""

from __future__ import annotations

from typing import Sequence

import torch

from hisparse_sglang.errors import HiSparseError
from hisparse_sglang.ops.jit import load_module

__all__ = ["swap_in", "copy_rows", "eager_backup", "reserve", "choose_splits", "DEFAULT_THREADS"]

DEFAULT_THREADS = 1024
MAX_SPLITS = 16
TARGET_COPIERS = 16

class _Workspace:
    """Per-device scratch of the swap-in kernel.

    ``plan`` holds (host row, device row) per miss per batch row; ``sync`` holds the flags, done
    counters and miss counts that CTAs of one request use to hand the plan over. The kernel
    leaves ``sync`` all zero after every launch, so it is zeroed only when allocated; its layout
    depends on its capacity alone. Replaced tensors are kept alive: captured CUDA graphs may still
    point at them.
    """

    def __init__(self) -> None:
        self.plan = None
        self.sync = None
        self.retired: list[torch.Tensor] = []

    def get(self, device: torch.device, batch: int, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.plan is None or self.plan.numel() < batch * 2 * top_k or self.sync.numel() < 3 * batch:
            if torch.cuda.is_current_stream_capturing():
                raise HiSparseError(
                    f"swap-in workspace for batch {batch} x top_k {top_k} was not reserved before CUDA-graph "
                    f"capture; call hisparse_sglang.ops.swap_in.reserve() first."
                )
            capacity = max(batch, 0 if self.sync is None else self.sync.numel() // 3)
            plan_size = max(batch * 2 * top_k, 0 if self.plan is None else self.plan.numel())
            if self.plan is not None:
                self.retired += [self.plan, self.sync]
            self.plan = torch.empty(plan_size, dtype=torch.int32, device=device)
            self.sync = torch.zeros(3 * capacity, dtype=torch.int32, device=device)
        return self.plan, self.sync


_workspaces: dict[torch.device, _Workspace] = {}
_layer_pointers: dict[tuple[int, ...], torch.Tensor] = {}
_occupancy: dict[tuple[int, int, int, int], int] = {}
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
    device: torch.device | str, max_batch: int, top_k: int, buffer_size: int | None = None, threads: int | None = None
) -> None:
    """Allocate the swap-in workspace for batches up to ``max_batch`` and query the kernel's
    occupancy for ``threads`` per block (call before CUDA-graph capture)."""
    device = _normalized(device)
    _workspace_for(device).get(device, max_batch, top_k)
    if buffer_size is not None:
        choose_splits(1, top_k, buffer_size, threads or DEFAULT_THREADS, device)


def choose_splits(batch: int, top_k: int, buffer_size: int, threads: int, device: torch.device) -> int:
    """CTAs per request: spread a small batch's copies over the GPU, keep every CTA co-resident.

    Measured on an H100 (benchmarks/results): a lone request copies 3x faster from 16 CTAs than
    from one, but with 8 requests 16 CTAs each (128 copiers) lowered the gather rate from 48 to
    41 GB/s at 100 % misses; about 16 copying CTAs in all is the sweet spot.
    """
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (threads, top_k, buffer_size, index)
    if key not in _occupancy:
        _occupancy[key] = int(load_module().swap_in_occupancy(threads, top_k, buffer_size))
        _multiprocessors[index] = torch.cuda.get_device_properties(index).multi_processor_count
    sms = _multiprocessors[index]
    resident = max(1, sms * _occupancy[key])
    splits = max(1, min(MAX_SPLITS, TARGET_COPIERS // max(batch, 1)))
    while splits > 1 and batch * splits > resident:
        splits -= 1
    return splits


def swap_in(
    top_k: torch.Tensor,
    seq_lens: torch.Tensor,
    req_pool_indices: torch.Tensor,
    num_real_reqs: torch.Tensor,
    req_to_token: torch.Tensor,
    device_row_of_loc: torch.Tensor,
    buffer_of_req: torch.Tensor,
    slot_rows: torch.Tensor,
    slot_tokens: torch.Tensor,
    slot_stamps: torch.Tensor,
    token_slot: torch.Tensor,
    host_kv: torch.Tensor,
    device_kv: torch.Tensor,
    out: torch.Tensor | None = None,
    counters: torch.Tensor | None = None,
    *,
    splits: int | None = None,
    threads: int | None = None,
) -> torch.Tensor:
    """CUDA twin of :func:`hisparse_sglang.ops.reference.swap_in` (see there for shapes and rules).

    ``host_kv`` must be pinned host memory; every other tensor lives on the GPU.
    """
    batch, k = top_k.shape
    device = top_k.device
    if out is None:
        out = torch.empty((batch, k), dtype=torch.int32, device=device)
    threads = threads or DEFAULT_THREADS
    if splits is None:
        splits = choose_splits(batch, k, slot_tokens.shape[1], threads, device)
    if counters is None:
        counters = _empty_counters.setdefault(device, torch.empty(0, dtype=torch.int64, device=device))
    plan, sync = _workspace_for(device).get(device, batch, k)
    load_module().swap_in(
        top_k,
        seq_lens,
        req_pool_indices,
        num_real_reqs,
        req_to_token,
        device_row_of_loc,
        buffer_of_req,
        slot_rows,
        slot_tokens,
        slot_stamps,
        token_slot,
        host_kv,
        device_kv,
        out,
        counters,
        plan,
        sync,
        splits,
        threads,
        torch.cuda.current_stream(device).cuda_stream,
    )
    return out


def _pointers(layers: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    key = tuple(t.data_ptr() for t in layers) + (device.index or 0,)
    pointers = _layer_pointers.get(key)
    if pointers is None:
        pointers = torch.tensor([t.data_ptr() for t in layers], dtype=torch.uint64).to(device)
        _layer_pointers[key] = pointers
    return pointers


def copy_rows(
    src_layers: Sequence[torch.Tensor],
    dst_layers: Sequence[torch.Tensor],
    src_rows: torch.Tensor,
    dst_rows: torch.Tensor,
    *,
    max_blocks: int = 0,
) -> None:
    """CUDA twin of :func:`hisparse_sglang.ops.reference.copy_rows` (one launch for every layer).

    Host tensors must be pinned; ``src_rows`` and ``dst_rows`` must be on the GPU. ``max_blocks``
    caps the grid (0: four blocks per multiprocessor).
    """
    if src_rows.numel() == 0:
        return
    device = src_rows.device
    first = src_layers[0]
    row_bytes = first.numel() // first.shape[0] * first.element_size()
    load_module().copy_rows(
        _pointers(src_layers, device),
        _pointers(dst_layers, device),
        src_rows,
        dst_rows,
        row_bytes,
        max_blocks,
        torch.cuda.current_stream(device).cuda_stream,
    )


def eager_backup(
    device_layers: Sequence[torch.Tensor],
    host_layers: Sequence[torch.Tensor],
    device_rows: torch.Tensor,
    host_rows: torch.Tensor,
) -> None:
    """Copy the given device rows of every layer to the given host rows, in one launch."""
    copy_rows(device_layers, host_layers, device_rows, host_rows)
