"""Whom to demote and whom to promote: the resident-first policy, as pure decisions.

Nothing here touches a tensor or a stream; the coordinator's mechanism (``core.py``) carries out
what these functions decide (docs/resident-first.md states the policy and its knobs).
"""

from __future__ import annotations

from typing import Iterable

from hisparse_sglang.config import HiSparseConfig
from hisparse_sglang.coordinator.state import OFFLOADED, RESIDENT, RequestRecord

__all__ = ["ModePolicy"]


class ModePolicy:
    """The decisions of resident-first (or of always-offload with ``resident_first`` off)."""

    def __init__(self, config: HiSparseConfig) -> None:
        self.config = config
        self.page_size = config.page_size
        self.buffer_size = config.device_buffer_size
        # A buffer is D LRU slots plus the page whose first slot holds the newest token.
        self.buffer_pages = (config.device_buffer_size + config.page_size) // config.page_size

    # ---------------------------------------------------------------- sizes
    def pages_held(self, record: RequestRecord) -> int:
        if record.mode == OFFLOADED:
            return self.buffer_pages
        return -(-record.allocated_len // self.page_size)

    def direct_admission_pages(self, kv_len: int) -> int:
        """Device pages a PD-transferred request takes: every page of its KV when it fits a buffer
        (it becomes resident), else one buffer (it starts offloaded)."""
        if self.fits_a_buffer(kv_len):
            return -(-kv_len // self.page_size)
        return self.buffer_pages

    def fits_a_buffer(self, kv_len: int) -> bool:
        return kv_len - 1 < self.buffer_size

    # ---------------------------------------------------------------- demotion
    def demotable(self, record: RequestRecord) -> bool:
        return record.mode == RESIDENT and record.promotion is None and record.seq_len - 1 >= self.buffer_size

    def starts_page(self, record: RequestRecord) -> bool:
        """A resident request whose next new token starts a page (it needs a fresh device page)."""
        return record.mode == RESIDENT and record.promotion is None and record.seq_len % self.page_size == 0

    def new_pages(self, record: RequestRecord) -> int:
        """Device pages a resident request takes for its new locations this step: one when a plain
        decode step's new token starts a page; under speculation, the pages of the reserve beyond
        those it holds (``SpecState.wanted_len`` against ``allocated_len``)."""
        spec = record.spec
        if spec is None:
            return 1 if self.starts_page(record) else 0
        if record.mode != RESIDENT:
            return 0
        return -(-spec.wanted_len // self.page_size) - -(-spec.allocated_len // self.page_size)

    def pages_needed_for_new_tokens(self, records: Iterable[RequestRecord]) -> int:
        return sum(self.new_pages(r) for r in records)

    def reclaimable_pages(self, records: Iterable[RequestRecord]) -> int:
        """Device pages demotions and promotion cancels could free now."""
        total = 0
        for record in records:
            if record.promotion is not None:
                total += record.promotion.pages.numel()
            if self.demotable(record):
                total += self.pages_held(record) - self.buffer_pages
        return total

    def demotion_order(self, records: Iterable[RequestRecord], step: int,
                       needing: frozenset[int] | set[int] = frozenset()) -> list[RequestRecord]:
        """Demotion candidates: out of cooldown first, then most pages gained, then longest context.

        The gain of a demotion is the pages it frees plus one if the request would otherwise start
        a new page this step (``needing``).
        """
        cooldown = self.config.switch_cooldown_steps

        def key(record: RequestRecord):
            gain = self.pages_held(record) - self.buffer_pages + (record.slot in needing)
            return (step - record.mode_step < cooldown, -gain, -record.seq_len, record.slot)

        return sorted((r for r in records if self.demotable(r)), key=key)

    def demoted_when_decoding(self, record: RequestRecord) -> bool:
        """Always-offload: a request is demoted as soon as its older tokens exceed its buffer
        (it will hold ``seq_len + 1`` tokens after this step)."""
        return not self.config.resident_first and record.mode == RESIDENT and record.seq_len - 1 >= self.buffer_size

    def waits_for_staging(self, record: RequestRecord) -> bool:
        """Always-offload: a request that must be demoted at its first decode step starts decoding
        only once its prefill's copy to the host is done."""
        return not self.config.resident_first and record.seq_len - 1 >= self.buffer_size

    # ---------------------------------------------------------------- promotion
    def promotes(self) -> bool:
        return self.config.resident_first

    def promotion_candidates(self, records: Iterable[RequestRecord], step: int,
                             pending: list[int]) -> list[RequestRecord]:
        """Offloaded requests out of cooldown, shortest first (fewest pages to copy, most likely to stay)."""
        cooldown = self.config.switch_cooldown_steps
        return sorted(
            (
                r for r in records
                if r.mode == OFFLOADED and r.promotion is None and step - r.mode_step >= cooldown
                and r.slot not in pending
            ),
            key=lambda r: (r.seq_len, r.slot),
        )

    def promotion_leaves_room(self, free_pages: int, pages_reserved: int, pages_needed: int, capacity: int) -> bool:
        """Whether ``promote_free_fraction`` of the device pool stays free after a promotion."""
        keep_free = int(self.config.promote_free_fraction * capacity)
        return free_pages - pages_reserved - pages_needed >= keep_free

    @property
    def max_promotions_per_step(self) -> int:
        return self.config.max_switches_per_step
