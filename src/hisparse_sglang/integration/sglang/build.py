"""Everything HiSparse allocates in one scheduler process, built in one place from the config.

:func:`build` runs the start-up checks (GPU pool against one buffer, host memory of every pool on this
host, the buffer tables against the free GPU memory), then opens the host pool (private or shared by the
node's TP ranks), the device buffers, the ops (the CUDA kernels, compiled before any CUDA-graph capture, or
the CPU reference twin), the streams and the framework-free coordinator core. :class:`HiSparseRuntime`
(``runtime.start``) calls it and hands the parts to the SGLang-facing coordinator, which only forwards.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import time

import torch

from hisparse_sglang.config import HiSparseConfig
from hisparse_sglang.coordinator import Coordinator
from hisparse_sglang.errors import HiSparseMemoryError
from hisparse_sglang.integration.sglang import limits
from hisparse_sglang.integration.sglang.runtime import host_pages_for
from hisparse_sglang.memory.consistency import RankStateCheck, gather_ints
from hisparse_sglang.memory.device_buffers import DeviceBufferPool
from hisparse_sglang.memory.host_pool import HostKVPool
from hisparse_sglang.memory.shared_host_pool import open_host_pool
from hisparse_sglang.streams import StreamSet

__all__ = ["RuntimeParts", "agree", "build"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RuntimeParts:
    """What :func:`build` made: the host pool, the device buffer tables, the streams and the core (which holds
    the ops)."""

    host_pool: HostKVPool
    buffers: DeviceBufferPool
    streams: StreamSet
    core: Coordinator
    shares_host_pool: bool
    start_layer: int  # the pool's first layer id (pipeline parallel): SGLang's layer ids minus this index the pools


def agree(tp_group, flags: list[bool]) -> list[bool]:
    """All-reduce MIN over the TP group so that every rank takes the same decisions (``flags`` unchanged with
    one rank or none)."""
    if tp_group is None or not flags or torch.distributed.get_world_size(group=tp_group) == 1:
        return flags
    values = torch.tensor([int(f) for f in flags], dtype=torch.int32)
    torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.MIN, group=tp_group)
    return [bool(v) for v in values.tolist()]


def build(
    config: HiSparseConfig, req_to_token_pool, allocator, pool, device, tp_group=None, dp_attention: bool = False,
    num_draft_tokens: int = 0,
) -> RuntimeParts:
    """Check, then allocate and compile, everything of one scheduler process (see the module docstring).

    Args:
        config: validated HiSparse settings.
        req_to_token_pool: SGLang's ReqToTokenPool (its slots and context length size the buffer tables).
        allocator: the HiSparseTokenAllocator SGLang built (its rows: the device pool and the logical space).
        pool: the HiSparseDevicePool SGLang built (its per-layer KV rows).
        device: the model runner's device.
        tp_group: CPU process group whose ranks must take identical decisions (None: one rank).
        dp_attention: SGLang runs DP attention (its ranks hold other requests: no shared host pool).
        num_draft_tokens: ``T``, the positions of each speculative verify step; 0 without it. Configured
            before SGLang captures the TARGET_VERIFY graph, so a setup the verify step cannot serve stops here.
    """
    device = torch.device(device)
    rows = allocator.rows
    layers = pool.kv_rows()
    item_bytes = layers[0].shape[1]
    shares_host_pool = _shares_host_pool(config, tp_group, dp_attention)
    _check_host_memory(
        len(layers) * rows.num_locs * item_bytes, config, allocator=allocator, row_bytes=len(layers) * item_bytes,
        tp_group=tp_group, device_pool_pages=rows.device_rows.capacity_pages, shared=shares_host_pool,
    )
    host_pool = open_host_pool(
        len(layers), rows.num_locs, item_bytes, pin=device.type == "cuda", group=tp_group if shares_host_pool else None,
    )
    num_req_slots, context_len = req_to_token_pool.req_to_token.shape
    # No more requests can be offloaded at once than there are request slots; a pool smaller than one buffer
    # was refused by _check_host_memory.
    num_buffers = min(num_req_slots, rows.device_rows.capacity_rows // config.padded_buffer_size)
    table_shape = (len(layers), num_req_slots, num_buffers, config.device_buffer_size, config.page_size, context_len)
    _check_device_memory(DeviceBufferPool.table_bytes(*table_shape), device, table_shape)
    buffers = DeviceBufferPool(*table_shape, device)
    if device.type == "cuda":
        from hisparse_sglang.ops.jit import load_module
        from hisparse_sglang.ops.swap_in import CudaOps

        started = time.monotonic()
        ops = CudaOps(device, module=load_module())  # compiled before any CUDA-graph capture
        ops.reserve(
            num_req_slots, config.top_k, config.device_buffer_size, config.swap_in_block_size,
            page_size=config.page_size,
        )
        logger.info("HiSparse: CUDA kernels ready in %.1f s", time.monotonic() - started)
    else:
        from hisparse_sglang.ops import reference as ops
    streams = StreamSet(device)
    core = Coordinator(
        config, rows, buffers, host_pool, layers, req_to_token_pool.req_to_token,
        ops=ops, streams=streams, agree=lambda flags: agree(tp_group, flags),
        rank_check=RankStateCheck(gather_ints(tp_group)) if shares_host_pool else None,
        ranks_share_host_pool=shares_host_pool,
    )
    if num_draft_tokens:
        core.configure_verify(num_draft_tokens)
    logger.info(
        "HiSparse (hisparse-sglang): %s; host pool %.2f GiB; device pool %d rows, %d buffers of %d",
        config.to_json(), host_pool.nbytes / 2**30, rows.device_rows.capacity_rows, num_buffers,
        config.padded_buffer_size,
    )
    start_layer = getattr(pool, "start_layer", 0) or 0
    return RuntimeParts(host_pool, buffers, streams, core, shares_host_pool, start_layer)


def _check_device_memory(needed: int, device: torch.device, shape: tuple) -> None:
    """The buffer tables are allocated after SGLang sized its KV pool: they must fit what is left."""
    layers, _, buffers, buffer_size, _, context_len = shape
    logger.info(
        "HiSparse: device buffer tables take %.1f MiB (%d layers x %d buffers; token -> slot map of "
        "context %d)", needed / 2**20, layers, buffers, context_len,
    )
    if device.type != "cuda":
        return
    free, _ = torch.cuda.mem_get_info(device)
    if needed > 0.5 * free:
        raise HiSparseMemoryError(
            f"the HiSparse device buffer tables need {needed / 2**30:.2f} GiB of GPU memory ({layers} layers x "
            f"{buffers} buffers x context {context_len}) but only {free / 2**30:.2f} GiB is free after the KV "
            f"pool; lower --mem-fraction-static or --context-length, or raise device_buffer_size "
            f"({buffer_size}) in --hisparse-config (fewer, larger buffers)."
        )


def _group_size(group) -> int:
    return 1 if group is None else torch.distributed.get_world_size(group=group)


def _shares_host_pool(config: HiSparseConfig, tp_group, dp_attention: bool) -> bool:
    """Whether the TP ranks of each node map one host pool: the switch is on, the group has more than
    one rank, and DP attention is off (with it the ranks hold different requests). Every rank of the
    group decides alike (the same server arguments)."""
    if not config.share_host_pool_across_tp:
        return False
    if dp_attention or _group_size(tp_group) == 1:
        logger.info(
            "HiSparse: share_host_pool_across_tp has no effect here (%s): every rank keeps its own host pool.",
            "DP attention gives the ranks different requests" if dp_attention else "one TP rank",
        )
        return False
    logger.warning(
        "HiSparse: share_host_pool_across_tp is on: the TP ranks of each node share one host pool. This is "
        "experimental and has run on the CPU only (docs/shared-host-pool.md); set it to false to give every rank "
        "its own pool."
    )
    return True


def _check_host_memory(
    needed: int, config: HiSparseConfig, allocator=None, row_bytes: int | None = None, tp_group=None,
    device_pool_pages: int | None = None, shared: bool = False,
) -> None:
    """What must hold before the host pool is pinned (minutes on a large host): the GPU KV pool
    (``device_pool_pages``, sized by SGLang) holds one offloaded request's buffer, and the host pools
    of every rank of ``tp_group`` on this host (``needed`` bytes each; one in all when ``shared``) fit
    the memory the host, or its cgroup, has available.

    With ``allocator`` (device pool size, page size) and ``row_bytes`` (one token of every layer) the
    message gives the largest host_to_device_ratio that fits. ``tp_group`` is the CPU group the
    coordinator agrees on (ranks outside it, e.g. other DP-attention groups, are not counted).
    """
    if device_pool_pages is not None:
        limits.check_device_pool(device_pool_pages, config)
    pools_on_host = 1
    if _group_size(tp_group) > 1:
        hosts: list = [None] * _group_size(tp_group)
        torch.distributed.all_gather_object(hosts, socket.gethostname(), group=tp_group)
        pools_on_host = limits.host_pools_on_host(hosts, socket.gethostname(), shared)

    def bytes_for_ratio(ratio: int) -> int:
        if allocator is None or row_bytes is None:
            return needed * ratio // config.host_to_device_ratio
        pages = host_pages_for(allocator.device_tokens, ratio, allocator.page_size)
        return pages * allocator.page_size * row_bytes

    limits.check_host_pool(
        needed, pools_on_host, bytes_for_ratio, config.host_to_device_ratio, limits.host_memory_available()
    )
