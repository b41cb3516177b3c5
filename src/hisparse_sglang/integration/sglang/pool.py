"""The DSA token-to-KV pool SGLang builds when HiSparse is on (replaces HiSparseDSATokenToKVPool).

It is SGLang's own DSATokenToKVPool (PD index-K registration and the DSA backend rely on that
class) whose KV reads and writes go through HiSparse's location -> device-row table: the model
writes a token's KV at its logical location, which lands in the device row the allocator or the
coordinator bound to it. The indexer's key cache stays indexed by logical location and covers the
whole logical space (``size * host_to_device_ratio``), like SGLang's in-tree pool.
"""

from __future__ import annotations

from typing import Optional

import torch
from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool

from hisparse_sglang.errors import UnsupportedSetupError
from hisparse_sglang.integration.sglang import compat
from hisparse_sglang.integration.sglang.runtime import HiSparseRuntime, PerForward

__all__ = ["HiSparseDevicePool"]


class HiSparseDevicePool(DSATokenToKVPool):
    """Constructor arguments are those of SGLang's HiSparseDSATokenToKVPool.

    ``dsa_pool_kwargs`` are the arguments later releases added and SGLang passes through to
    DSATokenToKVPool unchanged: ``index_kpool``, ``index_kpool_compress``, ``tail_extra_slots``,
    ``max_running_requests`` (0.5.20+), ``skip_topk_layers`` (never under HiSparse) and
    ``dcp_replicated`` (0.5.22+, only with decode context parallelism, which validation refuses).
    """

    def __init__(
        self,
        size: int,
        page_size: int,
        kv_lora_rank: int,
        dtype: torch.dtype,
        qk_rope_head_dim: int,
        layer_num: int,
        device: str,
        index_head_dim: int,
        enable_memory_saver: bool,
        kv_cache_dim: int,
        start_layer: Optional[int] = None,
        end_layer: Optional[int] = None,
        host_to_device_ratio: int = 2,
        **dsa_pool_kwargs,
    ):
        super().__init__(
            size=size,
            page_size=page_size,
            kv_lora_rank=kv_lora_rank,
            dtype=dtype,
            qk_rope_head_dim=qk_rope_head_dim,
            layer_num=layer_num,
            device=device,
            index_head_dim=index_head_dim,
            enable_memory_saver=enable_memory_saver,
            kv_cache_dim=kv_cache_dim,
            start_layer=start_layer,
            end_layer=end_layer,
            index_buf_size=size * host_to_device_ratio,
            **dsa_pool_kwargs,
        )
        self.host_to_device_ratio = host_to_device_ratio
        self.bytes_per_token = self.kv_cache_dim * self.store_dtype.itemsize
        # The device rows of a forward's KV-write locations (see _write_rows).
        self._written_rows = PerForward()
        # The process's HiSparse state starts here: SGLang builds this pool first and hands it to
        # the allocator (as kvcache) and to the model runner.
        self.runtime = HiSparseRuntime(host_to_device_ratio)
        self.runtime.attach_pool(self)

    def kv_rows(self) -> list[torch.Tensor]:
        """Per-layer views of the KV buffers as byte rows: uint8 ``[rows, bytes_per_token]``."""
        return [buffer.view(buffer.shape[0], -1).view(torch.uint8) for buffer in self.kv_buffer]

    # ---------------------------------------------------------------- translation (SGLang's names)
    def translate_loc_to_hisparse_device(self, loc: torch.Tensor) -> torch.Tensor:
        """Device rows of logical locations, same shape; -1 stays -1 (extend page tables). Inside a
        TARGET_VERIFY ``forward_extend`` on 0.5.17 - 0.5.21 (hook H4): the verify swap-in's rows instead."""
        rows = self.runtime.take_verify_rows(loc)
        if rows is not None:
            return rows
        return self.runtime.device_row_of_loc[loc.to(torch.int64)]

    _translate_loc_to_hisparse_device = translate_loc_to_hisparse_device
    translate_loc_from_full_to_hisparse_device = translate_loc_to_hisparse_device

    def translate_loc_from_full_to_compressed(self, loc: torch.Tensor) -> torch.Tensor:
        return loc

    def _rows_of(self, loc: torch.Tensor) -> torch.Tensor:
        return self.runtime.device_row_of_loc[loc.to(torch.int64)].to(torch.int64)

    def _write_rows(self, layer, loc_info) -> torch.Tensor:
        """Device rows of a KV write's logical locations, gathered once per forward (:class:`PerForward`).

        Every layer of a forward writes its KV at the same locations (the batch's ``out_cache_loc``, one
        tensor), whose rows nothing rebinds during the forward (the allocator and the coordinator bind them
        before it): one gather and one cast per forward instead of per layer.
        """
        loc = compat.write_locations(loc_info)
        return self._written_rows.get(loc, layer.layer_id == self.start_layer, lambda: self._rows_of(loc))

    # ---------------------------------------------------------------- KV access through the table
    def set_kv_buffer(self, layer, loc, cache_k, cache_v):
        super().set_kv_buffer(layer, self._write_rows(layer, loc), cache_k, cache_v)

    def set_mla_kv_buffer(self, layer, loc, cache_k_nope, cache_k_rope):
        super().set_mla_kv_buffer(layer, self._write_rows(layer, loc), cache_k_nope, cache_k_rope)

    def get_mla_kv_buffer(self, layer, loc, dst_dtype=None):
        return super().get_mla_kv_buffer(layer, self._rows_of(loc), dst_dtype)

    # ---------------------------------------------------------------- indexer keys (PD decode retraction)
    def index_k_pages(self, locs: torch.Tensor) -> torch.Tensor:
        """Index-K page ids (int64, on the pool's device) of a request's locations.

        Args:
            locs: a request's logical locations in position order, from a page start (its
                ``req_to_token`` row), on any device.
        """
        locs = locs.to(device=self.index_k_with_scale_buffer[0].device, dtype=torch.int64)
        if locs.numel() and int(locs[0]) % self.page_size:
            raise UnsupportedSetupError(
                f"the request's first location ({int(locs[0])}) is not at a page start (page size "
                f"{self.page_size}); its indexer keys cannot be copied page-wise."
            )
        return locs[:: self.page_size] // self.page_size

    def index_k_to_cpu(self, locs: torch.Tensor) -> list[torch.Tensor]:
        """Per layer: uint8 ``[pages, bytes per page]`` CPU copy of the locations' indexer keys."""
        pages = self.index_k_pages(locs)
        return [buffer[pages].cpu() for buffer in self.index_k_with_scale_buffer]

    def load_index_k(self, pages_cpu: list[torch.Tensor], locs: torch.Tensor) -> None:
        """Write :meth:`index_k_to_cpu`'s copies back, at the pages of (new) locations ``locs``."""
        pages = self.index_k_pages(locs)
        if len(pages_cpu) != len(self.index_k_with_scale_buffer):
            raise UnsupportedSetupError(
                f"indexer-key copy has {len(pages_cpu)} layers, the pool {len(self.index_k_with_scale_buffer)}."
            )
        for buffer, data in zip(self.index_k_with_scale_buffer, pages_cpu):
            if data.shape[0] != pages.numel():
                raise UnsupportedSetupError(
                    f"indexer-key copy holds {data.shape[0]} pages but the request now has {pages.numel()}."
                )
            buffer[pages] = data.to(buffer.device, non_blocking=False)

    def get_cpu_copy(self, indices, mamba_indices=None, req_pool_index=None):
        """Guard: the KV of logical locations lives in the host pool, not at ``kv_buffer[indices]``;
        SGLang copies it through the allocator (``HiSparseTokenAllocator.get_cpu_copy``)."""
        raise UnsupportedSetupError(
            "HiSparseDevicePool.get_cpu_copy was called directly; the KV of logical locations is in the "
            "HiSparse host pool. Call the token allocator's get_cpu_copy instead."
        )

    def load_cpu_copy(self, kv_cache_cpu, indices, mamba_indices=None, req_pool_index=None):
        self.get_cpu_copy(indices)
