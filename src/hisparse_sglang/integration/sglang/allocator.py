"""The token-to-KV allocator SGLang builds when HiSparse is on (replaces HiSparseTokenToKVPoolAllocator).

SGLang's logical token locations are host rows; while a request is resident its tokens also get
device rows in lockstep (``KVAllocator``). The scheduler's capacity view, ``available_size()``,
counts device rows that demotions could free, and never exceeds the device pool (SGLang computes
device usage from it).
"""

from __future__ import annotations

import torch
from sglang.srt.mem_cache.allocator.base import BaseTokenToKVPoolAllocator

from hisparse_sglang.errors import UnsupportedSetupError
from hisparse_sglang.integration.sglang.runtime import runtime_of
from hisparse_sglang.memory.allocator import _count_extend_pages

__all__ = ["HiSparseTokenAllocator"]


class _Capacity:
    """The ``available_size()`` view SGLang's PD decode admission reads from sub-allocators."""

    def __init__(self, available) -> None:
        self._available = available

    def available_size(self) -> int:
        return self._available()


class HiSparseTokenAllocator(BaseTokenToKVPoolAllocator):
    """Constructor arguments are those of SGLang's HiSparseTokenToKVPoolAllocator (the same in 0.5.17 - 0.5.23).

    It forwards to the process's :class:`HiSparseRuntime`, which it receives with ``kvcache`` (the
    pool SGLang built first created it): the runtime owns the rows, the quarantine and, once the model
    runner started it, the coordinator that demotes requests when a prefill needs device pages.

    Args:
        size: device KV pool tokens (SGLang's max_total_num_tokens).
        kvcache: the HiSparseDevicePool.
        host_to_device_ratio: logical (and host) tokens per device token.
    """

    def __init__(self, size, page_size, dtype, device, kvcache, need_sort, host_to_device_ratio=2):
        super().__init__(size, page_size, dtype, device, kvcache, need_sort)
        runtime = runtime_of(kvcache)
        if runtime is None:
            raise UnsupportedSetupError(
                f"HiSparse's allocator needs hisparse-sglang's KV pool, but SGLang built {type(kvcache).__name__}; "
                f"the hisparse-sglang hooks did not apply (see the HookRegistry log lines)."
            )
        self.runtime = runtime
        self.device_tokens = size
        self.host_to_device_ratio = host_to_device_ratio
        self.rows = runtime.create_rows(size, page_size, device, sort_frees=need_sort)
        runtime.attach_allocator(self)
        # SGLang's capacity: the logical space (its base class set the device pool's size).
        self.size = self.rows.logical.capacity_rows
        self.logical_attn_allocator = _Capacity(self._logical_free_rows)
        self.hisparse_attn_allocator = _Capacity(self._device_rows_obtainable)
        self.compress_ratio = 1
        # Frees held between free_group_begin() and free_group_end() (None: free at once). Kept
        # here, not in the base class's fields, whose representation changed in SGLang 0.5.19.
        self._held_frees: list[torch.Tensor] | None = None

    # ---------------------------------------------------------------- capacity
    @property
    def quarantine(self):
        return self.runtime.quarantine

    @property
    def size_full(self) -> int:
        return self.size

    def _device_rows_obtainable(self) -> int:
        core = self.runtime.core
        reclaimable = core.reclaimable_pages() if core is not None else 0
        return (self.rows.device_rows.free_pages + reclaimable) * self.page_size

    def available_size(self) -> int:
        """Tokens a new prefill can get: logical rows, bounded by device rows obtainable by demotion."""
        return min(self._logical_free_rows(), self._device_rows_obtainable())

    def _logical_free_rows(self) -> int:
        self._release_quarantine()
        return self.rows.logical.free_rows

    def _release_quarantine(self) -> None:
        rows = self.quarantine.expired()
        if rows.numel():
            self.rows.free(rows.to(self.rows.device))

    def debug_print(self) -> str:
        stats = self.rows.stats()
        return (
            f"hisparse host rows {stats.host_rows_used}/{stats.host_rows_total}, "
            f"device rows {stats.device_rows_used}/{stats.device_rows_total}"
        )

    # ---------------------------------------------------------------- allocation
    def alloc(self, need_size: int):
        raise UnsupportedSetupError(
            f"HiSparse allocates in pages of {self.page_size} tokens (alloc_extend / alloc_decode); "
            f"token-granular alloc({need_size}) is not supported."
        )

    def alloc_extend(
        self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens, num_new_pages=None
    ):
        if self.runtime.reserving_logical_only:  # a speculative reserve on 0.5.17 - 0.5.21 (hook H1)
            return self.alloc_logical_only(prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens)
        _, _, _, device_pages = _count_extend_pages(prefix_lens_cpu, seq_lens_cpu, self.page_size)
        core = self.runtime.core
        if device_pages > self.rows.device_rows.free_pages and core is not None:
            core.reclaim(device_pages)
        self._release_quarantine()
        return self.rows.alloc_extend(prefix_lens_cpu, seq_lens_cpu, last_loc)

    def alloc_decode(self, seq_lens, seq_lens_cpu, last_loc):
        return self.rows.alloc_decode(seq_lens_cpu, last_loc)

    def alloc_logical_only(self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens):
        """PD direct-to-host admission: logical locations (= host rows) only."""
        self._release_quarantine()
        return self.rows.alloc_extend(prefix_lens_cpu, seq_lens_cpu, last_loc, with_device_rows=False)

    def free(self, free_index: torch.Tensor):
        if free_index.numel() == 0:
            return
        if self._held_frees is not None:
            self._held_frees.append(free_index.clone())  # the caller may reuse the tensor
            return
        free_index = self.quarantine.intercept(free_index)
        if free_index.numel():
            self.rows.free(free_index)

    def free_group_begin(self):
        self._held_frees = []

    def free_group_end(self):
        held, self._held_frees = self._held_frees, None
        if held:
            self.free(torch.cat(held))

    # ---------------------------------------------------------------- PD decode retraction
    def get_cpu_copy(self, indices, mamba_indices=None, req_pool_index=None):
        """Copy of a retracted request's KV for SGLang to keep until it resumes (PD decode).

        The coordinator's ``retract_req`` has completed the request's host rows; they and the
        request's indexer-key pages are copied to plain CPU memory (its locations are freed and
        reused right after).

        Args:
            indices: the request's logical locations, positions ``[0, seqlen - 1)``.
            mamba_indices, req_pool_index: SGLang's other arguments (``req_pool_index`` from 0.5.20);
                unused.
        Returns:
            ``{"kv": [layer uint8 [n, row bytes]], "index_k": [layer uint8 [pages, page bytes]]}``.
        """
        host_pool = self._host_pool()
        if torch.device(self.device).type == "cuda":
            torch.cuda.synchronize(self.device)  # the retraction backup and any staging copy
        locs = indices.to(device="cpu", dtype=torch.int64)
        return {
            "kv": [layer[locs] for layer in host_pool.layers],
            "index_k": self._kvcache.index_k_to_cpu(indices),
        }

    def load_cpu_copy(self, kv_cache_cpu, indices, mamba_indices=None, req_pool_index=None):
        """Restore :meth:`get_cpu_copy`'s copy at the resumed request's new locations; SGLang then
        admits the request like a PD transfer (``admit_request_direct``, hooked on load_kv_cache).
        With a host pool shared by the TP ranks only its writer writes, and the others wait for it."""
        host_pool = self._host_pool()
        locs = indices.to(device="cpu", dtype=torch.int64)
        kv = kv_cache_cpu["kv"]
        if len(kv) != host_pool.layer_num or any(part.shape[0] != locs.numel() for part in kv):
            raise UnsupportedSetupError(
                f"retracted KV copy has {len(kv)} layers of {[part.shape[0] for part in kv][:1]} rows; the "
                f"resumed request has {host_pool.layer_num} layers and {locs.numel()} locations."
            )
        if host_pool.writable:
            for layer, part in zip(host_pool.layers, kv):
                layer[locs] = part
        self.runtime.coordinator.publish_host_writes()
        self._kvcache.load_index_k(kv_cache_cpu["index_k"], indices)

    def _host_pool(self):
        if not self.runtime.started:
            raise UnsupportedSetupError(
                "the HiSparse coordinator does not exist yet; retracted KV cannot be copied before the model "
                "runner built it."
            )
        return self.runtime.coordinator.host_pool

    def clear(self):
        self.quarantine.clear()
        self.rows.clear()
        self._held_frees = None
