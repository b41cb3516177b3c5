"""The host KV pool: one region of rows per layer, in pinned memory when CUDA is present.

Row ``i`` of every layer holds the KV of SGLang's logical token location ``i``: the host pool is
indexed by the logical location itself, so the logical allocator is also the host-row allocator
and SGLang's own capacity accounting covers host memory (a request admitted by SGLang can never
run out of host rows half-way through, the failure of SGLang issue #23704).

Byte layout of a row (what the prefill instance writes in PD disaggregation):
  * bf16 MLA: 512 latent + 64 rope values, bf16 -> 1152 bytes;
  * DSA fp8 ("V32" FlashMLA layout): 512 fp8 latent, 4 fp32 scales, 64 bf16 rope -> 656 bytes.
A page of ``page_size`` rows sits at byte offset ``page * page_size * item_bytes`` of its layer.

A pool is private to its process, or one segment shared by the tensor-parallel ranks of a node
(memory/shared_host_pool.py): one process writes it (``writable``), the others only read it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from hisparse_sglang.errors import HiSparseMemoryError
from hisparse_sglang.memory.pinning import REGISTER_ALIGN, CudaRegistrar, HostRegion

if TYPE_CHECKING:
    from hisparse_sglang.memory.shared_host_pool import SharedSegment

__all__ = ["HostKVPool", "BF16_MLA_ITEM_BYTES", "FP8_DSA_ITEM_BYTES", "layer_stride"]

logger = logging.getLogger(__name__)

BF16_MLA_ITEM_BYTES = (512 + 64) * 2
FP8_DSA_ITEM_BYTES = 512 + 4 * 4 + 64 * 2


def layer_stride(layer_bytes: int, pinned: bool) -> int:
    """Bytes from one layer's start to the next: pinned layers start on a registration boundary
    (no registration shares a page with another layer's), pageable ones on a cache line."""
    align = REGISTER_ALIGN if pinned else 64
    return -(-layer_bytes // align) * align


class HostKVPool:
    """``layer_num`` regions of ``num_rows`` rows of ``item_bytes`` bytes each.

    All layers live in one host region (memory/pinning.py: cut into pieces within layers, each
    touched and then pinned by one thread of a pool, with a progress line every few seconds);
    pinned, each layer starts on a 2 MiB boundary, so that no registration shares a page with
    another layer's.

    Args:
        layer_num: layers (one region each).
        num_rows: rows per layer; the logical token space of SGLang plus its padding page.
        item_bytes: bytes per row (1152 bf16 MLA, 656 DSA fp8).
        pin: pin the regions (page-locked, device-accessible); default: when CUDA is available.
        device: the GPU whose context registers the memory (default: the current one); the memory
            is portable, usable from every GPU of the process.
        threads: threads that touch and pin (default: memory.pinning.default_threads()).
        segment: a segment shared with the other TP ranks of the node to lay the layers in, after
            its header (memory/shared_host_pool.py builds it); None: a private anonymous mapping.

    Attributes:
        layers: ``layer_num`` uint8 tensors of shape ``[num_rows, item_bytes]``.
        writable: whether this process writes the rows (False: a reader of a shared segment, whose
            rows another process writes; the coordinator then skips every host write).
        shared: whether other processes map the same rows.
    """

    def __init__(
        self,
        layer_num: int,
        num_rows: int,
        item_bytes: int,
        pin: bool | None = None,
        device: torch.device | None = None,
        threads: int | None = None,
        segment: "SharedSegment | None" = None,
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
        self.segment = segment
        self.writable = segment is None or segment.writable
        self.shared = segment is not None
        layer_bytes = num_rows * item_bytes
        stride = layer_stride(layer_bytes, pin)
        start = 0 if segment is None else segment.check_layout(layer_num, num_rows, item_bytes, stride)
        total = layer_num * layer_bytes
        logger.info(
            "HiSparse host pool: %d layers x %d rows x %d B = %.2f GiB%s%s",
            layer_num, num_rows, item_bytes, total / 2**30, " (pinned)" if pin else "",
            "" if segment is None else f" in shared segment {segment.name} ({'writer' if self.writable else 'reader'})",
        )
        registrar = CudaRegistrar(device if device is not None else torch.device("cuda")) if pin else None
        self.region = HostRegion(
            start + stride * layer_num,
            register_units=[(start + layer * stride, stride) for layer in range(layer_num)],
            registrar=registrar,
            threads=threads,
            mapping=None if segment is None else segment.mapping,
            touch=segment is None or (segment.writable and not segment.touched),
        )
        self.layers: list[torch.Tensor] = [
            self.region.tensor[start + layer * stride : start + layer * stride + layer_bytes].view(num_rows, item_bytes)
            for layer in range(layer_num)
        ]
        timing = self.region.timing
        ready = timing.ready_s
        # touched / pinned: each thread's time touching / registering, averaged (memory/pinning._Timing).
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
        if not self.writable:
            raise HiSparseMemoryError(
                f"this process only reads the shared host pool (segment {self.segment.name}); its writer "
                f"(pid {self.segment.owner_pid}) writes the rows."
            )
        self.layers[layer_id][rows.to(device="cpu", dtype=torch.int64)] = data.to(device="cpu", dtype=torch.uint8)
