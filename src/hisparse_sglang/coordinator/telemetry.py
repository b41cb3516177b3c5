"""What the coordinator reports: mode switches, host time per decode step, swap-in counters.

The HiSparse log line and the Prometheus metrics (``integration/sglang/metrics.py``) read these
through the coordinator; nothing here changes what the coordinator does.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from hisparse_sglang.memory.allocator import PoolStats
from hisparse_sglang.streams import CopyEvent, StreamSet

__all__ = ["CoordinatorStats", "SwapCounters", "Telemetry", "SLOW_SWITCH_SECONDS"]

logger = logging.getLogger("hisparse_sglang.coordinator")

# A scheduler step that spends longer than this switching modes is logged with its counts and the
# time of each part (what it waited on).
SLOW_SWITCH_SECONDS = 0.005


@dataclasses.dataclass(frozen=True)
class CoordinatorStats:
    pools: PoolStats
    resident_requests: int
    offloaded_requests: int
    promoting_requests: int
    demotions: int
    promotions: int
    promotion_cancels: int
    swap_in_lookups: int
    swap_in_misses: int
    bytes_swapped_in: int
    # Speculative decoding: verify rows whose accept length cap_accepted lowered, and the drafts they dropped.
    verify_rows_capped: int = 0
    verify_drafts_dropped: int = 0
    # Prefills staged to the host by the copy engines, and by copy_rows (a row off the GPU; coordinator/staging.py).
    prefills_staged_by_dma: int = 0
    prefills_staged_by_kernel: int = 0


class Telemetry:
    """Switch counts, the longest switching time per step, and the host time of decode steps.

    Attributes:
        demotions, promotions, promotion_cancels: totals since start.
        slow_switch_seconds: a switching block longer than this is logged with the time of each part.
    """

    def __init__(self, slow_switch_seconds: float = SLOW_SWITCH_SECONDS) -> None:
        self.slow_switch_seconds = slow_switch_seconds
        self.demotions = 0
        self.promotions = 0
        self.promotion_cancels = 0
        self._switch_seconds_max = 0.0
        self._step_host = (0.0, 0.0, 0)  # prepare_decode host time: sum, max, steps since last taken
        self._marks: list[tuple[str, float]] = []

    def switch_counts(self) -> tuple[int, int, int]:
        return self.demotions, self.promotions, self.promotion_cancels

    def start_switching(self) -> tuple[float, tuple[int, int, int]]:
        """Start timing a block that may switch modes; returns what :meth:`end_switching` takes."""
        started = time.perf_counter()
        self._marks = [("start", started)]
        return started, self.switch_counts()

    def mark(self, label: str) -> None:
        """Time stamp for the slow-switch log line (what a slow step waited on)."""
        self._marks.append((label, time.perf_counter()))

    def end_switching(self, where: str, started: float, before: tuple[int, int, int], requests: int) -> bool:
        """Record the block's time (logged with its parts when slow); returns whether it switched."""
        seconds = time.perf_counter() - started
        self._switch_seconds_max = max(self._switch_seconds_max, seconds)
        if seconds > self.slow_switch_seconds:
            demoted, promoted, cancelled = (a - b for a, b in zip(self.switch_counts(), before))
            steps = ", ".join(
                f"{label} {1e3 * (t - t0):.1f}" for (_, t0), (label, t) in zip(self._marks, self._marks[1:])
            )
            logger.warning(
                "HiSparse: %s spent %.1f ms switching modes (%d demotions, %d promotions completed, "
                "%d promotions cancelled, %d requests; ms per part: %s).",
                where, 1e3 * seconds, demoted, promoted, cancelled, requests, steps or "-",
            )
        return self.switch_counts() != before

    def decode_step_done(self, entered: float) -> None:
        spent = time.perf_counter() - entered
        total, longest, steps = self._step_host
        self._step_host = (total + spent, max(longest, spent), steps + 1)

    def take_switch_time_max(self) -> float:
        """Longest time (s) one step spent switching modes since the previous call; resets it.

        Host wall time of the switching code of ``prepare_decode`` or ``reclaim``: what a demotion
        storm adds to the scheduler's step (the GPU work it enqueues is a few table updates).
        """
        value, self._switch_seconds_max = self._switch_seconds_max, 0.0
        return value

    def take_step_host_time(self) -> tuple[float, float]:
        """Mean and longest host time (s) of ``prepare_decode`` since the previous call; resets them.

        The bookkeeping HiSparse adds to every decode step of the scheduler (bind launches, mode
        switches): with SGLang's overlap scheduler it is hidden behind the forward pass only while
        shorter than it.
        """
        total, longest, steps = self._step_host
        self._step_host = (0.0, 0.0, 0)
        return (total / steps if steps else 0.0), longest


class SwapCounters:
    """The device ops' counters on the device, and a way to read them without waiting: the swap-in's
    (lookups, misses) and, under speculative decoding, ``cap_accepted``'s (verify rows capped, drafts they no
    longer accept).

    Attributes:
        device: int64 ``[4]`` on the coordinator's device, those four in that order.
        swap_in: ``device[:2]``, incremented by the swap-in ops.
        caps: ``device[2:]``, incremented by ``cap_accepted``.
    """

    def __init__(self, streams: StreamSet) -> None:
        self._streams = streams
        self.device = torch.zeros(4, dtype=torch.int64, device=streams.device)
        self.swap_in = self.device[:2]
        self.caps = self.device[2:]
        self._mirror = torch.zeros(4, dtype=torch.int64, pin_memory=streams.is_cuda)
        self._event: CopyEvent | None = None
        self._values = [0, 0, 0, 0]

    def values(self, exact: bool = True) -> list[int]:
        """(lookups, misses, verify rows capped, drafts dropped) so far; ``exact=False`` does not wait for the
        GPU and returns the values of the previous call on CUDA (for periodic metrics on the scheduler's hot
        path)."""
        if exact or not self._streams.is_cuda:
            return self.device.tolist()
        if self._event is None or self._event.query():
            if self._event is not None:
                self._values = self._mirror.tolist()
            self._mirror.copy_(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self._streams.device))
            self._event = CopyEvent(self._streams, event)
        return list(self._values)
