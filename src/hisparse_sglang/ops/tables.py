"""The tables one layer's swap-in reads and updates, as one typed object.

The swap-in op and its reference twin take the batch (``top_k``, ``seq_lens``, ``req_pool_indices``,
``num_real_reqs``) and one :class:`SwapInTables`; the coordinator builds one per layer when it
starts (every field is a fixed tensor or a view of one), tests and benchmarks build them from their
cases. Shapes: ``R`` request slots, ``C`` context capacity per slot, ``N`` logical locations,
``NB`` device buffers, ``D`` LRU slots per buffer, ``P`` page size.
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["SwapInTables"]


@dataclasses.dataclass(frozen=True)
class SwapInTables:
    """One layer's swap-in tables (the CUDA op wants every tensor on the GPU but ``host_kv``, pinned).

    Attributes:
        req_to_token: int32 ``[R, C]``, logical location (= host row) of each position of each slot.
        device_row_of_loc: int32 ``[N + 1]``, device row of a logical location while it is on the GPU,
            0 when it is not; the last entry is -1 (location -1, padding).
        buffer_of_req: int32 ``[R]``, buffer of an offloaded request slot, -1 for a resident one.
        slot_rows: int32 ``[NB, D + P]``, device row behind each buffer slot (slot ``D`` holds the newest token).
        slot_tokens: int32 ``[NB, D]``, this layer's token position held by each LRU slot, -1 if empty.
        slot_stamps: int32 ``[NB, D]``, this layer's step of each slot's last use.
        token_slot: int16 ``[NB, C']`` with ``C' > C``, this layer's map from position to slot, -1 if none.
        host_kv: ``[N, row bytes]`` this layer's host rows.
        device_kv: ``[rows, row bytes]`` this layer's device rows.
    """

    req_to_token: torch.Tensor
    device_row_of_loc: torch.Tensor
    buffer_of_req: torch.Tensor
    slot_rows: torch.Tensor
    slot_tokens: torch.Tensor
    slot_stamps: torch.Tensor
    token_slot: torch.Tensor
    host_kv: torch.Tensor
    device_kv: torch.Tensor

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The fields in the CUDA binding's argument order."""
        return tuple(getattr(self, field.name) for field in dataclasses.fields(self))
