"""SGLang 0.5.17's own Mooncake PD connector, prefill -> HiSparse decode, two processes on 127.0.0.1.

The prefill is plain SGLang (DSA pool, PrefillBootstrapQueue, MooncakeKVSender, bootstrap server);
the decode is SGLang's DecodePreallocQueue / DecodeTransferQueue on hisparse-sglang's pool,
allocator and coordinator, with the plugin loaded through ``load_plugins()``. Mooncake runs over TCP
(``--disaggregation-transfer-backend mooncake_tcp``); no GPU is involved. ``pd_peer.py`` holds both
peers and says what each side runs.

What must hold:
* the decode KV manager registers the host pool (``coordinator.mem_pool_host``), page size 64 and the
  DSA index-K buffers as its ``KVArgs``;
* the prefill's pages (scattered, token counts not multiples of 64, one request sent in two
  chunks) land byte for byte in the host rows == the logical locations SGLang preallocated through
  our hooked ``alloc_for_decode_prealloc_hisparse``; index-K pages land at the logical page ids;
  no other host row, index page or device row is written (all poisoned first);
* ``admit_request_direct`` makes short requests resident on device rows holding those bytes and
  starts long ones offloaded; releasing everything leaves no row, buffer or slot in use;
* a request the decode gives up on (waiting timeout) goes through SGLang's failure path, which
  drops its HiSparse state and puts its rows in quarantine (a later request gets other rows; the
  prefill's late chunk is dropped by SGLang), while the other requests complete.

A run takes 10-30 s (two SGLang imports on 2 cores); the peers and the test have deadlines, so a
stuck transfer fails the test instead of hanging it.
"""

from __future__ import annotations

import multiprocessing
import socket
import time

import pytest

from pd_peer import LAYERS, LAYOUTS, NO_LEAKS, PAGE, RequestSpec, run_decode, run_prefill

pytestmark = [pytest.mark.sglang, pytest.mark.mooncake]

# Prefill pages 1..24 each used once, in no request order; token counts are not multiples of 64.
SPECS = [
    RequestSpec("short", room=1001, tokens=150, prefill_pages=(11, 12, 4), first_token=4242),
    RequestSpec(
        "long", room=1002, tokens=700, prefill_pages=(2, 15, 7, 16, 3, 13, 5, 17, 1, 14, 8), first_token=777,
        chunk_end=400,
    ),
    RequestSpec("mid", room=1003, tokens=250, prefill_pages=(20, 6, 22, 19), first_token=31337),
    RequestSpec("long2", room=1004, tokens=330, prefill_pages=(24, 10, 9, 18, 21, 23), first_token=9),
]
# device_buffer_size is 256: a request whose KV fits a buffer becomes resident at admission
EXPECTED_MODES = {"short": "resident", "mid": "resident", "long": "offloaded", "long2": "offloaded"}
PEER_DEADLINE_S = 45.0  # each peer gives up on its own after this
TEST_DEADLINE_S = 75.0  # and the test kills both after this (a normal run takes 10-30 s on 2 cores)


class Peers:
    """The prefill and decode processes (spawned, like SGLang's scheduler processes)."""

    def __init__(self, layout: str, specs: list[RequestSpec], decode_env: dict[str, str]) -> None:
        context = multiprocessing.get_context("spawn")
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            bootstrap_port = sock.getsockname()[1]
        self.started = time.monotonic()
        self.prefill_conn, prefill_child = context.Pipe()
        self.decode_conn, decode_child = context.Pipe()
        self.processes = [
            context.Process(
                target=run_prefill, args=(prefill_child, layout, specs, bootstrap_port, PEER_DEADLINE_S, {}),
                daemon=True,
            ),
            context.Process(
                target=run_decode, args=(decode_child, layout, specs, bootstrap_port, PEER_DEADLINE_S, decode_env),
                daemon=True,
            ),
        ]
        for process in self.processes:
            process.start()

    def receive(self, conn, expected_event: str) -> dict:
        remaining = TEST_DEADLINE_S - (time.monotonic() - self.started)
        if remaining <= 0 or not conn.poll(remaining):
            pytest.fail(f"no '{expected_event}' from a peer within {TEST_DEADLINE_S} s")
        message = conn.recv()
        if message["event"] == "error":
            pytest.fail(f"peer failed while waiting for '{expected_event}':\n{message['traceback']}")
        assert message["event"] == expected_event, message
        return message

    def close(self) -> None:
        for conn in (self.prefill_conn, self.decode_conn):
            try:
                conn.send("exit")
            except OSError:
                pass
        for process in self.processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)


def run_pair(layout: str, specs: list[RequestSpec], decode_env: dict[str, str] | None = None) -> tuple[dict, dict]:
    """Runs both peers; returns the decode's report and the prefill's final message."""
    peers = Peers(layout, specs, decode_env or {})
    try:
        peers.receive(peers.prefill_conn, "registered")
        peers.receive(peers.decode_conn, "ready")
        peers.decode_conn.send("go")
        peers.receive(peers.decode_conn, "concluded")
        prefill = peers.receive(peers.prefill_conn, "done")
        peers.decode_conn.send("check")
        decode = peers.receive(peers.decode_conn, "done")["report"]
        return decode, prefill
    finally:
        peers.close()


def assert_registration(decode: dict, layout: str) -> None:
    registration = decode["registration"]
    assert registration["kv_data_is_host_pool"]
    assert registration["kv_item_lens"] == [LAYOUTS[layout].row_bytes * PAGE] * LAYERS
    assert registration["page_size"] == PAGE and registration["is_mla_backend"]
    assert registration["dsa_state_is_index_k"], registration["state_types"]
    assert decode["prealloc_hook_applied"]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_sglang_mooncake_connector_writes_prefill_pages_into_hisparse_host_rows(layout):
    decode, prefill = run_pair(layout, SPECS)
    rids = sorted(spec.rid for spec in SPECS)

    assert_registration(decode, layout)
    assert decode["hook_captured_locations"] == {rid: True for rid in rids}
    assert prefill["status"] == {rid: "Success" for rid in rids}
    assert prefill["aborted"] == [] and decode["aborted"] == []
    assert decode["transferred"] == rids
    assert decode["first_tokens"] == {spec.rid: [spec.first_token] for spec in SPECS}
    dst_pages = decode["dst_pages"]
    assert any(b - a != 1 for pages in dst_pages.values() for a, b in zip(pages, pages[1:])), dst_pages

    landed = decode["landed"]
    assert landed["problems"] == []
    assert landed["host_rows_written"] == sum(len(spec.prefill_pages) for spec in SPECS) * PAGE
    assert landed["index_pages_written"] == sum(len(spec.prefill_pages) for spec in SPECS)
    assert decode["held_rows_untouched"]

    admitted = decode["admitted"]
    assert admitted["problems"] == []
    assert admitted["modes"] == EXPECTED_MODES
    assert admitted["buffers_used"] == 2
    assert decode["leaks"] == NO_LEAKS


FAILURE_SPECS = [
    RequestSpec("good", room=2001, tokens=150, prefill_pages=(5, 2, 7), first_token=11),
    RequestSpec(
        "stalled", room=2002, tokens=700, prefill_pages=(9, 1, 12, 3, 14, 4, 16, 6, 18, 8, 20), first_token=12,
        chunk_end=400, stall=True,
    ),
    RequestSpec("after", room=2003, tokens=100, prefill_pages=(21, 10), first_token=13, after_failures=True),
]


def test_request_the_decode_gives_up_on_is_released_through_the_quarantine():
    """The prefill sends the first chunk of "stalled", then nothing until the decode's waiting
    timeout fails it: SGLang aborts it and calls request_finished and release_kv_cache, which hold
    its host rows in quarantine; the prefill's late last chunk is dropped by SGLang. "after",
    preallocated during the quarantine, must get other rows; once it is over every row is free."""
    decode, prefill = run_pair("bf16", FAILURE_SPECS, decode_env={"SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "3"})

    assert_registration(decode, "bf16")
    assert prefill["status"] == {"good": "Success", "stalled": "Failed", "after": "Success"}
    assert decode["transferred"] == ["after", "good"] and decode["aborted"] == ["stalled"]
    assert decode["released_on_failure"] == {
        "stalled": {"slot_released": True, "coordinator_forgot": True, "finished_reason": "FINISH_ABORT"}
    }
    # right after the failure: good (3 pages) + the running request's page + stalled's 11 quarantined pages
    assert decode["logical_pages_in_use_after_first_wave"] == 3 + 1 + 11
    assert not set(decode["dst_pages"]["after"]) & set(decode["dst_pages"]["stalled"]), decode["dst_pages"]
    # stalled's first chunk (6 pages) sits in its quarantined rows; its other pages and its index-K
    # pages were never written: the late chunk did not reach the decode
    landed = decode["landed"]
    assert landed["problems"] == []
    assert landed["host_rows_written"] == (3 + 400 // PAGE + 2) * PAGE
    assert landed["index_pages_written"] == 3 + 2
    assert decode["held_rows_untouched"]
    assert decode["admitted"]["problems"] == []
    assert decode["admitted"]["modes"] == {"good": "resident", "after": "resident"}
    assert decode["leaks"] == NO_LEAKS
