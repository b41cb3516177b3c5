"""Framework-free memory pools: host KV rows, device rows, device buffers of offloaded requests."""

from hisparse_sglang.memory.allocator import KVAllocator, PoolStats
from hisparse_sglang.memory.device_buffers import DeviceBufferPool
from hisparse_sglang.memory.host_pool import BF16_MLA_ITEM_BYTES, FP8_DSA_ITEM_BYTES, HostKVPool
from hisparse_sglang.memory.paged import PagedAllocator

__all__ = [
    "KVAllocator",
    "PoolStats",
    "DeviceBufferPool",
    "HostKVPool",
    "PagedAllocator",
    "BF16_MLA_ITEM_BYTES",
    "FP8_DSA_ITEM_BYTES",
]
