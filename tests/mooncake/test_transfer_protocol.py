"""The transfer layer without a second process: message validation, error mapping, framing, run
merging, write entries and the decode ledger (a property test). No Mooncake engine is built."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hisparse_sglang.errors import HiSparseError
from hisparse_sglang.transfer.control import FrameBuffer, decode_message, encode_message, parse_address
from hisparse_sglang.transfer.engine import load_mooncake, mooncake_transfer_timeout_s
from hisparse_sglang.transfer.errors import (
    ControlProtocolError,
    LayoutMismatchError,
    PeerUnreachableError,
    RemoteAddressRejectedError,
    RequestRejectedError,
    SessionMismatchError,
    TransferEngineUnavailableError,
    TransferError,
    TransferSetupError,
    TransferTimeoutError,
    error_for_code,
    error_from_wire,
    error_to_wire,
    write_failure,
)
from hisparse_sglang.transfer.ledger import RequestLedger, RequestStatus
from hisparse_sglang.transfer.pages import OwnPages
from hisparse_sglang.transfer.protocol import (
    DecodeLayout,
    Reject,
    TransferAbort,
    TransferDone,
    TransferGrant,
    TransferRequest,
)
from hisparse_sglang.transfer.runs import KVSource, merge_runs, page_write_entries

pytestmark = pytest.mark.mooncake

LAYOUT = DecodeLayout(
    instance_id="abc",
    session_id="127.0.0.1:15000",
    protocol="tcp",
    layer_bases=(1 << 40, 2 << 40, 3 << 40),
    num_rows=64 * 16,
    row_bytes=1152,
    page_size=64,
    max_pages_per_request=8,
)


def test_import_loads_no_mooncake():
    code = textwrap.dedent(
        """
        import json, sys
        import hisparse_sglang.transfer
        from hisparse_sglang.transfer import control, engine, errors, ledger, pages, protocol, receiver, runs, sender
        print(json.dumps(sorted(m for m in sys.modules if m.startswith("mooncake"))))
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []


@pytest.mark.parametrize("blocked", [None, OSError("libibverbs.so.1: cannot open shared object file")])
def test_missing_mooncake_names_the_install_fix(monkeypatch, blocked):
    if blocked is None:
        monkeypatch.setitem(sys.modules, "mooncake.engine", None)  # import raises ImportError
    else:
        import builtins

        real_import = builtins.__import__

        def failing_import(name, *args, **kwargs):
            if name.startswith("mooncake"):
                raise blocked
            return real_import(name, *args, **kwargs)

        monkeypatch.delitem(sys.modules, "mooncake.engine", raising=False)
        monkeypatch.setattr(builtins, "__import__", failing_import)
    with pytest.raises(TransferEngineUnavailableError) as caught:
        load_mooncake()
    message = str(caught.value)
    assert "pip install 'hisparse-sglang[mooncake]'" in message and "libibverbs1" in message
    assert "mooncake-transfer-engine-non-cuda" in message and "GPU servers: mooncake-transfer-engine" in message
    assert isinstance(caught.value, HiSparseError)


def test_transfer_timeout_mirrors_mooncake_parsing():
    assert mooncake_transfer_timeout_s("2") == 5.0
    assert mooncake_transfer_timeout_s("12") == 12.0
    assert mooncake_transfer_timeout_s("x") == 5.0


# ---------------------------------------------------------------------- messages
def test_messages_round_trip_through_json():
    assert DecodeLayout.from_dict(json.loads(json.dumps(LAYOUT.to_dict()))) == LAYOUT
    request = TransferRequest("r1", 100, 3, 1152, 64)
    assert TransferRequest.from_dict(request.to_dict()) == request
    grant = TransferGrant("r1", "abc", LAYOUT.session_id, 100, (3, 9))
    assert TransferGrant.from_dict(json.loads(json.dumps(grant.to_dict()))) == grant
    grant.validate(LAYOUT)
    assert grant.rows(64)[:2] == [192, 193] and grant.rows(64)[64] == 576 and len(grant.rows(64)) == 100
    assert TransferDone.from_dict(TransferDone("r1", "abc", 7).to_dict()) == TransferDone("r1", "abc", 7)
    abort = TransferAbort.from_error("r1", TransferTimeoutError("slow"))
    assert type(TransferAbort.from_dict(abort.to_dict()).to_error()) is TransferTimeoutError
    reject = Reject.from_dict(Reject.from_error(None, LayoutMismatchError("shape")).to_dict())
    assert type(reject.to_error()) is LayoutMismatchError and str(reject.to_error()) == "decode rejected: shape"


@pytest.mark.parametrize(
    "change,text",
    [
        ({"row_bytes": True}, "field 'row_bytes' must be of type int, got True"),
        ({"row_bytes": 0}, "field 'row_bytes' must be >= 1, got 0"),
        ({"layer_bases": []}, "one positive address per layer"),
        ({"layer_bases": [1, "2"]}, "field 'layer_bases'[1] must be an integer"),
        ({"num_rows": 64}, "must hold at least 2 pages"),
        ({"session_id": None}, "field 'session_id' must be of type str"),
    ],
)
def test_layout_is_validated_on_receipt(change, text):
    with pytest.raises(ControlProtocolError, match=text.replace("[", r"\[")):
        DecodeLayout.from_dict({**LAYOUT.to_dict(), **change})
    document = LAYOUT.to_dict()
    del document["page_size"]
    with pytest.raises(ControlProtocolError, match="lacks the field 'page_size'"):
        DecodeLayout.from_dict(document)


REQUEST = {"request_id": "r", "num_tokens": 1, "layer_num": 1, "row_bytes": 1, "page_size": 1}


@pytest.mark.parametrize(
    "message,body,text",
    [
        (TransferRequest, {**REQUEST, "request_id": ""}, "1 to 512 characters"),
        (TransferRequest, {**REQUEST, "num_tokens": -5}, "'num_tokens' must be >= 1"),
        (TransferRequest, {**REQUEST, "layer_num": "61"}, "'layer_num' must be of type int"),
        (TransferDone, {"request_id": "r", "instance_id": "i", "bytes_written": -1}, "'bytes_written' must be >= 0"),
        (TransferDone, {"request_id": "r", "instance_id": 5, "bytes_written": 1}, "'instance_id' must be of type str"),
        (TransferAbort, {"request_id": "r", "error": "boom"}, "'error' must be of type dict"),
        (TransferGrant, {"request_id": "r", "instance_id": "i", "session_id": "s", "num_tokens": 1, "page_ids": [1.5]},
         r"'page_ids'\[0\] must be an integer"),
        (Reject, {"request_id": 3, "error": {}}, "'request_id' must be a string or null"),
    ],
)
def test_message_fields_are_validated(message, body, text):
    with pytest.raises(ControlProtocolError, match=text):
        message.from_dict(body)
    with pytest.raises(ControlProtocolError, match="must be a JSON object"):
        message.from_dict([body])


def test_layout_mismatch_names_every_difference():
    with pytest.raises(LayoutMismatchError) as caught:
        LAYOUT.check_source(layer_num=61, row_bytes=656, page_size=32, request_id="r9")
    message = str(caught.value)
    assert "layer count 61 != 3" in message and "row bytes 656 != 1152" in message and "page size 32 != 64" in message
    assert "'r9'" in message and "--kv-cache-dtype" in message and isinstance(caught.value, RequestRejectedError)


@pytest.mark.parametrize(
    "pages,tokens,instance,error,text",
    [
        ((1, 2), 100, "other", SessionMismatchError, "decode restarted"),
        ((1,), 100, "abc", ControlProtocolError, "1 pages for 100 tokens"),
        ((0, 2), 100, "abc", RemoteAddressRejectedError, "outside the decode pool"),
        ((3, 16), 100, "abc", RemoteAddressRejectedError, "outside the decode pool"),
        ((5, 5), 100, "abc", ControlProtocolError, "repeats a page"),
    ],
)
def test_grant_is_validated_against_the_layout(pages, tokens, instance, error, text):
    with pytest.raises(error, match=text):
        TransferGrant("r", instance, LAYOUT.session_id, tokens, pages).validate(LAYOUT)


# ---------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "code,operation,kind",
    [
        (-1, "write", TransferError),
        (-2, "write", TransferError),
        (-3, "write", RemoteAddressRejectedError),
        (-3, "unregister_memory", TransferSetupError),
        (-6, "write", TransferEngineUnavailableError),
        (-7, "register_memory", TransferSetupError),
        (-101, "write", PeerUnreachableError),
        (-102, "probe", PeerUnreachableError),
        (-103, "write", SessionMismatchError),
        (-104, "write", SessionMismatchError),
        (-200, "write", TransferEngineUnavailableError),
        (-302, "write", TransferEngineUnavailableError),
        (-999, "write", TransferError),
    ],
)
def test_mooncake_codes_become_typed_errors(code, operation, kind):
    error = error_for_code(code, operation=operation, peer="10.0.0.2:15001", request_id="req-3")
    assert type(error) is kind and isinstance(error, HiSparseError)
    message = str(error)
    assert message.startswith(f"{operation} of request 'req-3' with peer 10.0.0.2:15001 failed")
    assert f"returned {code}" in message and "Fix:" in message
    assert error.code == code and error.peer == "10.0.0.2:15001" and error.request_id == "req-3"


@pytest.mark.parametrize(
    "timed_out,probe,kind,text",
    [
        (True, None, TransferTimeoutError, "within MC_TRANSFER_TIMEOUT=5 s"),
        (False, None, PeerUnreachableError, "does not answer a probe"),
        (False, -102, PeerUnreachableError, "Mooncake returned -102"),
        (False, 0, RemoteAddressRejectedError, "first entry of the batch 0x1000, 64 bytes"),
    ],
)
def test_failed_write_batches_are_classified(timed_out, probe, kind, text):
    error = write_failure(
        -1, where="batch 2 of 3 of request 'r' failed.", peer="127.0.0.1:9", request_id="r", timed_out=timed_out,
        mooncake_timeout_s=5.0, probe=probe, destination=(0x1000, 64),
    )
    assert type(error) is kind and text in str(error) and "batch 2 of 3" in str(error)
    assert error.peer == "127.0.0.1:9" and error.request_id == "r"


def test_errors_cross_the_wire_with_their_type():
    sent = TransferTimeoutError("slow", request_id="r")
    received = error_from_wire(error_to_wire(sent), peer="p", request_id="r", prefix="x: ")
    assert type(received) is TransferTimeoutError and str(received) == "x: slow" and received.peer == "p"
    assert type(error_from_wire({"type": "KeyError", "message": "m"})) is TransferError
    assert type(error_from_wire("garbage")) is ControlProtocolError


# ---------------------------------------------------------------------- framing
def test_frames_split_across_chunks_and_envelopes_are_checked():
    buffer = FrameBuffer()
    wire = encode_message("hello", 1, {}) + encode_message("request", 2, {"a": 1})
    frames = buffer.feed(wire[:3]) + buffer.feed(wire[3:30]) + buffer.feed(wire[30:])
    assert [decode_message(frame)[:2] for frame in frames] == [("hello", 1), ("request", 2)]
    with pytest.raises(ControlProtocolError, match="protocol version 0"):
        decode_message(b'{"v": 0, "type": "hello", "seq": 1, "body": {}}')
    with pytest.raises(ControlProtocolError, match="'seq' must be an int"):
        decode_message(b'{"v": 1, "type": "hello", "seq": true, "body": {}}')
    with pytest.raises(ControlProtocolError, match="unknown type"):
        decode_message(b'{"v": 1, "type": "x", "seq": 1, "body": {}}')
    with pytest.raises(ControlProtocolError, match="announces"):
        FrameBuffer().feed(b"\xff\xff\xff\xff")
    assert parse_address("127.0.0.1:80") == ("127.0.0.1", 80)
    for bad in ("127.0.0.1", "127.0.0.1:0", "host:http"):
        with pytest.raises(ControlProtocolError, match="host:port"):
            parse_address(bad)


# ---------------------------------------------------------------------- write entries
def naive_merge(src, dst, lengths):
    out = []
    for s, d, n in zip(src, dst, lengths):
        if n == 0:
            continue
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1][2] += n
        else:
            out.append([s, d, n])
    return out


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.booleans(), st.booleans(), st.integers(0, 5)), max_size=40))
def test_merge_runs_matches_a_naive_merge(steps):
    src, dst, lengths, s, d = [], [], [], 1000, 5000
    for gap, jump_src, jump_dst, length in steps:
        s += gap * 7 if jump_src else 0
        d += gap * 11 if jump_dst else 0
        src.append(s), dst.append(d), lengths.append(length)
        s, d = s + length, d + length
    merged = merge_runs(src, dst, lengths)
    assert [list(t) for t in zip(*(m.tolist() for m in merged))] == naive_merge(src, dst, lengths)


def test_merge_runs_rejects_bad_lists():
    with pytest.raises(TransferSetupError, match="2 source addresses, 1 destinations and 1 lengths"):
        merge_runs([1, 2], [3], [4])
    with pytest.raises(TransferSetupError, match="negative length"):
        merge_runs([1], [3], [-4])


@pytest.mark.parametrize("tokens", [1, 63, 64, 65, 200])
def test_page_write_entries_cover_exactly_the_request_rows(tokens):
    source = KVSource(layer_bases=(10 << 30, 20 << 30, 30 << 30), num_rows=64 * 10, row_bytes=1152, page_size=64)
    pages = (tokens + 63) // 64
    grant = TransferGrant("r", "abc", LAYOUT.session_id, tokens, tuple(range(11, 11 + 2 * pages, 2)))
    src_pages = list(range(pages - 1, -1, -1))
    src, dst, lengths = page_write_entries(source, LAYOUT, grant, src_pages)
    expected = set()
    for layer in range(3):
        for token in range(tokens):
            src_row = src_pages[token // 64] * 64 + token % 64
            dst_row = grant.rows(64)[token]
            expected.add((source.layer_bases[layer] + src_row * 1152, LAYOUT.layer_bases[layer] + dst_row * 1152))
    covered = set()
    for s, d, n in zip(src.tolist(), dst.tolist(), lengths.tolist()):
        assert n % 1152 == 0
        covered.update((s + k * 1152, d + k * 1152) for k in range(n // 1152))
    assert covered == expected
    with pytest.raises(TransferSetupError, match="source pages were given"):
        page_write_entries(source, LAYOUT, grant, src_pages + [0])
    with pytest.raises(TransferSetupError, match="outside the source pool"):
        page_write_entries(source, LAYOUT, grant, [10] * pages)


# ---------------------------------------------------------------------- ledger
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("open"), st.sampled_from([None, "w1", "w2"]), st.integers(1, 700)),
        st.tuples(st.just("complete"), st.integers(0, 30), st.none()),
        st.tuples(st.just("fail"), st.integers(0, 30), st.booleans()),
        st.tuples(st.just("gone"), st.sampled_from(["w1", "w2"]), st.none()),
        st.tuples(st.just("release"), st.integers(0, 30), st.booleans()),
        st.tuples(st.just("tick"), st.floats(0.0, 3.0), st.none()),
    ),
    max_size=60,
)


@settings(max_examples=int(os.environ.get("HISPARSE_PROPERTY_EXAMPLES", "10000")) // 20, deadline=None)
@given(OPS)
def test_ledger_never_reuses_pages_a_writer_may_still_write(ops):
    """After every step each page is free, held or quarantined, exactly once; a page of a failed
    request is granted again only after its writer went quiet and quarantine_s passed."""
    quarantine_s = 1.0
    pages = OwnPages(40, 64)
    ledger = RequestLedger(pages, transfer_timeout_s=5.0, quarantine_s=quarantine_s, max_pages_per_request=12)
    writers = {"w1": object(), "w2": object()}
    name_of = {id(obj): name for name, obj in writers.items()}
    alive = {"w1": True, "w2": True}
    now, names, handed_over = 0.0, [], []
    dirty: dict[int, list] = {}  # page -> [writer name or None, time it went quiet or None]

    def failed(record, writer_quiet: bool) -> None:
        writer = None if record.owner is None else name_of[id(record.owner)]
        quiet = writer_quiet or writer is None or not alive[writer]
        for page in record.pages:
            dirty[page] = [writer, now if quiet else None]

    for op, a, b in ops:
        record = None
        if op in ("complete", "fail", "release") and names:
            record = ledger.records.get(names[a % len(names)])
        if op == "open":
            owner = writers[a] if a is not None and alive[a] else None
            try:
                opened = ledger.open(f"r{len(names)}", b, owner, now)
            except RequestRejectedError:
                continue
            names.append(opened.request_id)
            for page in opened.pages:
                writer, quiet_since = dirty.pop(page, [None, -quarantine_s])
                assert quiet_since is not None and now >= quiet_since + quarantine_s, f"page {page} reused too early"
        elif op == "complete" and record is not None and record.status == RequestStatus.OPEN:
            ledger.complete(record.request_id, record.owner, now)
        elif op == "fail" and record is not None and record.status == RequestStatus.OPEN:
            ledger.fail(record.request_id, TransferError("test"), now, writer_quiet=b)
            failed(record, b)
        elif op == "release" and record is not None and record.status != RequestStatus.OPEN:
            hand_over = b and record.status == RequestStatus.COMPLETED
            ledger.release(record.request_id, free_pages=not hand_over)
            if hand_over:
                handed_over.extend(record.pages)
        elif op == "gone" and alive[a]:
            alive[a] = False
            for entry in dirty.values():
                if entry[0] == a and entry[1] is None:
                    entry[1] = now
            for lost in ledger.owner_gone(writers[a], now):
                failed(lost, True)
        elif op == "tick":
            now += a
            for expired in ledger.expire(now):
                failed(expired, False)
            ledger.release_quarantined(now)
        ledger.check_invariants(exclusive=False)
        assert len(ledger.held_pages()) + len(handed_over) + pages.free_page_count == 39
    # everything ends: writers go, open requests time out, the quarantine drains, records are released
    for writer in writers.values():
        ledger.owner_gone(writer, now)
    now += 10.0
    ledger.expire(now)
    now += 10.0
    ledger.release_quarantined(now)
    for name in list(ledger.records):
        ledger.release(name)
    pages.free_pages(handed_over)
    ledger.check_invariants()
    assert pages.free_page_count == 39 and ledger.quarantined_pages == 0
