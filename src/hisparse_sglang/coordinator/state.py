"""What the coordinator knows of each request: its mode, its length, its copies in flight.

The decode step reads and writes every request of a batch, so the fields it touches on every step
(length, mode, when it next needs a binding) live in :class:`SlotTable`'s lists indexed by request
slot; :class:`RequestRecord` is the view the rest of the coordinator works with.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from hisparse_sglang.streams import CopyEvent

if TYPE_CHECKING:
    from hisparse_sglang.coordinator.staging import StagedCopy

__all__ = [
    "RESIDENT", "OFFLOADED", "DECODE_STEPS", "VERIFY_STEPS", "Promotion", "SpecState", "SlotTable", "RequestRecord",
]

RESIDENT = "resident"
OFFLOADED = "offloaded"

# What a coordinator serves, fixed by its first step (Coordinator._enter_step_kind).
DECODE_STEPS = "plain decode steps"
VERIFY_STEPS = "speculative verify steps"


@dataclasses.dataclass
class Promotion:
    """An offloaded request's copy back to fresh device pages, in flight."""

    pages: torch.Tensor  # device pages, page k holds positions [k * P, (k + 1) * P)
    covered: int  # positions [0, covered) are being copied host -> device
    event: CopyEvent


@dataclasses.dataclass
class SpecState:
    """What the coordinator keeps of a request that verifies speculative drafts (coordinator/speculative.py).

    The request's ``seq_len`` is then ``c``, the committed length the scheduler knows on the host: a
    lower bound of the device's committed length ``s`` (the accept lengths stay on the device; under
    SGLang's overlap scheduler the host learns them one verify late).

    Attributes:
        allocated_len: positions ``[0, allocated_len)`` have logical locations (SGLang's
            ``kv_allocated_len``, the committed tokens plus the speculative reserve). A resident
            request's device pages are mapped whole up to it; it bounds every unmap of the request.
        wanted_len: the ``allocated_len`` of the verify step being prepared; equal to
            ``allocated_len`` between steps.
        slot_d_stale: offloaded only: slot ``D`` of the buffer may not hold position ``s - 1`` (after a
            demotion decided with ``c < s``, or a PD admission); the next prepare copies the host row
            of ``s - 1`` into it.
    """

    allocated_len: int
    wanted_len: int
    slot_d_stale: bool = False


class SlotTable:
    """What the decode step reads and writes of every request, in lists indexed by request slot.

    The decode step checks and advances each request of the batch with two list loads and a
    compare (no dict lookup, no attribute access, no numpy call: in the scheduler's loop, between
    the model's launches, numpy's per-call overhead measured several times that of these loops).

    Attributes:
        seq_len: the length of each admitted request.
        next_len: ``seq_len + 1`` for a request released for decoding, else :data:`NOT_DECODING`
            (unknown, staging or finished), so that one comparison with a batch's length checks
            both. Twice as long as the slots: a negative slot (Python indexes from the end) lands
            in the second half, which is never decoding.
        bind_at: the smallest length at which a request's new token must be bound: 0 for an
            offloaded request (every step, to slot ``D``), the length whose new token starts its
            next page for a resident one.
        offloaded: whether each request is offloaded.
        num_offloaded: how many are.
    """

    NOT_DECODING = -1

    def __init__(self, num_slots: int, page_size: int) -> None:
        self.page_size = page_size
        self.seq_len = [0] * num_slots
        self.next_len = [self.NOT_DECODING] * (2 * num_slots)
        self.bind_at = [0] * num_slots
        self.offloaded = [False] * num_slots
        self.num_offloaded = 0

    def admit(self, slot: int, seq_len: int, decoding: bool) -> None:
        self.set_offloaded(slot, False)
        self.seq_len[slot] = seq_len
        self.next_len[slot] = seq_len + 1 if decoding else self.NOT_DECODING
        self._update_bind_at(slot)

    def release_for_decoding(self, slots: list[int]) -> None:
        for slot in slots:
            self.next_len[slot] = self.seq_len[slot] + 1

    def forget(self, slot: int) -> None:
        self.set_offloaded(slot, False)
        self.next_len[slot] = self.NOT_DECODING

    def set_len(self, slot: int, seq_len: int) -> None:
        self.seq_len[slot] = seq_len
        if self.next_len[slot] != self.NOT_DECODING:
            self.next_len[slot] = seq_len + 1
        self._update_bind_at(slot)

    def set_offloaded(self, slot: int, offloaded: bool) -> None:
        if self.offloaded[slot] != offloaded:
            self.offloaded[slot] = offloaded
            self.num_offloaded += 1 if offloaded else -1
            self._update_bind_at(slot)

    def advance(self, slots, seq_lens, bound: list[int]) -> None:
        """A decode step took ``slots`` to ``seq_lens``; a resident request among the ``bound``
        batch rows started a page and binds next at its next page start."""
        seq_len, next_len = self.seq_len, self.next_len
        for slot, length in zip(slots, seq_lens):
            seq_len[slot] = length
            next_len[slot] = length + 1
        for row in bound:
            slot = slots[row]
            if not self.offloaded[slot]:
                self.bind_at[slot] = self.next_page_start_len(seq_lens[row])

    def next_page_start_len(self, seq_len: int) -> int:
        """The length at which a resident request's next new token (position >= seq_len) starts a page."""
        return -(-seq_len // self.page_size) * self.page_size + 1

    def _update_bind_at(self, slot: int) -> None:
        self.bind_at[slot] = 0 if self.offloaded[slot] else self.next_page_start_len(self.seq_len[slot])


class RequestRecord:
    """The coordinator's view of one request (CPU only); its length and mode live in the
    coordinator's :class:`SlotTable`.

    Attributes:
        slot: SGLang request-pool slot.
        seq_len: positions ``[0, seq_len)`` have KV (the last one may be written by the forward in
            flight). All of them are on the host once the prefill's staging copy and the forward
            that wrote the newest one are done.
        mode: RESIDENT or OFFLOADED.
        staging: copy of the prefill KV to the host, while it may be in flight (a
            :class:`~hisparse_sglang.coordinator.staging.StagedCopy` while its enqueue may be pending).
        promotion: an offloaded request's promotion in flight.
        mode_step: coordinator step of the last mode switch.
        spec: the speculative state once the request has verified drafts (None before, and always
            for a request served by plain decode steps).
    """

    __slots__ = ("slot", "staging", "promotion", "mode_step", "spec", "_table")

    def __init__(self, table: SlotTable, slot: int, seq_len: int, decoding: bool,
                 staging: CopyEvent | StagedCopy | None = None, mode_step: int = 0) -> None:
        self._table = table
        self.slot = slot
        self.staging = staging
        self.promotion: Promotion | None = None
        self.mode_step = mode_step
        self.spec: SpecState | None = None
        table.admit(slot, seq_len, decoding)

    @property
    def seq_len(self) -> int:
        return self._table.seq_len[self.slot]

    @seq_len.setter
    def seq_len(self, value: int) -> None:
        self._table.set_len(self.slot, value)

    @property
    def allocated_len(self) -> int:
        """Positions whose locations the request holds: ``seq_len`` for plain decode steps, the
        speculative reserve (``SpecState.allocated_len``) once it verifies drafts. Every unmap of
        the request's locations and a promotion's mapping are bounded by it."""
        spec = self.spec
        return self._table.seq_len[self.slot] if spec is None else spec.allocated_len

    @property
    def mode(self) -> str:
        return OFFLOADED if self._table.offloaded[self.slot] else RESIDENT

    @mode.setter
    def mode(self, value: str) -> None:
        self._table.set_offloaded(self.slot, value == OFFLOADED)

    def __repr__(self) -> str:
        return f"RequestRecord(slot={self.slot}, seq_len={self.seq_len}, mode={self.mode})"
