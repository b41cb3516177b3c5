"""Prefill -> decode KV transfers through Mooncake over TCP on 127.0.0.1 (P2PHANDSHAKE), with faults.

The decode receiver runs in the test process (or, where the decode itself is stopped, in a child)
and the prefill writers in child processes (``mooncake_peers.py``). Every row written is unique,
every row nobody may write is poisoned; each fault must fail exactly the affected request with a
typed error, quarantine its pages, keep other requests going and leave the decode serving.

No test contacts a silent Mooncake peer for the first time (that blocks an engine for 60 s): a
writer stops itself only after its first write, and the stopped-decode test stops the decode only
after the sender's first write to it.
"""

from __future__ import annotations

import json
import signal
import time

import pytest
from mooncake_peers import POISON, Child, DecodeHarness, build_source, wait_for

from hisparse_sglang.transfer import KVSource, Sender, TransferTimeoutError

pytestmark = pytest.mark.mooncake


def writer(control: str, specs: list[dict], *extra: str) -> Child:
    return Child("write", "--control", control, "--requests", json.dumps(specs), *extra)


def fragment(harness: DecodeHarness, count: int = 12) -> None:
    """Leave every other page of the first ``count`` free, so grants are scattered."""
    for index in range(count):
        harness.receiver.allocate(f"filler-{index}", harness.receiver.page_size)
    for index in range(0, count, 2):
        harness.receiver.abort(f"filler-{index}", "test fragmentation")
    wait_for(lambda: harness.receiver.stats()["quarantined_pages"] == 0, 10)


def pages_of(tokens: int, page_size: int = 64) -> int:
    return (tokens + page_size - 1) // page_size


@pytest.mark.parametrize("row_bytes,layers", [(1152, 4), (656, 3)])
def test_scattered_pages_of_every_layer_arrive_exactly(row_bytes, layers, cleanup):
    harness = DecodeHarness(layers, row_bytes, 96, quarantine_s=0.3)
    cleanup.append(harness)
    fragment(harness)
    specs_a = [
        {"id": "a1", "seed": 11, "tokens": 300},
        {"id": "a2", "seed": 12, "tokens": 64},
        {"id": "a3", "seed": 13, "tokens": 1},
    ]
    specs_b = [{"id": "b1", "seed": 21, "tokens": 1000}, {"id": "b2", "seed": 22, "tokens": 130}]
    common = ("--layers", str(layers), "--row-bytes", str(row_bytes))
    writers = [
        writer(harness.receiver.control_address, specs_a, *common, "--shuffle-seed", "1"),
        writer(harness.receiver.control_address, specs_b, *common, "--shuffle-seed", "2"),
    ]
    cleanup.extend(writers)
    records = {**writers[0].finish(), **writers[1].finish()}
    assert all(records[s["id"]]["ok"] for s in specs_a + specs_b), records
    outcomes = harness.wait([s["id"] for s in specs_a + specs_b])
    assert all(o.ok for o in outcomes.values())
    # destinations are scattered (the holes left by fragment()) and sources were shuffled
    all_pages = sorted(p for s in specs_a + specs_b for p in records[s["id"]]["pages"])
    assert any(b - a > 1 for a, b in zip(all_pages, all_pages[1:]))
    assert records["b1"]["entries"] == layers * pages_of(1000)
    report = harness.verify(specs_a + specs_b)
    assert report["bytes_ok"] == {s["id"]: True for s in specs_a + specs_b}, report
    assert report["untouched_poisoned"], report
    for spec in specs_a + specs_b:
        harness.receiver.release(spec["id"])
    harness.receiver.check_invariants()
    assert harness.receiver.stats()["free_pages"] == 95 - 6  # the six fillers fragment() keeps


def test_writer_killed_mid_transfer_fails_only_its_request(cleanup):
    harness = DecodeHarness(4, 1152, 64, quarantine_s=3.0)
    cleanup.append(harness)
    control = harness.receiver.control_address
    killed = writer(
        control,
        [{"id": "ok1", "seed": 1, "tokens": 200}, {"id": "dead", "seed": 2, "tokens": 500, "fault": "kill-mid"}],
    )
    survivor = writer(
        control,
        [{"id": "ok2", "seed": 3, "tokens": 300}, {"id": "after", "seed": 4, "tokens": 63 * 64, "after_stdin": True}],
        "--shuffle-seed", "5",
    )
    cleanup.extend([killed, survivor])
    killed.finish()
    assert killed.process.wait(timeout=10) == -signal.SIGKILL
    assert killed.records["ok1"]["ok"] and killed.records["dead"]["progress"] == "half written"
    outcomes = harness.wait(["ok1", "dead", "ok2"])
    dead = outcomes["dead"]
    assert dead.status == "failed" and type(dead.error).__name__ == "SenderLostError"
    assert "'dead'" in str(dead.error) and "disconnected" in str(dead.error) and "quarantined" in str(dead.error)
    assert harness.receiver.stats()["quarantined_pages"] == pages_of(500)
    assert outcomes["ok1"].ok and outcomes["ok2"].ok
    report = harness.verify([{"id": "ok1", "seed": 1, "tokens": 200}, {"id": "ok2", "seed": 3, "tokens": 300}])
    assert all(report["bytes_ok"].values()) and report["untouched_poisoned"], report
    # after the quarantine every page is reusable: a request taking the whole pool succeeds
    for request_id in ("ok1", "ok2", "dead"):
        harness.receiver.release(request_id)
    wait_for(lambda: harness.receiver.stats()["quarantined_pages"] == 0, 10)
    assert harness.receiver.stats()["free_pages"] == 63
    survivor.read_until("after", key="progress")
    survivor.send_line()
    records = survivor.finish()
    assert records["ok2"]["ok"] and records["after"]["ok"], records
    assert set(records["after"]["pages"]) >= set((dead.rows // 64).tolist())
    report = harness.verify([{"id": "after", "seed": 4, "tokens": 63 * 64}])
    assert report["bytes_ok"]["after"], report
    harness.receiver.check_invariants()


def test_wrong_session_id_aborts_the_grant_before_writing(cleanup):
    harness = DecodeHarness(4, 1152, 64, quarantine_s=0.3)
    decoy = DecodeHarness(4, 1152, 64, quarantine_s=0.3)  # another live decode: a misrouted session
    cleanup.extend([harness, decoy])
    specs = [
        {"id": "good1", "seed": 1, "tokens": 100},
        {"id": "misrouted", "seed": 2, "tokens": 100, "session": decoy.receiver.session_id},
        {"id": "closed", "seed": 3, "tokens": 100, "session": "127.0.0.1:1"},
        {"id": "good2", "seed": 4, "tokens": 100},
    ]
    child = writer(harness.receiver.control_address, specs)
    cleanup.append(child)
    records = child.finish()
    assert records["good1"]["ok"] and records["good2"]["ok"], records
    for request_id, session in (("misrouted", decoy.receiver.session_id), ("closed", "127.0.0.1:1")):
        assert records[request_id]["error_type"] == "SessionMismatchError", records[request_id]
        assert session in records[request_id]["message"] and request_id in records[request_id]["message"]
    outcomes = harness.wait([s["id"] for s in specs])
    for request_id in ("misrouted", "closed"):
        error = outcomes[request_id].error
        assert type(error).__name__ == "SessionMismatchError" and str(error).startswith("prefill aborted: ")
    report = harness.verify([specs[0], specs[3]])
    assert all(report["bytes_ok"].values()) and report["untouched_poisoned"], report
    assert all(bool((layer == POISON).all()) for layer in decoy.pool.layers)
    for spec in specs:
        harness.receiver.release(spec["id"])
    wait_for(lambda: harness.receiver.stats()["free_pages"] == 63, 10)
    harness.receiver.check_invariants()


def test_stopped_writer_times_out_on_the_decode_side(cleanup):
    harness = DecodeHarness(4, 1152, 64, transfer_timeout_s=3.0, quarantine_s=0.3)
    cleanup.append(harness)
    control = harness.receiver.control_address
    stopped = writer(control, [{"id": "stuck", "seed": 1, "tokens": 500, "fault": "stop-mid"}])
    other = writer(
        control,
        [{"id": "ok", "seed": 2, "tokens": 300}, {"id": "later", "seed": 3, "tokens": 200, "after_stdin": True}],
        "--shuffle-seed", "3",
    )
    cleanup.extend([stopped, other])
    stopped.read_until("stuck", key="progress")
    outcome = harness.wait(["stuck"], timeout_s=20)["stuck"]
    assert type(outcome.error).__name__ == "TransferTimeoutError" and "'stuck'" in str(outcome.error)
    assert "timed out on the decode side" in str(outcome.error)
    other.read_until("ok")
    assert harness.wait(["ok"])["ok"].ok
    # the stopped writer may resume and write: its pages stay quarantined while it lives
    time.sleep(1.0)
    assert harness.receiver.stats()["quarantined_pages"] == pages_of(500)
    stopped.kill()
    wait_for(lambda: harness.receiver.stats()["quarantined_pages"] == 0, 10)
    other.read_until("later", key="progress")
    other.send_line()
    records = other.finish()
    assert records["later"]["ok"], records
    report = harness.verify([{"id": "ok", "seed": 2, "tokens": 300}, {"id": "later", "seed": 3, "tokens": 200}])
    assert all(report["bytes_ok"].values()) and report["untouched_poisoned"], report
    harness.receiver.check_invariants()


def test_writer_that_never_reports_done_gets_a_typed_timeout(cleanup):
    harness = DecodeHarness(4, 1152, 64, transfer_timeout_s=1.5, quarantine_s=0.3)
    cleanup.append(harness)
    child = writer(
        harness.receiver.control_address,
        [
            {"id": "slow", "seed": 1, "tokens": 200, "fault": "late-done", "delay": 3.0},
            {"id": "next", "seed": 2, "tokens": 100},
        ],
    )
    cleanup.append(child)
    child.read_until("slow", key="progress")
    outcome = harness.wait(["slow"], timeout_s=20)["slow"]
    assert type(outcome.error).__name__ == "TransferTimeoutError"
    assert harness.receiver.stats()["quarantined_pages"] == pages_of(200)  # the writer is alive and silent
    records = child.finish()
    # its late "done" is refused with the decode's timeout; speaking makes the writer quiet: pages age out
    assert records["slow"]["error_type"] == "TransferTimeoutError" and "'slow'" in records["slow"]["message"], records
    assert records["next"]["ok"], records
    harness.receiver.release("slow")
    harness.receiver.release("next")
    wait_for(lambda: harness.receiver.stats()["free_pages"] == 63, 10)
    harness.receiver.check_invariants()


def test_decode_rejects_bad_requests_and_keeps_serving(cleanup):
    harness = DecodeHarness(4, 1152, 32, quarantine_s=0.3, max_pages_per_request=8)
    cleanup.append(harness)
    for index in range(3):  # 20 of 31 pages taken: 11 free
        harness.receiver.allocate(f"held-{index}", [8, 8, 4][index] * 64)
    specs = [
        {"id": "fp8-rows", "seed": 1, "tokens": 100, "row_bytes": 656},
        {"id": "three-layers", "seed": 2, "tokens": 100, "layers": 3},
        {"id": "too-long", "seed": 3, "tokens": 9 * 64},
        {"id": "good1", "seed": 4, "tokens": 7 * 64},
        {"id": "no-room", "seed": 5, "tokens": 5 * 64},
        {"id": "good2", "seed": 6, "tokens": 100},
    ]
    child = writer(harness.receiver.control_address, specs)
    cleanup.append(child)
    records = child.finish()
    expected = {
        "fp8-rows": ("LayoutMismatchError", "row bytes 656 != 1152"),
        "three-layers": ("LayoutMismatchError", "layer count 3 != 4"),
        "too-long": ("RequestRejectedError", "it needs 9 pages of 64 tokens (576 tokens), more than the 8"),
        "no-room": ("RequestRejectedError", "it needs 5 pages but only 4 are free"),
    }
    outcomes = harness.wait([s["id"] for s in specs])
    for request_id, (kind, text) in expected.items():
        assert records[request_id]["error_type"] == kind and text in records[request_id]["message"], records[request_id]
        assert records[request_id]["message"].startswith("decode rejected: ") and "pages" not in records[request_id]
        assert type(outcomes[request_id].error).__name__ == kind and text in str(outcomes[request_id].error)
        assert outcomes[request_id].rows.numel() == 0
    assert records["good1"]["ok"] and records["good2"]["ok"], records
    assert harness.receiver.stats()["free_pages"] == 11 - 7 - 2
    report = harness.verify([specs[3], specs[5]])
    assert all(report["bytes_ok"].values()) and report["untouched_poisoned"], report
    harness.receiver.check_invariants()


def test_stopped_decode_times_out_the_sender(cleanup):
    """MC_TRANSFER_TIMEOUT=5: a write to a stopped decode fails as TransferTimeoutError; the decode recovers."""
    decode = Child("serve", "--pages", "64", "--quarantine", "0.3")
    cleanup.append(decode)
    address = decode.next_json(timeout_s=30)
    specs = [{"id": "A", "seed": 1, "tokens": 300}, {"id": "B", "seed": 2, "tokens": 500}]
    specs.append({"id": "C", "seed": 3, "tokens": 200})
    pool, src_pages = build_source(specs, 4, 1152, 64)
    sender = Sender(KVSource.from_host_pool(pool, 64), mooncake_timeout_s=5, control_timeout_s=3.0)
    cleanup.append(sender)
    connection = sender.connect(address["control"])
    connection.send(connection.request("A", 300), src_pages["A"])
    grant_b = connection.request("B", 500)
    decode.stop()
    started = time.monotonic()
    try:
        # write and done separately, so a failure says which of the two did not time out
        with pytest.raises(TransferTimeoutError) as caught:
            stats = connection.write(grant_b, src_pages["B"])
            pytest.fail(f"a write to the stopped decode returned after {time.monotonic() - started:.2f} s: {stats}")
        elapsed = time.monotonic() - started
        assert not connection.abort("B", caught.value)  # the stopped decode cannot acknowledge it
    finally:
        decode.process.send_signal(signal.SIGCONT)
    assert 4.5 < elapsed < 20.0, (elapsed, str(caught.value))
    assert "'B'" in str(caught.value) and "MC_TRANSFER_TIMEOUT=5" in str(caught.value)
    connection.send(connection.request("C", 200), src_pages["C"])  # the late reply to B's abort is skipped
    summary = decode.ask({"cmd": "wait", "ids": ["A", "B", "C"], "timeout": 20})
    assert summary["A"]["status"] == summary["C"]["status"] == "completed", summary
    assert summary["B"]["status"] == "failed" and summary["B"]["error_type"] == "TransferTimeoutError", summary
    report = decode.ask({"cmd": "verify", "requests": [specs[0], specs[2]]})
    assert all(report["bytes_ok"].values()) and report["untouched_poisoned"], report
    decode.process.stdin.close()
    assert decode.process.wait(timeout=20) == 0
