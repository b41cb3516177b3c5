"""Two TP ranks of a PD decode instance share one host pool through SGLang's real classes (CPU, gloo).

Checks what PD needs of a shared pool: every rank registers regions of the same layout over the same
memory (each at its own addresses), so the identical bytes each prefill TP rank sends to its decode
rank land in the same rows; both ranks preallocate the same rows, admit the request offloaded, decode
it with every top-k row correct and promote it alike (the reader's copy reads the shared rows); a
retracted request's copy is restored by the writer alone; with DP attention, with the switch off and
without it (the default: off) every rank keeps its own pool.
"""

import pytest

pytestmark = pytest.mark.sglang

DEADLINE_S = 400.0  # each process imports SGLang (over 60 s on a loaded box)


def test_two_decode_ranks_share_the_pool_their_prefill_peers_write(tmp_path):
    from tp_share_peer import shared_pool_peer

    from hisparse_sglang.testing.tp_ranks import run_peers

    reports = run_peers(shared_pool_peer, 2, (str(tmp_path / "group"),), DEADLINE_S)
    writer, reader = reports[0], reports[1]
    assert writer["shared"][0] and reader["shared"][0]
    assert (writer["shared"][1], reader["shared"][1]) == (True, False), "rank 0 writes, rank 1 reads"
    assert writer["shared"][2] == reader["shared"][2], "one segment"
    assert writer["regions"] == reader["regions"], "the same region layout registered by both decode ranks"
    assert writer["prealloc rows"] == reader["prealloc rows"], "both ranks give the transfer the same host rows"
    assert writer["admitted as"] == reader["admitted as"] == "offloaded", "700 tokens exceed the 256-slot buffer"
    assert writer["mode"] == reader["mode"] == "resident", "promoted alike (its KV copied from the shared rows)"
    assert writer["restored"] and reader["restored"], "the writer's restore reached both; the reader's poison none"
    for report in (writer, reader):
        assert report["dp attention"] == (False, False, True)
        assert report["switched off"] == (False, False, True)
        assert report["default"] == (False, False, True), "share_host_pool_across_tp is opt-in"
