"""Tensor-parallel ranks sharing one host pool, as separate processes on the CPU.

Each rank is a :class:`~hisparse_sglang.testing.sim.SimulatedServer` with the same seed, so every rank
submits, aborts, prefills and decodes the same requests; they share one host pool
(memory/shared_host_pool.py) over a gloo group, agree like SGLang's ranks (all-reduce MIN), compare
their allocation state (RankStateCheck) and run a collective after every layer's swap-in and every
prefill, where a TP model's forward has its all-reduces. Only the writer's coordinator writes host
rows; every rank checks, after every step, that the host rows of its live requests hold their KV.

After each step all ranks pass a barrier (SGLang's scheduler broadcasts its new requests over the TP
CPU group every iteration) and keep a snapshot of what is committed to the host: the positions each
live request had then. A rank whose peer died checks that snapshot against the pool (its view stays
consistent: nothing a live request owns was overwritten) and reports.

Used by tests/test_shared_host_pool.py; the entry points run in spawned processes and talk to the
test, each through a multiprocessing queue of its own (RankProcesses says why): ``("progress", rank,
step, pid, segment)``, ``("done", rank, summary)``, ``("failed", rank, summary)`` or ``("error", rank,
text)``.
"""

from __future__ import annotations

import dataclasses
import datetime
import multiprocessing
import os
import pathlib
import queue
import random
import time
import traceback

import torch

from hisparse_sglang.config import HiSparseConfig
from hisparse_sglang.errors import HiSparseError, RankDivergenceError
from hisparse_sglang.memory.consistency import RankStateCheck, gather_ints
from hisparse_sglang.memory.host_pool import HostKVPool, layer_stride
from hisparse_sglang.memory.shared_host_pool import SegmentLayout, SharedSegment, open_host_pool
from hisparse_sglang.ops import reference
from hisparse_sglang.testing.sim import SimulatedServer, token_rows

__all__ = [
    "RankSpec",
    "run_rank",
    "restart_writer",
    "committed_snapshot",
    "still_held",
    "verify_snapshot",
    "RankProcesses",
    "segment_users",
    "wait_until_unused",
    "run_peers",
    "report_and_exit",
]


@dataclasses.dataclass(frozen=True)
class RankSpec:
    """One run of ``world`` ranks.

    Attributes:
        init_file: the gloo group's rendezvous file (a path that does not exist yet).
        scenarios: ``resident_first`` of each run, one after the other, each with a new shared pool.
        diverge_at: a last run in which rank 1 takes one extra host page at this step and the ranks
            compare their state every step (the check must stop every rank before any of them reads
            a row the writer filled for another request), or None.
        device: "cpu" (reference ops, pageable pool, readers map it read-only) or "cuda" (the CUDA
            ops on the current GPU, pinned pool; the collectives first wait for this rank's GPU,
            standing in for NCCL's stream order: two ranks on one GPU cannot use NCCL).
        page_size, top_k, buffer_size, prompt_range, output_range: the requests and the pools.
    """

    world: int
    init_file: str
    seed: int = 0
    steps: int = 50
    scenarios: tuple[bool, ...] = (True,)
    diverge_at: int | None = None
    device: str = "cpu"
    layer_num: int = 2
    item_bytes: int = 64
    page_size: int = 4
    top_k: int = 8
    buffer_size: int = 16
    device_pages: int = 24
    max_reqs: int = 6
    max_context: int = 256
    prompt_range: tuple[int, int] = (5, 60)
    output_range: tuple[int, int] = (3, 40)
    check_every: int = 4
    cpu_event_delay_steps: int = 2
    group_timeout_s: float = 20.0

    def config(self, resident_first: bool) -> HiSparseConfig:
        return HiSparseConfig(top_k=self.top_k, device_buffer_size=self.buffer_size, page_size=self.page_size,
                              host_to_device_ratio=4, resident_first=resident_first, switch_cooldown_steps=2,
                              promote_free_fraction=0.2)

    @property
    def pinned(self) -> bool:
        return self.device == "cuda"

    def host_rows(self) -> int:
        return self.device_pages * 4 * self.page_size  # device pages x host_to_device_ratio x page_size

    def layout(self) -> SegmentLayout:
        return SegmentLayout(self.layer_num, self.host_rows(), self.item_bytes,
                             layer_stride(self.host_rows() * self.item_bytes, pinned=self.pinned))

    def ops(self):
        if self.device == "cuda":
            from hisparse_sglang.ops.swap_in import CudaOps

            return CudaOps()
        return reference


# How long a rank that lost its group waits for the test's go-ahead to check its rows again.
HOLD_TIMEOUT_S = 600.0


def run_rank(rank: int, spec: RankSpec, events, hold=None) -> None:
    """Entry point of one rank (a spawned process).

    Args:
        rank: this rank; rank 0 writes the pool.
        events: the queue the test reads (module docstring).
        hold: a queue, or None: a rank whose peer died waits for one item on it, then checks its
            snapshot a second time (a writer restarted meanwhile must not have touched it) and exits.
    """
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{spec.init_file}", rank=rank, world_size=spec.world,
        timeout=datetime.timedelta(seconds=spec.group_timeout_s),
    )
    group = torch.distributed.group.WORLD
    summaries: list[dict] = []
    try:
        runs = [(resident_first, None) for resident_first in spec.scenarios]
        if spec.diverge_at is not None:
            runs.append((True, spec.diverge_at))
        for index, (resident_first, diverge_at) in enumerate(runs):
            summaries.append(_run(rank, spec, group, events, resident_first, diverge_at, seed=spec.seed + index))
        events.put(("done", rank, summaries))
        torch.distributed.barrier(group=group)
    except RankDivergenceError as exc:
        events.put(("diverged", rank, str(exc)))
        _exit(events, 0)
    except _PeerLost as lost:
        lost.summary["before"] = summaries
        events.put(("failed", rank, lost.summary))
        if hold is not None:
            try:
                # the test restarts a writer first (a new process importing torch: minutes on a loaded box)
                hold.get(timeout=HOLD_TIMEOUT_S)
                lost.summary["rechecked"] = verify_snapshot(lost.pool, lost.snapshot, spec.item_bytes)
            except BaseException:  # reported, not left to a process exit that waits on the queue
                events.put(("error", rank, traceback.format_exc()[-3000:]))
                _exit(events, 1)
            events.put(("rechecked", rank, lost.summary))
        _exit(events, 0)  # the group is broken: skip its teardown
    except BaseException:
        events.put(("error", rank, traceback.format_exc()[-3000:]))
        _exit(events, 1)
    torch.distributed.destroy_process_group()


def _exit(events, code: int) -> None:
    """Leave at once (a broken group's teardown can hang) once the queue has sent what we put."""
    events.close()
    events.join_thread()
    os._exit(code)


class _PeerLost(Exception):
    def __init__(self, summary: dict, pool: HostKVPool, snapshot: dict) -> None:
        super().__init__(summary.get("error"))
        self.summary, self.pool, self.snapshot = summary, pool, snapshot


def _run(rank: int, spec: RankSpec, group, events, resident_first: bool, diverge_at: int | None, seed: int) -> dict:
    config = spec.config(resident_first)
    pool = open_host_pool(spec.layer_num, spec.host_rows(), spec.item_bytes, pin=spec.pinned, group=group,
                          read_only_readers=not spec.pinned)  # on the CPU a reader's host write would fault

    def agree(flags: list[bool]) -> list[bool]:
        values = torch.tensor([int(flag) for flag in flags], dtype=torch.int32)
        torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.MIN, group=group)
        return [bool(value) for value in values.tolist()]

    def collective() -> None:
        if spec.pinned:
            torch.cuda.current_stream().synchronize()  # NCCL's collective would follow this rank's kernels
        torch.distributed.all_reduce(torch.zeros(1), group=group)

    check = RankStateCheck(gather_ints(group), every_steps=1 if diverge_at is not None else spec.check_every)
    server = SimulatedServer(
        config, layer_num=spec.layer_num, item_bytes=spec.item_bytes, device_pages=spec.device_pages,
        max_reqs=spec.max_reqs, max_context=spec.max_context, seed=seed,
        cpu_event_delay_steps=spec.cpu_event_delay_steps, host_pool=pool, agree=agree, rank_check=check,
        collective=collective, ops=spec.ops(), device=spec.device,
    )
    workload = random.Random(seed)  # the same requests on every rank
    snapshot: dict = {}
    summary = {"rank": rank, "pid": os.getpid(), "writable": pool.writable, "segment": pool.segment.name,
               "resident_first": resident_first, "steps": 0, "verified_rows": 0}
    try:
        for step in range(spec.steps):
            if workload.random() < 0.6:
                server.submit(workload.randint(*spec.prompt_range), workload.randint(*spec.output_range))
            if server.requests and workload.random() < 0.08:
                server.abort(workload.choice(sorted(server.requests)))
            if diverge_at is not None and step == diverge_at and rank == 1:
                server.allocator.logical.alloc_pages(1)  # a decision the other ranks did not take
            server.readmit_retracted()
            server.admit_waiting()
            server.step()
            if spec.pinned:
                torch.cuda.synchronize()  # the writer's staging copies too: the check reads every row
            torch.distributed.barrier(group=group)
            server.check_invariants()  # reads the host rows of every live request (the writer's bytes)
            torch.distributed.barrier(group=group)  # before the writer reuses any row it read
            snapshot = committed_snapshot(server)
            summary["steps"] = step + 1
            events.put(("progress", rank, step, os.getpid(), pool.segment.name))
    except RuntimeError as exc:
        if isinstance(exc, HiSparseError):
            raise
        # gloo: a peer closed its connections (it died) or did not answer in time. What this rank may
        # still read: the committed rows of the requests it still holds (the others left its state).
        summary["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        snapshot = still_held(server, snapshot)
        summary["verified_rows"] = verify_snapshot(pool, snapshot, spec.item_bytes)
        raise _PeerLost(summary, pool, snapshot) from exc
    summary["verified_rows"] = verify_snapshot(pool, snapshot, spec.item_bytes)
    summary.update(
        finished=sorted(server.finished), aborted=sorted(server.aborted), rejected=sorted(server.rejected),
        demotions=server.coordinator.telemetry.demotions, promotions=server.coordinator.telemetry.promotions,
        checks=check.checks, state=server.coordinator.rank_state(),
    )
    torch.distributed.barrier(group=group)
    return summary


def committed_snapshot(server: SimulatedServer) -> dict[int, tuple[int, torch.Tensor]]:
    """Per live request: its uid's token count and locations, as committed to the host after a step."""
    return {
        uid: (request.seq_len, server.req_to_token[request.slot, : request.seq_len].to("cpu", torch.int64))
        for uid, request in server.requests.items()
    }


def still_held(server: SimulatedServer, snapshot: dict[int, tuple[int, torch.Tensor]]) -> dict:
    """The part of ``snapshot`` whose requests this rank still holds at the same locations."""
    kept = {}
    for uid, (seq_len, locs) in snapshot.items():
        request = server.requests.get(uid)
        if request is not None and request.seq_len >= seq_len:
            current = server.req_to_token[request.slot, :seq_len].to("cpu", torch.int64)
            if torch.equal(current, locs):
                kept[uid] = (seq_len, locs)
    return kept


def verify_snapshot(pool: HostKVPool, snapshot: dict[int, tuple[int, torch.Tensor]], item_bytes: int) -> int:
    """Rows checked: every layer's host rows of every request of ``snapshot`` hold its KV.

    Raises:
        AssertionError: naming the request, layer and position of the first wrong row.
    """
    checked = 0
    for uid, (seq_len, locs) in snapshot.items():
        for layer_id, layer in enumerate(pool.layers):
            got = layer[locs]
            want = token_rows(uid, torch.arange(seq_len), layer_id, item_bytes)
            if not torch.equal(got, want):
                bad = int(torch.nonzero((got != want).any(dim=1))[0])
                raise AssertionError(
                    f"pid {os.getpid()}: request {uid} layer {layer_id} position {bad} (host row {int(locs[bad])}) "
                    f"holds the wrong KV"
                )
            checked += seq_len
    return checked


def restart_writer(spec: RankSpec, events) -> None:
    """A writer started again on the node (a spawned process): it creates and publishes a new segment,
    zeroing it, then reports its name. No collective: its old group is gone."""
    try:
        layout = spec.layout()
        segment = SharedSegment.create(layout)
        pool = HostKVPool(layout.layer_num, layout.num_rows, layout.item_bytes, pin=spec.pinned, segment=segment)
        segment.publish()
        pool.layers[0].fill_(0xAB)  # it writes its own rows; the old segment must not see any of it
        events.put(("restarted", -1, {"pid": os.getpid(), "segment": segment.name}))
    except Exception:
        events.put(("error", -1, traceback.format_exc()[-3000:]))


# ---------------------------------------------------------------------------------------------- the test side
def segment_users(name: str) -> set[int]:
    """Pids whose mappings or open descriptors hold the memfd ``name``."""
    marker = f"/memfd:{name}"
    users = set()
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if marker in (entry / "maps").read_text():
                users.add(int(entry.name))
                continue
            for fd in (entry / "fd").iterdir():
                if os.readlink(fd).startswith(marker):
                    users.add(int(entry.name))
                    break
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return users


class RankProcesses:
    """Spawned ranks, each with an event queue of its own; every process still alive is killed on exit.

    One queue per process, not one for all: the writers of a ``multiprocessing.Queue`` share one lock,
    which a process's feeder thread holds while it writes an event into the pipe (and while it waits for
    its interpreter lock after the write). A rank SIGKILLed in that window left the lock taken for good:
    every other process's events stayed in its feeder thread, so the test saw no survivor report, and the
    survivors hung at exit flushing their queue (docs/shared-host-pool.md, "Known problems"). With a
    queue per process, a killed process can only lose its own events.
    """

    def __init__(self, spec: RankSpec, hold: bool = False) -> None:
        self.context = multiprocessing.get_context("spawn")
        self.spec = spec
        self.holds = [self.context.Queue() if hold else None for _ in range(spec.world)]
        self.processes: list = []
        self.queues: list = []
        self._next_queue = 0  # where the next read starts: every process's events are read in turn
        for rank in range(spec.world):
            self._add(run_rank, (rank, spec), (self.holds[rank],))

    def _add(self, target, before: tuple, after: tuple = ()):
        """A process running ``target(*before, events, *after)`` with a new event queue (not started)."""
        events = self.context.Queue()
        process = self.context.Process(target=target, args=(*before, events, *after), daemon=True)
        self.queues.append(events)
        self.processes.append(process)
        return process

    def __enter__(self) -> "RankProcesses":
        for process in self.processes:
            process.start()
        return self

    def __exit__(self, *exc_info) -> None:
        for process in self.processes:
            if process.is_alive():
                process.kill()
            process.join(10)

    def spawn(self, target, *args):
        """Start ``target(*args, events)`` in a new process with an event queue of its own."""
        process = self._add(target, args)
        process.start()
        return process

    def next(self, kinds: set[str], deadline: float) -> tuple:
        """The next event of one of ``kinds`` from any process (events of other kinds are skipped); an
        "error" event fails the test with the process's traceback."""
        while True:
            event = self._read_one()
            if event is not None:
                if event[0] == "error":
                    raise AssertionError(f"rank {event[1]} failed:\n{event[2]}")
                if event[0] in kinds:
                    return event
            if time.monotonic() >= deadline:
                raise AssertionError(f"no {sorted(kinds)} event before the deadline")
            if event is None:
                time.sleep(0.01)

    def _read_one(self):
        """The next event of any process, their queues read in turn; None while every queue is empty."""
        for _ in range(len(self.queues)):
            events = self.queues[self._next_queue]
            self._next_queue = (self._next_queue + 1) % len(self.queues)
            try:
                return events.get_nowait()
            except queue.Empty:
                continue
        return None

    def collect(self, kind: str, count: int, deadline: float) -> dict[int, object]:
        found = {}
        while len(found) < count:
            event = self.next({kind}, deadline)
            found[event[1]] = event[2]
        return found

    def join(self, deadline: float) -> None:
        for process in self.processes:
            process.join(max(deadline - time.monotonic(), 0.1))
            assert not process.is_alive(), f"pid {process.pid} did not exit"


def wait_until_unused(name: str, deadline: float) -> set[int]:
    users = segment_users(name)
    while users and time.monotonic() < deadline:
        time.sleep(0.2)
        users = segment_users(name)
    return users


def report_and_exit(events, rank: int, work) -> None:
    """The body of a peer process: ``("done", rank, work())`` or ``("error", rank, traceback)`` on
    ``events``, then exit at once (a gloo group's teardown can hang when a peer is gone)."""
    try:
        events.put(("done", rank, work()))
    except BaseException:
        events.put(("error", rank, traceback.format_exc()[-4000:]))
    finally:
        _exit(events, 0)


def run_peers(target, world: int, args: tuple, deadline_s: float) -> dict[int, object]:
    """Spawn ``target(rank, *args, events)`` for every rank and return each rank's "done" payload.

    Raises:
        AssertionError: a rank reported an error (its traceback), or not every rank reported in time.
    """
    context = multiprocessing.get_context("spawn")
    events = context.Queue()
    processes = [context.Process(target=target, args=(rank, *args, events), daemon=True) for rank in range(world)]
    deadline = time.monotonic() + deadline_s
    reports: dict[int, object] = {}
    try:
        for process in processes:
            process.start()
        while len(reports) < world:
            try:
                kind, rank, payload = events.get(timeout=max(deadline - time.monotonic(), 0.1))
            except queue.Empty:
                raise AssertionError(f"the ranks did not report within {deadline_s:.0f} s (got {sorted(reports)})") from None
            if kind != "done":
                raise AssertionError(f"rank {rank} failed:\n{payload}")
            reports[rank] = payload
    finally:
        for process in processes:
            process.join(max(deadline - time.monotonic(), 1))
            if process.is_alive():
                process.kill()
                process.join(5)
    return reports
