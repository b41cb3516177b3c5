"""Staging a prefilled request's KV to the host by the copy engines, off the SMs.

A copy kernel beside the forward holds SMs for the copy's whole length, and the forward's kernels wait for
them: on an H200, one 16K-token prompt of DeepSeek-V3.2 (61 layers, bf16) staged by ``copy_rows`` delayed
a decode-like loop by 22.5 ms, by one ``Tensor.copy_`` per run of 16 pages 1.9 ms
(``benchmarks/bench_background_copy.py``; docs/resident-first.md, "Staging"). A copy engine needs the
host to name every contiguous run of rows, and the rows of a request are known on the device only
(``req_to_token``, ``device_row_of_loc``). So staging has two phases on the staging stream:

1. :meth:`PrefillStaging.stage` (at admission): after the prefill, the request's logical locations and
   device rows travel to pinned host memory (a few hundred KB, no host wait);
2. :meth:`PrefillStaging.issue_ready` (each later coordinator step, once they arrived): the host splits
   them into runs in which both advance by one and hands the copy engines one copy per run and layer
   (``ops.copy_row_runs``), at most :data:`DMA_MAX_OUTSTANDING` copies not yet done at a time: a request of
   more runs (pages handed out of order) is enqueued a chunk at a time over later steps.

The request's staging event is a :class:`StagedCopy`: it reports the copy done only once wholly enqueued and
done, and a wait on it (a demotion of the request) enqueues the rest at once first. A request that ends
before its copy was wholly enqueued is dropped (:meth:`PrefillStaging.drop`): its host rows are not needed,
so no more of it is enqueued (what was waits to be done before its rows are freed).

A host pool shared by the TP ranks of a node (docs/shared-host-pool.md) is staged by its writer with
``copy_rows`` at admission, as before: its readers may read a request's host rows once the ranks agreed that the
writer's copy is done, which the writer could not tell them for a copy it has not enqueued yet.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hisparse_sglang.streams import CopyEvent

if TYPE_CHECKING:
    from hisparse_sglang.coordinator.core import Coordinator

__all__ = ["BACKGROUND_COPY_BLOCKS", "DMA_MAX_OUTSTANDING", "PrefillStaging", "StagedCopy", "row_runs"]

BACKGROUND_COPY_BLOCKS = 16
"""CTAs a copy kernel beside the forward may take (a prefill staged by ``copy_rows``, a promotion to device pages;
each on its own stream, ``copy_rows``'s ``max_blocks``). Uncapped it takes every SM for its whole length (4 CTAs of
512 threads per SM), so the forward's kernels launched meanwhile wait for it. On an H200 a 16K-token prompt of 61
bf16 layers delayed a decode-like loop by 22.5 ms (staging) / 23.3 ms (promotion) uncapped, by 17.4 / 5.8 ms at 16
CTAs (``benchmarks/bench_background_copy.py``)."""

DMA_MAX_OUTSTANDING = 1024
"""Most staging copies (runs of rows x layers, one ``cudaMemcpyAsync`` each by ``ops.copy_row_runs``) enqueued and
not yet done. On H200s, 976 copies of a 16K-token prompt of 61 layers (16 runs) took 1.7-2.6 ms of host time to
enqueue and delayed a decode-like loop by 3.4-5.3 ms (``copy_rows`` at 16 CTAs: 17.8-18.7 ms); 3,904 at once took
22 ms to enqueue, each call past about a thousand waiting for room in the copy engines' queue. So the copies of a
request of more runs are enqueued a chunk at a time, whenever the chunks before it are done."""


def row_runs(src_rows: torch.Tensor, dst_rows: torch.Tensor) -> torch.Tensor:
    """int64 ``[R, 3]`` (first source row, first destination row, rows) of the maximal runs in which both
    ``src_rows`` and ``dst_rows`` (int64 ``[N]``, on the CPU, N >= 1) advance by one, in order."""
    breaks = ((src_rows[1:] - src_rows[:-1]) != 1) | ((dst_rows[1:] - dst_rows[:-1]) != 1)
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), breaks.nonzero().flatten() + 1])
    ends = torch.cat([starts[1:], torch.tensor([src_rows.numel()], dtype=torch.int64)])
    return torch.stack([src_rows[starts], dst_rows[starts], ends - starts], dim=1)


class StagedCopy:
    """A staging copy that is enqueued once its row plan reached the host (in chunks, if it has many runs); the
    interface of :class:`~hisparse_sglang.streams.CopyEvent`."""

    def __init__(self, staging: "PrefillStaging", slot: int) -> None:
        self._staging = staging
        self._slot = slot
        self.enqueued: CopyEvent | None = None  # set once the whole copy (or all of it that ever will be) is enqueued

    def query(self) -> bool:
        """Done: wholly enqueued (by now, if its plan has arrived and the copies before it left room) and complete."""
        if self.enqueued is None:
            self._staging.issue_ready()
        return self.enqueued is not None and self.enqueued.query()

    def wait_on_current_stream(self) -> None:
        """Order later work of the current stream after the copy; enqueues the rest of it first (waiting on the
        host for its plan if it has not arrived)."""
        self._enqueue_now().wait_on_current_stream()

    def synchronize(self) -> None:
        self._enqueue_now().synchronize()

    def _enqueue_now(self) -> CopyEvent:
        if self.enqueued is None:
            self._staging.issue(self._slot, wait=True)
        return self.enqueued


class _Plan:
    """A staging copy not wholly enqueued yet."""

    __slots__ = ("copy", "locs", "rows", "host_locs", "host_rows", "arrived", "runs", "next_run", "last")

    def __init__(self, copy: StagedCopy, locs, rows, host_locs, host_rows, arrived: CopyEvent) -> None:
        self.copy = copy
        self.locs, self.rows = locs, rows  # on the device: copy_rows's indices if a row is not on the GPU
        self.host_locs, self.host_rows = host_locs, host_rows
        self.arrived = arrived
        self.runs: torch.Tensor | None = None  # once the rows arrived: the runs of rows, [R, 3]
        self.next_run = 0  # runs [0, next_run) are enqueued
        self.last: CopyEvent | None = None  # recorded after the last chunk enqueued


class PrefillStaging:
    """The coordinator's staging copies in their two phases (module docstring).

    Attributes:
        by_dma: requests staged by the copy engines so far.
        by_kernel: requests staged by ``copy_rows`` (a row not on the GPU, which a request just prefilled never has).
    """

    def __init__(self, coordinator: "Coordinator") -> None:
        self._coordinator = coordinator
        self._plans: dict[int, _Plan] = {}
        self._in_flight: list[tuple[CopyEvent, int]] = []  # (event after a chunk, its copies), in enqueue order
        self.by_dma = 0
        self.by_kernel = 0

    def stage(self, slot: int, prefill_len: int) -> StagedCopy:
        """Phase 1 for request ``slot``: its first ``prefill_len`` locations and their device rows to the host,
        on the staging stream after the prefill. Returns the copy's event."""
        coordinator = self._coordinator
        streams = coordinator.streams
        locs = coordinator.req_to_token[slot, :prefill_len].to(torch.int64)
        rows = coordinator.allocator.translate(locs)
        with streams.on(streams.staging):
            # Of the device tensors' dtypes (the device rows are int32): a copy between devices that also
            # converted would go through a temporary.
            host_locs = torch.empty(prefill_len, dtype=locs.dtype, pin_memory=streams.is_cuda)
            host_rows = torch.empty(prefill_len, dtype=rows.dtype, pin_memory=streams.is_cuda)
            host_locs.copy_(locs, non_blocking=True)
            host_rows.copy_(rows, non_blocking=True)
            arrived = streams.record(streams.staging)
            streams.keep_alive(locs, streams.staging)
            streams.keep_alive(rows, streams.staging)
        copy = StagedCopy(self, slot)
        self._plans[slot] = _Plan(copy, locs, rows, host_locs, host_rows, arrived)
        self.issue_ready()  # on the CPU without a delay the rows are there; never on a GPU, where they follow the prefill
        return copy

    def outstanding(self) -> int:
        """Staging copies enqueued and not yet done (by the events after their chunks)."""
        while self._in_flight and self._in_flight[0][0].query():  # one stream: done in enqueue order
            self._in_flight.pop(0)
        return sum(copies for _, copies in self._in_flight)

    def waiting(self) -> int:
        """Requests whose staging copy is not wholly enqueued yet."""
        return len(self._plans)

    def issue_ready(self) -> None:
        """Phase 2, in admission order, of the plans whose rows have arrived on the host, while fewer than
        :data:`DMA_MAX_OUTSTANDING` copies are in flight (at least one run when none is)."""
        if not self._plans:
            return
        layers = max(len(self._coordinator.device_layers), 1)
        budget = DMA_MAX_OUTSTANDING - self.outstanding()
        for slot, plan in list(self._plans.items()):
            allowed = budget // layers or (1 if budget == DMA_MAX_OUTSTANDING else 0)
            if allowed <= 0:
                return
            if plan.arrived.query():
                budget -= self._enqueue(slot, plan, allowed) * layers

    def issue(self, slot: int, wait: bool) -> None:
        """Phase 2 of all of ``slot``'s plan at once (``wait``: after waiting on the host for its rows, if they
        have not arrived), however many copies are in flight."""
        plan = self._plans[slot]
        if wait:
            plan.arrived.synchronize()
        self._enqueue(slot, plan, None)

    def _enqueue(self, slot: int, plan: _Plan, max_runs: int | None) -> int:
        """Enqueue the next ``max_runs`` runs of ``slot``'s plan (all of them: None) on the staging stream;
        returns how many. The plan ends once its last run is enqueued."""
        coordinator = self._coordinator
        streams = coordinator.streams
        if plan.runs is None:
            runs = row_runs(plan.host_rows.to(torch.int64), plan.host_locs.to(torch.int64))
            if not bool((runs[:, 0] > 0).all()):
                # A row <= 0 is not on the GPU (never for a request just prefilled): copy_rows handles it as
                # every other copy does.
                with streams.on(streams.staging):
                    coordinator.ops.copy_rows(coordinator.device_layers, coordinator.host_layers, plan.rows,
                                              plan.locs, max_blocks=BACKGROUND_COPY_BLOCKS)
                    plan.copy.enqueued = streams.record(streams.staging)
                self.by_kernel += 1
                del self._plans[slot]
                return 0
            plan.runs = runs
            self.by_dma += 1
        end = plan.runs.shape[0] if max_runs is None else min(plan.runs.shape[0], plan.next_run + max_runs)
        with streams.on(streams.staging):
            coordinator.ops.copy_row_runs(coordinator.device_layers, coordinator.host_layers,
                                          plan.runs[plan.next_run:end])
            # plan.locs and plan.rows were kept alive for the staging stream by stage(): a tensor recorded on a
            # stream is reused only after the work that stream had when the tensor was freed.
            plan.last = streams.record(streams.staging)
        count = end - plan.next_run
        self._in_flight.append((plan.last, count * len(coordinator.device_layers)))
        plan.next_run = end
        if end == plan.runs.shape[0]:
            plan.copy.enqueued = plan.last
            del self._plans[slot]
        return count

    def drop(self, slot: int) -> bool:
        """Enqueue no more of ``slot``'s copy (the request ended: its host rows are not needed). Whether none of it
        had been enqueued; else its event is the one after the chunks that were, which the rows' free waits for."""
        plan = self._plans.pop(slot, None)
        if plan is None:
            return False
        if plan.last is None:
            return True
        plan.copy.enqueued = plan.last
        return False

    def unstaged_len(self, slot: int) -> int:
        """Positions ``[0, n)`` of ``slot`` whose host rows the staging copy may not have written yet (its copy is
        not wholly enqueued); 0 when it was or there is none."""
        plan = self._plans.get(slot)
        return 0 if plan is None else plan.host_locs.numel()
