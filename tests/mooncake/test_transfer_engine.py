"""The engine wrapper and the control server in one process: two Mooncake engines over TCP loopback,
raw frames sent to a receiver's control port, and completions the receiver must refuse."""

from __future__ import annotations

import json
import socket
import struct
import time

import pytest
import torch
from mooncake_peers import POISON, DecodeHarness, build_source, wait_for

from hisparse_sglang.transfer import (
    KVSource,
    PeerUnreachableError,
    RemoteAddressRejectedError,
    Sender,
    SessionMismatchError,
    TransferAbortedError,
    TransferEngine,
    TransferSetupError,
    TransferTimeoutError,
)
from hisparse_sglang.transfer.protocol import TransferDone

pytestmark = pytest.mark.mooncake

REGION_BYTES = 1 << 20


@pytest.fixture
def engines(cleanup):
    target, source = TransferEngine(), TransferEngine()
    cleanup.extend([target, source])
    region = torch.full((3, REGION_BYTES), POISON, dtype=torch.uint8)  # guard, registered middle, guard
    target.register_regions([region[1].data_ptr()], [REGION_BYTES])
    data = torch.randint(0, 256, (REGION_BYTES,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    source.register_regions([data.data_ptr()], [REGION_BYTES])
    return target, source, region, data


def test_engine_splits_large_batches_and_merges_runs(engines):
    target, source, region, data = engines
    base, src = region[1].data_ptr(), data.data_ptr()
    pieces = torch.randperm(8192, generator=torch.Generator().manual_seed(1))[:5000]  # 5000 scattered 64-B pieces
    stats = source.write(target.session_id, src + pieces * 64, base + pieces * 64, [64] * 5000, timeout_s=30)
    assert (stats.entries, stats.merged_entries, stats.batches, stats.bytes) == (5000, 5000, 5, 320_000)
    rows = (pieces[:, None] * 64 + torch.arange(64)).reshape(-1)
    assert torch.equal(region[1][rows], data[rows])
    untouched = torch.ones(REGION_BYTES, dtype=torch.bool)
    untouched[rows] = False
    assert bool((region[1][untouched] == POISON).all())
    contiguous = torch.arange(100)
    stats = source.write(target.session_id, src + contiguous * 1000, base + contiguous * 1000, [1000] * 100)
    assert (stats.merged_entries, stats.batches, stats.bytes) == (1, 1, 100_000)
    assert torch.equal(region[1][:100_000], data[:100_000])


def test_engine_errors_are_typed(engines):
    target, source, region, data = engines
    base, src = region[1].data_ptr(), data.data_ptr()
    with pytest.raises(RemoteAddressRejectedError, match="outside its registered memory"):
        source.write(target.session_id, [src], [base + REGION_BYTES - 100], [4096], request_id="oob")
    with pytest.raises(RemoteAddressRejectedError, match="outside its registered memory"):
        source.write(target.session_id, [src], [region[0].data_ptr()], [64], request_id="before")
    assert bool((region[0] == POISON).all()) and bool((region[2] == POISON).all())
    with pytest.raises(PeerUnreachableError, match="127.0.0.1:1") as caught:
        source.write("127.0.0.1:1", [src], [base], [64], request_id="gone")
    assert caught.value.code == -102 and caught.value.request_id == "gone"
    with pytest.raises(TransferTimeoutError, match="missed its deadline"):
        source.write(target.session_id, [src], [base], [64], deadline=time.monotonic() - 1)
    target.verify_session(target.session_id, base)
    source.check_peer(target.session_id)
    with pytest.raises(SessionMismatchError, match="not the decode instance"):
        source.verify_session(target.session_id, base + 4096, request_id="r")
    with pytest.raises(TransferSetupError, match="-7 .ERR_ADDRESS_OVERLAPPED"):
        target.register_regions([base], [REGION_BYTES])
    with pytest.raises(TransferSetupError, match="was not registered with engine"):
        target.unregister_regions([base + 64])
    with pytest.raises(TransferSetupError, match="max_batch_entries .4096."):
        TransferEngine(max_batch_entries=4096)


def exchange(address: str, payload: bytes) -> dict:
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(payload)
        header = sock.recv(4, socket.MSG_WAITALL)
        (length,) = struct.unpack(">I", header)
        return json.loads(sock.recv(length, socket.MSG_WAITALL))


def frame(document: object) -> bytes:
    data = json.dumps(document).encode() if not isinstance(document, bytes) else document
    return struct.pack(">I", len(data)) + data


def test_malformed_control_messages_get_typed_rejects(cleanup):
    harness = DecodeHarness(2, 1152, 8, quarantine_s=0.1)
    cleanup.append(harness)
    address = harness.receiver.control_address
    cases = [
        (frame(b"not json"), "ControlProtocolError", "not JSON"),
        (frame({"v": 99, "type": "hello", "seq": 1, "body": {}}), "ControlProtocolError", "protocol version 99"),
        (frame({"v": 1, "type": "dance", "seq": 1, "body": {}}), "ControlProtocolError", "unknown type 'dance'"),
        (frame({"v": 1, "type": "grant", "seq": 1, "body": {}}), "ControlProtocolError", "only the decode side sends"),
        (frame({"v": 1, "type": "request", "seq": 1, "body": {"request_id": "x"}}), "ControlProtocolError",
         "lacks the field 'num_tokens'"),
        (frame({"v": 1, "type": "request", "seq": 1, "body": {"request_id": "x", "num_tokens": 0, "layer_num": 2,
         "row_bytes": 1152, "page_size": 64}}), "ControlProtocolError", "'num_tokens' must be >= 1, got 0"),
        (frame({"v": 1, "type": "done", "seq": 1, "body": {"request_id": "nobody", "instance_id": "i",
         "bytes_written": 5}}), "RequestRejectedError", "unknown request 'nobody'"),
        (frame({"v": 1, "type": "abort", "seq": 1, "body": {"request_id": "nobody", "error": {}}}),
         "RequestRejectedError", "cannot abort request 'nobody'"),
        (struct.pack(">I", 1 << 30), "ControlProtocolError", "announces 1073741824 bytes"),
    ]
    for payload, kind, text in cases:
        reply = exchange(address, payload)
        error = reply["body"]["error"]
        assert reply["type"] == "reject" and error["type"] == kind and text in error["message"], (text, reply)
    reply = exchange(address, frame({"v": 1, "type": "hello", "seq": 7, "body": {}}))
    assert reply["type"] == "layout" and reply["seq"] == 7 and reply["body"]["row_bytes"] == 1152
    harness.receiver.check_invariants()
    assert harness.receiver.stats()["free_pages"] == 7


def test_a_wrong_completion_fails_the_request_and_its_pages_age_out(cleanup):
    harness = DecodeHarness(4, 1152, 16, quarantine_s=0.3)
    cleanup.append(harness)
    specs = [{"id": "half", "seed": 1, "tokens": 130}, {"id": "stale", "seed": 2, "tokens": 70}]
    pool, src_pages = build_source(specs, 4, 1152, 64)
    sender = Sender(KVSource.from_host_pool(pool, 64))
    cleanup.append(sender)
    connection = sender.connect(harness.receiver.control_address)
    half = connection.request("half", 130)
    connection.write(half, src_pages["half"], layers=[0, 1])  # two of four layers, then claims done
    with pytest.raises(TransferAbortedError, match=r"reported 299520 bytes written, the request needs 599040"):
        connection.done(half)
    stale = connection.request("stale", 70)
    connection.write(stale, src_pages["stale"])
    with pytest.raises(SessionMismatchError, match="names decode instance 'another-instance'"):
        done = TransferDone("stale", "another-instance", 70 * 4 * 1152)
        connection.control.call("done", done.to_dict(), request_id="stale")
    outcomes = harness.wait(["half", "stale"])
    assert type(outcomes["half"].error) is TransferAbortedError and type(outcomes["stale"].error) is SessionMismatchError
    # the writer spoke after the failure, so its pages age out after the quarantine
    for request_id in ("half", "stale"):
        harness.receiver.release(request_id)
    wait_for(lambda: harness.receiver.stats()["free_pages"] == 15, 10)
    harness.receiver.check_invariants()
