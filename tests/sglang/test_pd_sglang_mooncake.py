"""SGLang 0.5.17's own Mooncake PD connector, prefill -> HiSparse decode, two processes on 127.0.0.1.

The prefill is plain SGLang (DSA pool, PrefillBootstrapQueue, MooncakeKVSender, bootstrap server);
the decode is SGLang's DecodePreallocQueue / DecodeTransferQueue on hisparse-sglang's pool,
allocator and coordinator, with the plugin loaded through ``load_plugins()``. Mooncake runs over TCP
(``--disaggregation-transfer-backend mooncake_tcp``); no GPU is involved. ``pd_peer.py`` and
``pd_decode_peer.py`` hold the peers and say what each side runs. The faults are in
``test_pd_mooncake_faults.py``.

What must hold:
* the decode KV manager registers the host pool (``coordinator.mem_pool_host``), page size 64 and the
  DSA index-K buffers as its ``KVArgs``;
* the prefill's pages (scattered, token counts not multiples of 64, one request sent in two
  chunks) land byte for byte in the host rows == the logical locations SGLang preallocated through
  our hooked ``alloc_for_decode_prealloc_hisparse``; index-K pages land at the logical page ids;
  no other host row, index page or device row is written (all poisoned first);
* ``admit_request_direct`` makes short requests resident on device rows holding those bytes and
  starts long ones offloaded; releasing everything leaves no row, buffer or slot in use;
* our hook saw Mooncake register the host pool (return code 0), and a registration Mooncake refuses
  (the same regions once more: ERR_ADDRESS_OVERLAPPED) raises our typed error instead of being
  ignored as SGLang 0.5.17 does.

A run takes 40-75 s on 2 busy cores (two SGLang imports); every wait has a deadline.
"""

from __future__ import annotations

import pytest
from pd_peer import LAYERS, LAYOUTS, NO_LEAKS, PAGE, RequestSpec
from pd_session import PeerSession

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


def assert_registration(ready: dict, layout: str) -> None:
    registration = ready["registration"]
    assert registration["kv_data_is_host_pool"]
    assert registration["kv_item_lens"] == [LAYOUTS[layout].row_bytes * PAGE] * LAYERS
    assert registration["page_size"] == PAGE and registration["is_mla_backend"]
    assert registration["dsa_state_is_index_k"], registration["state_types"]
    assert ready["prealloc_hook_applied"]
    assert ready["registration_log"] == [
        f"HiSparse: host KV pool registered with Mooncake ({LAYERS} regions, "
        f"{registration['kv_data_lens'][0] * LAYERS / 2**30:.2f} GiB in all)."
    ], ready["registration_log"]


def full(spec: RequestSpec) -> list:
    """A ``check`` expectation: every page and the index-K pages arrived."""
    return [len(spec.prefill_pages), True]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_sglang_mooncake_connector_writes_prefill_pages_into_hisparse_host_rows(layout):
    rids = sorted(spec.rid for spec in SPECS)
    with PeerSession(layout) as session:
        ready = session.wait_started()
        session.send("prefill0", "add", specs=SPECS)
        session.send("decode", "add", specs=SPECS, bootstrap_port=session.ports[0])
        transferred = {rid: session.wait("decode", "transferred", rid) for rid in rids}
        statuses = {rid: session.wait("prefill0", "status", rid)["status"] for rid in rids}
        session.send("decode", "check", expect={spec.rid: full(spec) for spec in SPECS})
        check = session.wait("decode", "checked")
        session.send("decode", "admit", rids=rids)
        admitted = session.wait("decode", "admitted")
        session.send("decode", "release", rids=rids)
        session.send("decode", "drain", timeout_s=10)
        leaks = session.wait("decode", "drained")["leaks"]
        session.send("decode", "register_again")
        register_again = session.wait("decode", "registered_again")
        preallocated = {m["rid"]: m for m in session.take("decode", "preallocated")}
        failed = session.take("decode", "failed")

    assert_registration(ready, layout)
    assert {rid: m["captured"] for rid, m in preallocated.items()} == {rid: True for rid in rids}
    assert statuses == {rid: "Success" for rid in rids} and failed == []
    assert {rid: m["output_ids"] for rid, m in transferred.items()} == {s.rid: [s.first_token] for s in SPECS}
    dst_pages = {rid: m["pages"] for rid, m in preallocated.items()}
    assert any(b - a != 1 for pages in dst_pages.values() for a, b in zip(pages, pages[1:])), dst_pages

    assert check["problems"] == []
    assert check["host_rows_written"] == sum(len(spec.prefill_pages) for spec in SPECS) * PAGE
    assert check["index_pages_written"] == sum(len(spec.prefill_pages) for spec in SPECS)

    assert admitted["problems"] == []
    assert admitted["modes"] == EXPECTED_MODES
    assert admitted["buffers_used"] == 2
    assert leaks == NO_LEAKS
    error = register_again["error"]
    assert error and "return code -7 (ERR_ADDRESS_OVERLAPPED" in error and "ulimit -l" in error, error
