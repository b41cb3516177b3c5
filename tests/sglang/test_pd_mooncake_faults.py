"""Faults on the real PD path: the installed SGLang's Mooncake connector (0.5.17-0.5.23) over TCP on
127.0.0.1, plain SGLang prefills (two of them), and the decode on hisparse-sglang's stack
(``pd_session.py`` says how).

One decode process lives through every fault, so that "the decode keeps serving" is what the later
steps do; the tests below each assert one fault's part of the session's record.

1. At once, on prefill0: ``good1`` completes; ``timed_out`` stalls after its first chunk until the
   decode's waiting timeout fails it; ``cancelled`` is aborted on the decode (SGLang's
   ``Scheduler.abort_request``) once its first chunk landed; ``wrong_room``'s prefill request carries
   another bootstrap room, so nothing arrives and the decode times it out (the prefill's request fails
   its bootstrap timeout). On prefill1: ``stale``'s first chunk lands, then prefill1 is paused
   (SIGSTOP) until the decode's heartbeat declares it lost and fails the request; ``bystander``
   (prefill0) is preallocated and transferred meanwhile; prefill1 resumes and writes the rest of
   ``stale`` into the room the decode gave up: the bytes must land only in that request's rows (held
   by SGLang's deferred release from 0.5.21, then by our quarantine), ``bystander`` intact. (From
   0.5.21 the resumed prefill may instead read the decode's abort notice first and drop the rest; on
   any release its send may fail after the pause, and the rest is then never written.)
2. ``killed``: prefill1 is SIGKILLed after the request's first chunk landed, while ``good2`` is
   mid-transfer on prefill0; once the decode has failed ``killed``, ``good2`` completes. (From 0.5.21
   the decode releases a failed request's KV only when its prefill acknowledges the abort, or
   ``DRAIN_ACK_WAIT_S`` later: a dead prefill never does.)
3. Once the first step's quarantine is over, ``after`` and ``dropped`` transfer (rows are handed out
   lowest first, so the later requests get the quarantined rows back); everything transferred is
   admitted; ``dropped`` is aborted in the waiting queue (SGLang's abort path -> our release hook);
   the rest finish; nothing may leak.

Every step waits on an event from a peer (a decode-side observation, never a timing guess), each
with a deadline. The session takes 80-150 s on 2 busy cores: the three SGLang imports, then the
waiting timeout (20 s) and the last quarantine (8 s).
"""

from __future__ import annotations

import signal
import time

import pytest
from packaging.version import Version
from pd_peer import NO_LEAKS, RequestSpec
from pd_session import PeerSession

from hisparse_sglang.integration.sglang import compat

pytestmark = [pytest.mark.sglang, pytest.mark.mooncake]

QUARANTINE_S = 8.0  # outlasts the stale write (a second or two after the failure)
STALE_SETTLE_S = 5.0  # how long the check of the stale write waits for its last bytes (below QUARANTINE_S)
# Longer than the heartbeat needs to declare a paused prefill lost (two probes of up to 2 s + 3 s):
# otherwise the waiting timeout would end the stale request first, and tell the prefill.
WAITING_TIMEOUT_S = 20
# SGLang 0.5.21+ (deferred decode KV release): how long the decode waits for a prefill's drain
# acknowledgement before it releases an aborted request's KV anyway (SGLang's default,
# SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT), left as it is.
DRAIN_ACK_WAIT_S = 30
DECODE_ENV = {
    "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": str(WAITING_TIMEOUT_S),
    # a prefill is declared lost after two failed /health probes 2 s apart (SGLang's minimum interval;
    # two, so that one slow answer on a loaded machine does not fail a healthy prefill)
    "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": "2",
    "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "2",
}
# From 0.5.21 the decode notifies the prefill of every failed request (the deferred KV release waits
# for its acknowledgement), a paused one too, which reads the notice when it resumes.
PREFILL_LEARNS_OF_ABORTS = Version(compat.sglang_version() or "0").release >= (0, 5, 21)
PREFILL_ENV = {"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "6"}

# Prefill pages are distinct across the session (both prefills hold the same values).
GOOD1 = RequestSpec("good1", room=101, tokens=150, prefill_pages=(5, 2, 7), first_token=11, chunk_end=128)
TIMED_OUT = RequestSpec(
    "timed_out", room=102, tokens=300, prefill_pages=(9, 1, 12, 3, 14), first_token=12, chunk_end=128, stall=True
)
CANCELLED = RequestSpec(
    "cancelled", room=103, tokens=200, prefill_pages=(16, 6, 18, 8), first_token=13, chunk_end=128, stall=True
)
WRONG_ROOM = RequestSpec("wrong_room", room=104, tokens=100, prefill_pages=(20, 10), first_token=14, prefill_room=904)
STALE = RequestSpec(
    "stale", room=105, tokens=250, prefill_pages=(21, 4, 23, 11), first_token=15, chunk_end=128, stall=True
)
BYSTANDER = RequestSpec("bystander", room=110, tokens=180, prefill_pages=(37, 32, 39), first_token=20)
GOOD2 = RequestSpec("good2", room=106, tokens=120, prefill_pages=(24, 13), first_token=16, chunk_end=64, stall=True)
KILLED = RequestSpec(
    "killed", room=107, tokens=300, prefill_pages=(25, 15, 27, 17, 29), first_token=17, chunk_end=128, stall=True
)
AFTER = RequestSpec(
    "after", room=108, tokens=400, prefill_pages=(30, 19, 31, 22, 33, 26, 35), first_token=18, chunk_end=192
)
DROPPED = RequestSpec("dropped", room=109, tokens=100, prefill_pages=(36, 28), first_token=19)
ON_PREFILL0 = (GOOD1, TIMED_OUT, CANCELLED, WRONG_ROOM)
FIRST_FAILED = (TIMED_OUT, CANCELLED, WRONG_ROOM, STALE)
TRANSFERRED = (GOOD1, BYSTANDER, GOOD2, AFTER, DROPPED)


def stale_may_be_dropped(status: dict) -> bool:
    """Whether the rest of ``stale`` may never have been written: from 0.5.21 the resumed prefill reads
    the decode's abort notice and may drop it; on any release its Mooncake send may fail after the pause
    (seen on 0.5.17 over TCP on 2 loaded cores: "Failed to send kv chunk of 105 to ..."), and the
    request is then Failed with nothing written past the first chunk."""
    return PREFILL_LEARNS_OF_ABORTS or status["status"] == "Failed"


def full(spec: RequestSpec) -> list:
    """A ``check`` expectation: every page and the index-K pages arrived."""
    return [len(spec.prefill_pages), True]


def first_chunk(spec: RequestSpec) -> list:
    return [spec.first_chunk_pages(), False]


def run_session() -> dict:
    """Drives the three steps; returns every event the tests assert on, keyed by what it shows."""
    record: dict = {"transferred": {}, "prefill_status": {}}
    with PeerSession(
        "bf16", prefills=2, quarantine_s=QUARANTINE_S, decode_env=DECODE_ENV, prefill_env=PREFILL_ENV,
        deadline_s=300,
    ) as session:
        port0, port1 = record["ports"] = session.ports
        session.wait_started()

        # 1. timeout, decode-side cancel and wrong room on prefill0; the stale room on prefill1
        session.send("prefill0", "add", specs=ON_PREFILL0)
        session.send("decode", "add", specs=ON_PREFILL0, bootstrap_port=port0)
        session.send("prefill1", "add", specs=[STALE])
        session.send("decode", "add", specs=[STALE], bootstrap_port=port1)
        session.wait("decode", "landed", "cancelled")
        session.send("decode", "abort", rid="cancelled")
        record["cancel_called"] = session.wait("decode", "abort_called", "cancelled")
        record["cancelled"] = session.wait("decode", "failed", "cancelled")
        record["prefill_status"]["cancelled"] = session.wait("prefill0", "status", "cancelled")
        record["transferred"]["good1"] = session.wait("decode", "transferred", "good1")
        # (each check names requests whose rows no later request can have been given yet)
        session.send("decode", "check", expect={"good1": full(GOOD1), "cancelled": first_chunk(CANCELLED)})
        record["check_cancelled"] = session.wait("decode", "checked")
        session.wait("decode", "landed", "stale")
        session.signal("prefill1", signal.SIGSTOP)
        session.wait("decode", "aborted", "stale")  # the heartbeat declared prefill1 lost
        session.send("prefill0", "add", specs=[BYSTANDER])
        session.send("decode", "add", specs=[BYSTANDER], bootstrap_port=port0)
        record["transferred"]["bystander"] = session.wait("decode", "transferred", "bystander")
        session.signal("prefill1", signal.SIGCONT)
        session.send("prefill1", "finish", rid="stale")
        record["prefill_status"]["stale"] = session.wait("prefill1", "status", "stale")
        # released (0.5.17 at once; from 0.5.21 once prefill1 acknowledges the abort, or after the wait)
        record["stale"] = session.wait("decode", "failed", "stale", timeout_s=DRAIN_ACK_WAIT_S + 30)
        others = {"good1": full(GOOD1), "bystander": full(BYSTANDER)}
        # The prefill's status can come before its transfer threads wrote the last bytes (seen once on
        # 2 loaded cores: the rest of stale still in flight), so the check is repeated until the rows
        # settle, for at most STALE_SETTLE_S (well inside the quarantine, and nothing else is sent).
        settle_until = time.monotonic() + STALE_SETTLE_S
        while True:
            session.send("decode", "check", expect={**others, "stale": full(STALE)})
            record["check_stale"] = session.wait("decode", "checked")
            if stale_may_be_dropped(record["prefill_status"]["stale"]) and record["check_stale"]["problems"]:
                # did the resumed prefill drop the rest instead? (a Failed status does not say: an abort
                # read after the write still concludes the request Failed)
                session.send("decode", "check", expect={**others, "stale": first_chunk(STALE)})
                record["check_stale"] = session.wait("decode", "checked")
            if not record["check_stale"]["problems"] or time.monotonic() > settle_until:
                break
            time.sleep(0.5)
        for spec in (TIMED_OUT, WRONG_ROOM):
            record[spec.rid] = session.wait("decode", "failed", spec.rid)
        for spec in (GOOD1, TIMED_OUT, WRONG_ROOM, BYSTANDER):
            record["prefill_status"][spec.rid] = session.wait("prefill0", "status", spec.rid)
        expect = {
            "good1": full(GOOD1), "bystander": full(BYSTANDER), "timed_out": first_chunk(TIMED_OUT),
            "wrong_room": [0, False],
        }
        session.send("decode", "check", expect=expect)
        record["check_first"] = session.wait("decode", "checked")

        # 2. prefill1 killed mid-transfer while good2 is mid-transfer on prefill0
        session.send("prefill1", "add", specs=[KILLED])
        session.send("decode", "add", specs=[KILLED], bootstrap_port=port1)
        session.send("prefill0", "add", specs=[GOOD2])
        session.send("decode", "add", specs=[GOOD2], bootstrap_port=port0)
        session.wait("decode", "landed", "killed")
        session.wait("decode", "landed", "good2")
        session.signal("prefill1", signal.SIGKILL)
        # the decode's heartbeat declares prefill1 lost and fails its request; good2 is still mid-transfer
        session.wait("decode", "aborted", "killed")
        session.send("prefill0", "finish", rid="good2")
        record["transferred"]["good2"] = session.wait("decode", "transferred", "good2")
        record["prefill_status"]["good2"] = session.wait("prefill0", "status", "good2")
        # its rows are released once the prefill acknowledges the abort, which a dead prefill never
        # does: from SGLang 0.5.21 the decode gives up waiting after DRAIN_ACK_WAIT_S
        record["killed"] = session.wait("decode", "failed", "killed", timeout_s=DRAIN_ACK_WAIT_S + 30)

        # 3. new requests once the first step's quarantine is over; admission, a waiting-queue abort, the end
        first_pages = {page for spec in FIRST_FAILED for page in record[spec.rid]["pages"]}
        record["released"] = []
        while not first_pages <= {page for event in record["released"] for page in event["pages"]}:
            record["released"].append(session.wait("decode", "released", timeout_s=QUARANTINE_S + 30))
        session.send("prefill0", "add", specs=[AFTER, DROPPED])
        session.send("decode", "add", specs=[AFTER, DROPPED], bootstrap_port=port0)
        for spec in (AFTER, DROPPED):
            record["transferred"][spec.rid] = session.wait("decode", "transferred", spec.rid)
            record["prefill_status"][spec.rid] = session.wait("prefill0", "status", spec.rid)
        session.send("decode", "check", expect={spec.rid: full(spec) for spec in TRANSFERRED})
        record["check_last"] = session.wait("decode", "checked")
        session.send("decode", "admit", rids=[spec.rid for spec in TRANSFERRED])
        record["admitted"] = session.wait("decode", "admitted")
        session.send("decode", "abort", rid="dropped")
        record["dropped"] = session.wait("decode", "abort_called", "dropped")
        session.send("decode", "release", rids=["good1", "bystander", "good2", "after"])
        session.send("decode", "drain", timeout_s=QUARANTINE_S + 10)
        record["leaks"] = session.wait("decode", "drained", timeout_s=QUARANTINE_S + 30)["leaks"]
        record["released"] += session.take("decode", "released")
        record["preallocated"] = {m["rid"]: m["pages"] for m in session.take("decode", "preallocated")}
        record["other_failures"] = session.take("decode", "failed")
    return record


@pytest.fixture(scope="module")
def session() -> dict:
    return run_session()


def assert_quarantined_then_freed(session: dict, rid: str) -> None:
    """The request's slot and our state are gone, each of its pages was held, and freed no sooner
    than pd_quarantine_s after the failure."""
    failed = session[rid]
    assert failed["finished_reason"] == "FINISH_ABORT"
    assert failed["slot_released"] and failed["coordinator_forgot"], failed
    assert failed["pages"] and all(failed["pages_held"]), failed
    for page in failed["pages"]:
        # the first release of the page after the failure (a page may be reused and held again later)
        released_at = min(e["time"] for e in session["released"] if page in e["pages"] and e["time"] > failed["time"])
        held_for = released_at - failed["time"]
        assert held_for >= QUARANTINE_S - 0.25, f"{rid}: page {page} freed after {held_for:.2f} s"


def assert_decode_kept_serving(session: dict) -> None:
    for name in ("check_cancelled", "check_stale", "check_first", "check_last"):
        assert session[name]["problems"] == [], name
    assert {rid: m["output_ids"] for rid, m in session["transferred"].items()} == {
        spec.rid: [spec.first_token] for spec in TRANSFERRED
    }
    assert session["admitted"]["problems"] == []
    assert session["other_failures"] == []
    assert session["leaks"] == NO_LEAKS


def test_prefill_killed_mid_transfer(session):
    reason = session["killed"]["reason"]
    assert f"Lost connection with prefill instance (bootstrap_addr: 127.0.0.1:{session['ports'][1]})" in reason, reason
    assert "rid='killed'" in reason
    assert_quarantined_then_freed(session, "killed")
    # good2 was mid-transfer on the other prefill when prefill1 died: it completed, byte for byte
    assert session["prefill_status"]["good2"]["status"] == "Success"
    assert_decode_kept_serving(session)


def test_transfer_that_times_out(session):
    reason = session["timed_out"]["reason"]
    assert f"Request 102 timed out after {WAITING_TIMEOUT_S}" in reason and "WaitingForInput" in reason, reason
    assert_quarantined_then_freed(session, "timed_out")
    # the prefill learnt of it (SGLang's abort notification) and its late last chunk was dropped:
    # check_first found exactly the first chunk in the request's rows and no index-K page
    assert session["prefill_status"]["timed_out"]["status"] == "Failed"
    assert session["check_first"]["problems"] == []
    assert_decode_kept_serving(session)


def test_request_cancelled_on_the_decode(session):
    # mid-transfer: SGLang's abort_request marks the receiver failed; the transfer queue then ends it
    assert session["cancel_called"]["was_waiting"] is False
    assert session["cancelled"]["reason"].endswith("Aborted by AbortReq."), session["cancelled"]["reason"]
    assert_quarantined_then_freed(session, "cancelled")
    # the prefill learnt of it and dropped the rest: exactly the first chunk is in its rows
    assert session["prefill_status"]["cancelled"]["status"] == "Failed"
    assert session["check_cancelled"]["problems"] == []
    # after the transfer, in the waiting queue: abort_request releases it at once (no quarantine)
    dropped = session["dropped"]
    assert dropped["was_waiting"] and dropped["tokenizer_aborts"] == ["dropped"]
    assert dropped["slot_released"] and dropped["coordinator_forgot"], dropped
    assert not any(dropped["pages_held"]), dropped
    assert_decode_kept_serving(session)


def test_wrong_and_stale_bootstrap_rooms(session):
    # wrong room: the prefill's request names room 904; nothing reaches room 104's rows
    reason = session["wrong_room"]["reason"]
    assert "Request 104 timed out after" in reason and "WaitingForInput" in reason, reason
    assert_quarantined_then_freed(session, "wrong_room")
    prefill_reason = session["prefill_status"]["wrong_room"]["reason"]
    assert "Request 904 timed out after" in prefill_reason and "Bootstrapping" in prefill_reason, prefill_reason
    # stale room: the decode gave up on room 105 while prefill1 was paused; prefill1 then wrote it anyway
    assert "Lost connection with prefill instance" in session["stale"]["reason"], session["stale"]["reason"]
    status = session["prefill_status"]["stale"]
    if PREFILL_LEARNS_OF_ABORTS:
        # told of the abort when it resumes, it may drop the rest (the rows then hold the first chunk,
        # which check_stale accepts) and concludes the request Failed, also after a write that landed
        assert status["status"] in ("Success", "Failed"), status
    elif status["status"] == "Failed":
        # not told of the abort: only a failed send after the pause may fail it (check_stale then holds
        # the first chunk and nothing else)
        assert f"Failed to send kv chunk of {STALE.room}" in (status["reason"] or ""), status
    else:
        assert status["status"] == "Success", status
    # the late bytes (if any) are in stale's rows and nowhere else; bystander, preallocated while they
    # were held, got other rows and kept its bytes
    assert session["check_stale"]["problems"] == []
    assert not set(session["preallocated"]["bystander"]) & set(session["stale"]["pages"])
    assert set(session["stale"]["pages"]) <= set(session["check_stale"]["held_pages"]), (
        "the late write came after the quarantine ended; raise QUARANTINE_S"
    )
    assert_quarantined_then_freed(session, "stale")
    assert_decode_kept_serving(session)


def test_decode_reuses_quarantined_rows_for_later_requests_and_leaks_nothing(session):
    # pages are handed out lowest first: once the first step's quarantine is over, the requests that
    # come later get its pages back
    first_pages = {page for spec in FIRST_FAILED for page in session[spec.rid]["pages"]}
    later_pages = {page for rid in ("killed", "good2", "after", "dropped") for page in session["preallocated"][rid]}
    assert later_pages & first_pages, (later_pages, first_pages)
    assert session["admitted"]["modes"] == {
        "good1": "resident", "bystander": "resident", "good2": "resident", "after": "offloaded", "dropped": "resident"
    }
    assert_decode_kept_serving(session)
