"""A fixed sequence of per-layer KV tensors that the CUDA ops can address by one pointer table."""

from __future__ import annotations

from typing import Iterable

import torch

__all__ = ["LayerSet", "row_bytes"]


class LayerSet(tuple):
    """The KV tensors of a pool, one per layer, fixed for the pool's lifetime.

    It is a tuple (the reference ops index it like a list). The CUDA row-copy op builds the
    device table of the layers' base pointers once per device and keeps it here, instead of
    reading every layer's pointer on each call (61 layers for DeepSeek-V3.2, every decode step).

    Attributes:
        pointer_tables: the uint64 table of base pointers per device, built by the CUDA ops (on the CPU: the
            one the host names to the copy engines).
        row_bytes: bytes of one row of the first layer (the layers of a pool share one layout); None
            without layers.
    """

    def __new__(cls, layers: Iterable[torch.Tensor]) -> "LayerSet":
        return super().__new__(cls, layers)

    def __init__(self, layers: Iterable[torch.Tensor]) -> None:
        self.pointer_tables: dict[torch.device, torch.Tensor] = {}
        self.row_bytes = row_bytes(self[0]) if self else None


def row_bytes(layer: torch.Tensor) -> int:
    """Bytes of one row (first dimension) of ``layer``."""
    return layer.numel() // max(layer.shape[0], 1) * layer.element_size()
