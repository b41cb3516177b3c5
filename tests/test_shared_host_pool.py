"""One host pool per node shared by the TP ranks (memory/shared_host_pool.py), on the CPU.

Spawned ranks (testing/tp_ranks.py) share a memfd over a gloo group and run the same random request
lifecycles; only the writer writes host rows, every rank checks them after every step. Readers map the
segment read-only here, so a host write by a reader's code would crash it. The /proc checks find the
segment by its memfd name in every process's mappings and descriptors: mapped by each rank while
they run, by nobody once they are gone (SIGKILL included).
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from hisparse_sglang.testing.tp_ranks import RankProcesses, RankSpec, restart_writer, segment_users, wait_until_unused

EVENT_TIMEOUT_S = 420.0  # spawned ranks import torch first: tens of seconds, minutes on a loaded 2-core box


def test_ranks_share_one_pool_decide_alike_and_the_segment_goes_with_them(tmp_path):
    spec = RankSpec(world=3, init_file=str(tmp_path / "group"), steps=45, scenarios=(True, False))
    deadline = time.monotonic() + EVENT_TIMEOUT_S
    with RankProcesses(spec) as ranks:
        _, _, _, _, segment = ranks.next({"progress"}, deadline)
        rank_pids = {process.pid for process in ranks.processes}
        assert rank_pids <= segment_users(segment), "every rank maps the one segment"
        done = ranks.collect("done", 3, deadline)
        ranks.join(deadline)
        assert [process.exitcode for process in ranks.processes] == [0, 0, 0]
    for run in range(len(spec.scenarios)):
        summaries = [done[rank][run] for rank in range(3)]
        assert len({summary["segment"] for summary in summaries}) == 1, "one segment per run, mapped by all"
        assert [summary["writable"] for summary in summaries] == [True, False, False]
        decisions = [
            {key: summary[key] for key in ("finished", "aborted", "rejected", "demotions", "promotions", "checks",
                                           "state", "steps")}
            for summary in summaries
        ]
        assert decisions[0] == decisions[1] == decisions[2], "the ranks took different decisions"
        assert summaries[0]["checks"] >= spec.steps // spec.check_every - 1 and summaries[0]["steps"] == spec.steps
        assert summaries[0]["demotions"] > 0 and summaries[0]["finished"], "the workload never offloaded or finished"
        assert all(summary["verified_rows"] > 0 for summary in summaries)
        assert wait_until_unused(summaries[0]["segment"], time.monotonic() + 10) == set()


def test_a_rank_that_allocates_differently_stops_every_rank_with_a_typed_error(tmp_path):
    spec = RankSpec(world=2, init_file=str(tmp_path / "group"), steps=30, scenarios=(), diverge_at=5)
    deadline = time.monotonic() + EVENT_TIMEOUT_S
    with RankProcesses(spec) as ranks:
        diverged = ranks.collect("diverged", 2, deadline)
        ranks.join(deadline)
    for message in diverged.values():
        assert "logical free pages (per rank: [" in message and "share_host_pool_across_tp" in message, message


# Both victims missed EVENT_TIMEOUT_S on a loaded machine while every process sent its events through one
# queue: a rank killed while its feeder thread held the queue's write lock kept every survivor's events
# from the test. Each process has a queue of its own now (tp_ranks.RankProcesses; docs/shared-host-pool.md,
# "Known problems").
@pytest.mark.parametrize("victim", [2, 0], ids=["reader", "writer"])
def test_a_rank_killed_mid_run_leaves_the_others_consistent_and_the_segment_is_freed(tmp_path, victim):
    """SIGKILL of a rank at step 8: the others lose the group, check every committed row of the requests
    they hold, and (a writer killed) a writer started again makes its own segment without touching theirs."""
    spec = RankSpec(world=3, init_file=str(tmp_path / "group"), steps=10_000, group_timeout_s=30.0)
    deadline = time.monotonic() + EVENT_TIMEOUT_S
    with RankProcesses(spec, hold=True) as ranks:
        while True:
            _, rank, step, pid, segment = ranks.next({"progress"}, deadline)
            if rank == victim and step == 8:
                os.kill(pid, signal.SIGKILL)
                break
        survivors = [rank for rank in range(3) if rank != victim]
        failed = ranks.collect("failed", 2, deadline)
        for rank in survivors:
            assert failed[rank]["segment"] == segment and failed[rank]["steps"] >= 8
            assert failed[rank]["verified_rows"] > 0, failed[rank]
        survivor_pids = {ranks.processes[rank].pid for rank in survivors}
        assert segment_users(segment) == survivor_pids, "the killed rank's mapping went with it"
        if victim == 0:
            ranks.spawn(restart_writer, spec)
            restarted = ranks.next({"restarted"}, deadline)[2]
            assert restarted["segment"] != segment and restarted["pid"] not in survivor_pids
        for rank in survivors:
            ranks.holds[rank].put("check again")
        rechecked = ranks.collect("rechecked", 2, deadline)
        assert {rank: rechecked[rank]["rechecked"] for rank in survivors} == {
            rank: failed[rank]["verified_rows"] for rank in survivors
        }
        ranks.join(deadline)
    assert wait_until_unused(segment, time.monotonic() + 10) == set()
    if victim == 0:
        assert wait_until_unused(restarted["segment"], time.monotonic() + 10) == set()


def _take_the_event_lock_and_stop(events) -> None:
    """Stands in for a process SIGKILLed while its feeder thread writes an event: it takes its event
    queue's write lock (CPython's ``Queue._wlock``, held by the feeder around each write) and keeps it."""
    events._wlock.acquire()
    time.sleep(3600)


def _report(rank: int, events) -> None:
    events.put(("done", rank, os.getpid()))
    events.close()
    events.join_thread()


def test_a_process_killed_holding_its_event_lock_does_not_silence_the_others(tmp_path):
    """The harness behind the SIGKILL test: events of the other processes still reach the test after one
    died with its event queue's write lock taken (the cause of that test's missed deadlines)."""
    deadline = time.monotonic() + EVENT_TIMEOUT_S
    with RankProcesses(RankSpec(world=0, init_file=str(tmp_path / "group"))) as ranks:
        victim = ranks.spawn(_take_the_event_lock_and_stop)
        lock = ranks.queues[-1]._wlock
        while lock.acquire(block=False):  # not taken yet: the victim is still starting
            lock.release()
            assert time.monotonic() < deadline, "the victim never took its event lock"
            time.sleep(0.05)
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(10)
        for rank in range(2):
            ranks.spawn(_report, rank)
        reports = ranks.collect("done", 2, deadline)
        ranks.join(deadline)
    assert sorted(reports) == [0, 1]
