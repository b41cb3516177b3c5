"""The host KV pool: one region of rows per layer, in pinned memory when CUDA is present.

Row ``i`` of every layer holds the KV of SGLang's logical token location ``i``: the host pool is
indexed by the logical location itself, so the logical allocator is also the host-row allocator
and SGLang's own capacity accounting covers host memory (a request admitted by SGLang can never
run out of host rows half-way through, the failure of SGLang issue #23704).

Byte layout of a row (what the prefill instance writes in PD disaggregation):
  * bf16 MLA: 512 latent + 64 rope values, bf16 -> 1152 bytes;
  * DSA fp8 ("V32" FlashMLA layout): 512 fp8 latent, 4 fp32 scales, 64 bf16 rope -> 656 bytes.
A page of ``page_size`` rows sits at byte offset ``page * page_size * item_bytes`` of its layer.
"""

from __future__ import annotations

import logging

import torch

from hisparse_sglang.errors import HiSparseMemoryError
from hisparse_sglang.memory.pinning import REGISTER_ALIGN, CudaRegistrar, HostRegion

__all__ = ["HostKVPool", "BF16_MLA_ITEM_BYTES", "FP8_DSA_ITEM_BYTES"]

logger = logging.getLogger(__name__)

BF16_MLA_ITEM_BYTES = (512 + 64) * 2
FP8_DSA_ITEM_BYTES = 512 + 4 * 4 + 64 * 2


class HostKVPool:
    """``layer_num`` regions of ``num_rows`` rows of ``item_bytes`` bytes each.

    All layers live in one host region (memory/pinning.py: touched by a thread pool, then pinned
    layer by layer from the same pool, with a progress line every few seconds); pinned, each layer
    starts on a 2 MiB boundary, so that its registration shares no page with another layer's.

    Args:
        layer_num: layers (one region each).
        num_rows: rows per layer; the logical token space of SGLang plus its padding page.
        item_bytes: bytes per row (1152 bf16 MLA, 656 DSA fp8).
        pin: pin the regions (page-locked, device-accessible); default: when CUDA is available.
        device: the GPU whose context registers the memory (default: the current one); the memory
            is portable, usable from every GPU of the process.
        threads: threads that touch and pin (default: memory.pinning.default_threads()).

    Attributes:
        layers: ``layer_num`` uint8 tensors of shape ``[num_rows, item_bytes]``.
    """

    def __init__(
        self,
        layer_num: int,
        num_rows: int,
        item_bytes: int,
        pin: bool | None = None,
        device: torch.device | None = None,
        threads: int | None = None,
    ) -> None:
        if layer_num < 1 or num_rows < 1 or item_bytes < 1:
            raise HiSparseMemoryError(
                f"host pool needs positive sizes, got layer_num={layer_num}, num_rows={num_rows}, "
                f"item_bytes={item_bytes}."
            )
        if item_bytes % 16:
            raise HiSparseMemoryError(
                f"host pool rows must be a multiple of 16 bytes for vectorised copies, got item_bytes={item_bytes}."
            )
        if pin is None:
            pin = torch.cuda.is_available()
        self.layer_num = layer_num
        self.num_rows = num_rows
        self.item_bytes = item_bytes
        self.pinned = pin
        layer_bytes = num_rows * item_bytes
        # Pinned layers start on a registration boundary; pageable ones only on a cache line.
        align = REGISTER_ALIGN if pin else 64
        stride = -(-layer_bytes // align) * align
        total = layer_num * layer_bytes
        logger.info(
            "HiSparse host pool: %d layers x %d rows x %d B = %.2f GiB%s",
            layer_num, num_rows, item_bytes, total / 2**30, " (pinned)" if pin else "",
        )
        registrar = CudaRegistrar(device if device is not None else torch.device("cuda")) if pin else None
        self.region = HostRegion(
            stride * layer_num,
            register_units=[(layer * stride, stride) for layer in range(layer_num)],
            registrar=registrar,
            threads=threads,
        )
        self.layers: list[torch.Tensor] = [
            self.region.tensor[layer * stride : layer * stride + layer_bytes].view(num_rows, item_bytes)
            for layer in range(layer_num)
        ]
        timing = self.region.timing
        ready = timing.touch_s + timing.register_s
        logger.info(
            "HiSparse host pool: %.2f GiB ready in %.1f s (%.1f GiB/s; touched in %.1f s%s, %d threads)",
            total / 2**30, ready, total / 2**30 / max(ready, 1e-9), timing.touch_s,
            f", pinned in {timing.register_s:.1f} s" if pin else "", self.region.threads,
        )

    @property
    def nbytes(self) -> int:
        return self.layer_num * self.num_rows * self.item_bytes

    def region_infos(self) -> tuple[list[int], list[int]]:
        """Per-layer base addresses and byte lengths (for registration with a transfer engine)."""
        return [t.data_ptr() for t in self.layers], [t.numel() for t in self.layers]

    def read_rows(self, layer_id: int, rows: torch.Tensor) -> torch.Tensor:
        """Copy of the given rows of one layer (uint8 ``[n, item_bytes]``)."""
        return self.layers[layer_id][rows.to(device="cpu", dtype=torch.int64)]

    def write_rows(self, layer_id: int, rows: torch.Tensor, data: torch.Tensor) -> None:
        self.layers[layer_id][rows.to(device="cpu", dtype=torch.int64)] = data.to(device="cpu", dtype=torch.uint8)
