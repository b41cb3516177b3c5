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
   them into runs in which both advance by one and hands the copy engines one copy per run and layer, in one
   batch (``ops.copy_row_runs``); a request of more than :data:`DMA_MAX_COPIES` copies is copied by
   ``copy_rows`` instead.

The request's staging event is a :class:`StagedCopy`: it reports the copy done only once enqueued and
done, and a wait on it (a demotion of the request) enqueues it first. A request that ends before its copy
was enqueued is dropped (:meth:`PrefillStaging.drop`): its host rows are not needed.

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

__all__ = ["BACKGROUND_COPY_BLOCKS", "DMA_MAX_COPIES", "PrefillStaging", "StagedCopy", "row_runs"]

BACKGROUND_COPY_BLOCKS = 16
"""CTAs a copy kernel beside the forward may take (a prefill staged by ``copy_rows``, a promotion to device pages;
each on its own stream, ``copy_rows``'s ``max_blocks``). Uncapped it takes every SM for its whole length (4 CTAs of
512 threads per SM), so the forward's kernels launched meanwhile wait for it. On an H200 a 16K-token prompt of 61
bf16 layers delayed a decode-like loop by 22.5 ms (staging) / 23.3 ms (promotion) uncapped, by 17.4 / 5.8 ms at 16
CTAs (``benchmarks/bench_background_copy.py``)."""

DMA_MAX_COPIES = 16384
"""Most copies (runs of contiguous rows x layers) a request's staging hands the copy engines, in one batch
(``ops.copy_row_runs``): a 16K-token prompt of 61 layers whose every 64-row page is a run of its own is 15,616
copies; beyond, ``copy_rows`` copies it."""


def row_runs(src_rows: torch.Tensor, dst_rows: torch.Tensor) -> torch.Tensor:
    """int64 ``[R, 3]`` (first source row, first destination row, rows) of the maximal runs in which both
    ``src_rows`` and ``dst_rows`` (int64 ``[N]``, on the CPU, N >= 1) advance by one, in order."""
    breaks = ((src_rows[1:] - src_rows[:-1]) != 1) | ((dst_rows[1:] - dst_rows[:-1]) != 1)
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), breaks.nonzero().flatten() + 1])
    ends = torch.cat([starts[1:], torch.tensor([src_rows.numel()], dtype=torch.int64)])
    return torch.stack([src_rows[starts], dst_rows[starts], ends - starts], dim=1)


class StagedCopy:
    """A staging copy that is enqueued once its row plan reached the host; the interface of
    :class:`~hisparse_sglang.streams.CopyEvent`."""

    def __init__(self, staging: "PrefillStaging", slot: int) -> None:
        self._staging = staging
        self._slot = slot
        self.enqueued: CopyEvent | None = None

    def query(self) -> bool:
        """Done: enqueued (now, if its plan has arrived) and complete."""
        if self.enqueued is None:
            self._staging.issue_ready()
        return self.enqueued is not None and self.enqueued.query()

    def wait_on_current_stream(self) -> None:
        """Order later work of the current stream after the copy; enqueues it first (waiting on the host
        for its plan if it has not arrived)."""
        self._enqueue_now().wait_on_current_stream()

    def synchronize(self) -> None:
        self._enqueue_now().synchronize()

    def _enqueue_now(self) -> CopyEvent:
        if self.enqueued is None:
            self._staging.issue(self._slot, wait=True)
        return self.enqueued


class _Plan:
    """A staging copy waiting for its rows on the host."""

    __slots__ = ("copy", "locs", "rows", "host_locs", "host_rows", "arrived")

    def __init__(self, copy: StagedCopy, locs, rows, host_locs, host_rows, arrived: CopyEvent) -> None:
        self.copy = copy
        self.locs, self.rows = locs, rows  # on the device: copy_rows's indices if the runs are too many
        self.host_locs, self.host_rows = host_locs, host_rows
        self.arrived = arrived


class PrefillStaging:
    """The coordinator's staging copies in their two phases (module docstring).

    Attributes:
        by_dma: requests staged by the copy engines so far.
        by_kernel: requests staged by ``copy_rows`` (more than :data:`DMA_MAX_COPIES` copies).
    """

    def __init__(self, coordinator: "Coordinator") -> None:
        self._coordinator = coordinator
        self._plans: dict[int, _Plan] = {}
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
        if arrived.query():  # on the CPU without a delay; never on a GPU, where they follow the prefill
            self.issue(slot, wait=False)
        return copy

    def issue_ready(self) -> None:
        """Phase 2 of every plan whose rows have arrived on the host."""
        if not self._plans:
            return
        for slot in [slot for slot, plan in self._plans.items() if plan.arrived.query()]:
            self.issue(slot, wait=False)

    def issue(self, slot: int, wait: bool) -> None:
        """Phase 2 of ``slot``'s plan: enqueue its copy on the staging stream (``wait``: after waiting on the
        host for its rows, if they have not arrived)."""
        plan = self._plans.pop(slot)
        if wait:
            plan.arrived.synchronize()
        coordinator = self._coordinator
        streams = coordinator.streams
        runs = row_runs(plan.host_rows.to(torch.int64), plan.host_locs.to(torch.int64))
        with streams.on(streams.staging):
            # A row <= 0 is not on the GPU (never for a request just prefilled): copy_rows handles it as
            # every other copy does.
            if runs.shape[0] * len(coordinator.device_layers) <= DMA_MAX_COPIES and bool((runs[:, 0] > 0).all()):
                coordinator.ops.copy_row_runs(coordinator.device_layers, coordinator.host_layers, runs)
                self.by_dma += 1
            else:
                coordinator.ops.copy_rows(coordinator.device_layers, coordinator.host_layers, plan.rows, plan.locs,
                                          max_blocks=BACKGROUND_COPY_BLOCKS)
                self.by_kernel += 1
            # plan.locs and plan.rows were kept alive for the staging stream by stage(): a tensor recorded on a
            # stream is reused only after the work that stream had when the tensor was freed.
            plan.copy.enqueued = streams.record(streams.staging)

    def drop(self, slot: int) -> bool:
        """Forget ``slot``'s plan if its copy was not enqueued (the request ended: its host rows are not
        needed); whether there was one."""
        return self._plans.pop(slot, None) is not None

    def unstaged_len(self, slot: int) -> int:
        """Positions ``[0, n)`` of ``slot`` whose staging copy is not enqueued yet (their host rows are not
        written); 0 when it was enqueued or there is none."""
        plan = self._plans.get(slot)
        return 0 if plan is None else plan.host_locs.numel()
