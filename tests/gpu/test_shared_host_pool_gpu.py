"""Two processes on one GPU share a pinned host pool (memory/shared_host_pool.py) through the CUDA ops.

* Two TP ranks (testing/tp_ranks.py on "cuda") run the same random request lifecycles with the
  coordinator and the CUDA swap-in, copy and bind ops: rank 0 backs up and stages, rank 1 only reads;
  every swap-in row and every host row is checked on both, and the ranks' decisions must be equal.
  Their collectives wait for the rank's GPU first (two ranks on one GPU cannot use NCCL).
* The fence: the writer backs up rows with ``backup_newest(fence_system=True)`` and then, on the same
  stream and without any host synchronisation, copies a round number into a flag in the shared pool;
  the reader polls the flag on the host and reads the rows with the copy kernel at once. Every row
  must hold the round's bytes (a missing fence could let the flag arrive before the rows).

Written for the GPU machine; it has not run on a GPU yet (docs/shared-host-pool.md, "Tests").
"""

from __future__ import annotations

import datetime
import time

import pytest
import torch

from hisparse_sglang.testing.tp_ranks import RankProcesses, RankSpec, report_and_exit, run_peers, wait_until_unused

pytestmark = pytest.mark.gpu

DEADLINE_S = 600.0  # each process compiles or loads the kernels and pins its pool
LAYERS, ROWS, ITEM_BYTES, BATCH, ROUNDS = 3, 8192, 656, 256, 200


def test_two_processes_share_the_pool_through_the_swap_in_op(tmp_path):
    spec = RankSpec(
        world=2, init_file=str(tmp_path / "group"), device="cuda", steps=80, scenarios=(True, False),
        layer_num=3, item_bytes=ITEM_BYTES, page_size=64, top_k=64, buffer_size=128, device_pages=24,
        max_reqs=6, max_context=2048, prompt_range=(64, 700), output_range=(20, 150), check_every=8,
        group_timeout_s=300.0,
    )
    deadline = time.monotonic() + DEADLINE_S
    with RankProcesses(spec) as ranks:
        done = ranks.collect("done", 2, deadline)
        ranks.join(deadline)
        assert [process.exitcode for process in ranks.processes] == [0, 0]
    for run in range(len(spec.scenarios)):
        writer, reader = done[0][run], done[1][run]
        assert (writer["writable"], reader["writable"]) == (True, False) and writer["segment"] == reader["segment"]
        keys = ("finished", "aborted", "rejected", "demotions", "promotions", "checks", "state", "steps")
        assert {key: writer[key] for key in keys} == {key: reader[key] for key in keys}
        assert writer["demotions"] > 0 and writer["finished"] and reader["verified_rows"] > 0
        assert wait_until_unused(writer["segment"], time.monotonic() + 10) == set()


def test_the_fenced_backup_is_read_by_the_other_process_without_a_host_sync(tmp_path):
    reports = run_peers(fence_probe_rank, 2, (str(tmp_path / "group"),), DEADLINE_S)
    assert reports[0]["writable"] and not reports[1]["writable"]
    assert reports[1]["rounds"] == ROUNDS and reports[1]["mismatches"] == [], reports[1]["mismatches"][:5]


def round_bytes(round_id: int, layer: int, count: int) -> torch.Tensor:
    """uint8 [count, ITEM_BYTES]: the KV a layer wrote in a round (differs in every round and row)."""
    values = torch.arange(count * ITEM_BYTES, dtype=torch.int64).reshape(count, ITEM_BYTES)
    return ((values * 7 + round_id * 131 + layer * 17 + values // ITEM_BYTES * 3) % 251).to(torch.uint8)


def fence_probe_rank(rank: int, init_file: str, events) -> None:
    """Entry point of one process of the fence test (rank 0 writes, rank 1 reads)."""
    report_and_exit(events, rank, lambda: _fence_probe(rank, init_file))


def _fence_probe(rank: int, init_file: str) -> dict:
    import torch.distributed as dist

    from hisparse_sglang.memory.shared_host_pool import open_host_pool
    from hisparse_sglang.ops.swap_in import CudaOps

    torch.cuda.set_device(0)
    ops = CudaOps()
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=300))
    pool = open_host_pool(LAYERS, ROWS, ITEM_BYTES, pin=True, group=dist.group.WORLD)
    flag = pool.layers[0][0, :8].view(torch.int64)  # row 0 (the padding page) holds no token's KV
    generator = torch.Generator().manual_seed(0)  # the same rows on both ranks
    device = torch.device("cuda", 0)
    mismatches: list[tuple[int, int]] = []
    if pool.writable:
        slots = torch.arange(BATCH, dtype=torch.int64, device=device)
        seq_lens = torch.full((BATCH,), 4, dtype=torch.int64, device=device)
        num_real = torch.tensor([BATCH], dtype=torch.int32, device=device)
        device_kv = [torch.zeros((BATCH + 1, ITEM_BYTES), dtype=torch.uint8, device=device) for _ in range(LAYERS)]
        flag_source = torch.zeros(1, dtype=torch.int64, device=device)
    for round_id in range(1, ROUNDS + 1):
        host_rows = torch.randperm(ROWS - 1, generator=generator)[:BATCH] + 1
        if pool.writable:
            req_to_token = torch.zeros((BATCH, 4), dtype=torch.int32)
            req_to_token[:, 3] = host_rows.to(torch.int32)  # each request's newest token (position 3)
            device_row_of_loc = torch.zeros(ROWS + 1, dtype=torch.int32)
            device_row_of_loc[host_rows] = torch.arange(1, BATCH + 1, dtype=torch.int32)
            device_row_of_loc[-1] = -1
            req_to_token, device_row_of_loc = req_to_token.to(device), device_row_of_loc.to(device)
            for layer in range(LAYERS):
                device_kv[layer][1:].copy_(round_bytes(round_id, layer, BATCH))
                ops.backup_newest(slots, seq_lens, num_real, req_to_token, device_row_of_loc, device_kv[layer],
                                  pool.layers[layer], fence_system=True)
            flag_source.fill_(round_id)
            flag.copy_(flag_source, non_blocking=True)  # stream-ordered after the kernels, no host wait
        else:
            waited = time.monotonic() + 60
            while int(flag[0]) < round_id:
                if time.monotonic() > waited:
                    raise TimeoutError(f"round {round_id}: the writer's flag never arrived")
            received = [torch.full((BATCH, ITEM_BYTES), 0xEE, dtype=torch.uint8, device=device) for _ in range(LAYERS)]
            ops.copy_rows(pool.layers, received, host_rows.to(device), torch.arange(BATCH, device=device))
            torch.cuda.synchronize()
            for layer in range(LAYERS):
                if not torch.equal(received[layer].cpu(), round_bytes(round_id, layer, BATCH)):
                    mismatches.append((round_id, layer))
        dist.barrier()  # the writer reuses rows only after the reader read them
    torch.cuda.synchronize()
    dist.barrier()
    return {"writable": pool.writable, "rounds": ROUNDS, "mismatches": mismatches}
