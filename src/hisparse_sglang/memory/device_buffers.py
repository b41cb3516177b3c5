"""GPU buffers of offloaded requests: the tables the swap-in kernel reads and updates.

An offloaded request owns one buffer: ``D = device_buffer_size`` LRU slots plus one page of
``P`` slots whose first slot holds the newest token (the other ``P - 1`` are spare). Each slot is
a device KV row, the same row index in every layer's KV tensor, so the slot -> row table is per
buffer. What a slot holds differs by layer (each layer selects its own top-k), so the slot ->
token table, the LRU clock and the token -> slot map are per layer and buffer.

Buffers are numbered independently of SGLang's request slots: at most
``min(request slots, device rows // (D + P))`` requests can be offloaded at once, so the per-layer
tables are sized by that bound.

Tables (all on ``device``):
  * ``buffer_of_req``  int32 ``[R]``: buffer id of request slot ``r``, -1 if it has none
    (the request is resident, or not decoding).
  * ``slot_rows``      int32 ``[NB, D + P]``: device row of each slot.
  * ``slot_tokens``    int32 ``[L, NB, D]``: token position held by LRU slot, -1 = empty.
  * ``slot_stamps``    int32 ``[L, NB, D]``: LRU clock of each slot, the request's ``seq_len`` at
    its last use (0 when the buffer is acquired).
  * ``token_slot``     int16 ``[L, NB, C + 1]``: slot holding each position (the inverse of
    ``slot_tokens``), -1 none; ``C`` is the context capacity of a request slot, column ``C`` is
    scratch. It lets the swap-in kernel find a hit with one load instead of a pass over every
    slot; it costs ``2 * C`` bytes per layer and buffer (see :meth:`table_bytes`).
"""

from __future__ import annotations

import torch

from hisparse_sglang.errors import HiSparseMemoryError, PoolExhaustedError

__all__ = ["DeviceBufferPool"]


class DeviceBufferPool:
    def __init__(
        self,
        layer_num: int,
        num_req_slots: int,
        num_buffers: int,
        buffer_size: int,
        page_size: int,
        context_len: int,
        device: torch.device | str = "cpu",
    ) -> None:
        if num_buffers < 1:
            raise HiSparseMemoryError(
                f"the device pool cannot hold a single buffer of {buffer_size + page_size} rows "
                f"(device_buffer_size {buffer_size} + page {page_size}); lower device_buffer_size or "
                f"give the KV pool more GPU memory."
            )
        self.layer_num = layer_num
        self.num_req_slots = num_req_slots
        self.num_buffers = num_buffers
        self.buffer_size = buffer_size
        self.page_size = page_size
        self.padded_size = buffer_size + page_size
        self.context_len = context_len
        self.device = torch.device(device)
        self.buffer_of_req = torch.full((num_req_slots,), -1, dtype=torch.int32, device=self.device)
        self.slot_rows = torch.zeros((num_buffers, self.padded_size), dtype=torch.int32, device=self.device)
        self.slot_tokens = torch.full(
            (layer_num, num_buffers, buffer_size), -1, dtype=torch.int32, device=self.device
        )
        self.slot_stamps = torch.zeros((layer_num, num_buffers, buffer_size), dtype=torch.int32, device=self.device)
        self.token_slot = torch.full(
            (layer_num, num_buffers, context_len + 1), -1, dtype=torch.int16, device=self.device
        )
        self._slot_ids = torch.arange(buffer_size, dtype=torch.int16, device=self.device)
        self._free_ids = list(range(num_buffers - 1, -1, -1))
        self._buffer_of_req_cpu = [-1] * num_req_slots

    @staticmethod
    def table_bytes(layer_num: int, num_req_slots: int, num_buffers: int, buffer_size: int, page_size: int,
                    context_len: int) -> int:
        """GPU bytes of the tables of a pool of this shape."""
        per_buffer = layer_num * (buffer_size * (4 + 4) + (context_len + 1) * 2) + (buffer_size + page_size) * 4
        return num_req_slots * 4 + num_buffers * per_buffer

    @property
    def free_buffers(self) -> int:
        return len(self._free_ids)

    @property
    def used_buffers(self) -> int:
        return self.num_buffers - len(self._free_ids)

    def buffer_of(self, req_slot: int) -> int:
        return self._buffer_of_req_cpu[req_slot]

    def acquire(self, req_slot: int, rows: torch.Tensor, first_token: int | None) -> int:
        """Give request slot ``req_slot`` a buffer made of ``rows``.

        Args:
            rows: ``D + P`` distinct device rows (any integer dtype, on ``device``); row ``i`` backs
                slot ``i``, row ``D`` holds the newest token.
            first_token: if not None, LRU slot ``i`` already holds token ``first_token + i`` in every
                layer (the rows were the request's own resident rows); None marks all slots empty.
                Every slot starts with stamp 0, so the lowest slots (oldest tokens) go first.

        Returns:
            the buffer id.
        """
        if self._buffer_of_req_cpu[req_slot] != -1:
            raise HiSparseMemoryError(f"request slot {req_slot} already owns buffer {self._buffer_of_req_cpu[req_slot]}.")
        if rows.numel() != self.padded_size:
            raise HiSparseMemoryError(
                f"a buffer needs {self.padded_size} rows (device_buffer_size {self.buffer_size} + page {self.page_size}), "
                f"got {rows.numel()}."
            )
        if not self._free_ids:
            raise PoolExhaustedError(f"all {self.num_buffers} device buffers are in use.")
        if first_token is not None and not 0 <= first_token <= self.context_len - self.buffer_size:
            raise HiSparseMemoryError(
                f"first_token {first_token}: positions {first_token}..{first_token + self.buffer_size - 1} "
                f"do not fit the context capacity {self.context_len}."
            )
        buffer_id = self._free_ids.pop()
        # Python scalars go through fill_ (a kernel argument): with `t[i] = scalar` (the scalar
        # travels as a CPU tensor) this function waited 16-26 ms behind a running prefill on an H100.
        self.slot_rows[buffer_id].copy_(rows.reshape(-1).to(device=self.device, dtype=torch.int32))
        if first_token is None:
            self.slot_tokens[:, buffer_id].fill_(-1)
        else:
            tokens = torch.arange(first_token, first_token + self.buffer_size, dtype=torch.int32, device=self.device)
            self.slot_tokens[:, buffer_id].copy_(tokens.expand(self.layer_num, -1))
            self.token_slot[:, buffer_id, first_token : first_token + self.buffer_size].copy_(
                self._slot_ids.expand(self.layer_num, -1)
            )
        self.slot_stamps[:, buffer_id].zero_()
        self.buffer_of_req[req_slot : req_slot + 1].fill_(buffer_id)
        self._buffer_of_req_cpu[req_slot] = buffer_id
        return buffer_id

    def release(self, req_slot: int) -> torch.Tensor:
        """Take request slot ``req_slot``'s buffer away; returns its rows (int64, on ``device``)."""
        buffer_id = self._buffer_of_req_cpu[req_slot]
        if buffer_id == -1:
            raise HiSparseMemoryError(f"request slot {req_slot} owns no buffer.")
        rows = self.slot_rows[buffer_id].to(torch.int64)
        self.slot_rows[buffer_id].fill_(0)
        # Clear the map entries of the held tokens (empty slots write the scratch column), then the slots.
        held = self.slot_tokens[:, buffer_id].to(torch.int64)
        held = torch.where(held >= 0, held, self.context_len)
        self.token_slot[:, buffer_id].scatter_(1, held, -1)
        self.slot_tokens[:, buffer_id].fill_(-1)
        self.buffer_of_req[req_slot : req_slot + 1].fill_(-1)
        self._buffer_of_req_cpu[req_slot] = -1
        self._free_ids.append(buffer_id)
        return rows

    def newest_row(self, req_slot: int) -> torch.Tensor:
        """The device row of the newest-token slot (int64 scalar tensor on ``device``)."""
        return self.slot_rows[self._buffer_of_req_cpu[req_slot], self.buffer_size].to(torch.int64)
