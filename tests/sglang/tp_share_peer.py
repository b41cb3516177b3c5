"""One TP rank of a PD decode instance built from SGLang's real pool classes (test_coordinator_sglang's
Stack), in a spawned process; tests/sglang/test_tp_shared_pool_sglang.py runs two on one gloo group.

What each rank does, in lockstep with the other: builds the adapter with the TP group (one host pool
for both), receives a PD transfer the way its prefill peer writes it (the same bytes, through this
rank's own registered region pointers), admits and decodes it (every top-k row checked), restores a
retracted copy (only the writer writes; the reader hands in a poisoned copy that must not land), then
builds the adapter again with DP attention, with the switch off and without the key (private pools).
"""

from __future__ import annotations

import ctypes
import datetime

import torch

from hisparse_sglang.testing.tp_ranks import report_and_exit


def shared_pool_peer(rank: int, init_file: str, events) -> None:
    report_and_exit(events, rank, lambda: _run(rank, init_file))


def _run(rank: int, init_file: str) -> dict:
    import torch.distributed as dist
    from test_coordinator_sglang import LAYERS, Stack, token_values

    from hisparse_sglang.integration.sglang import compat

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    group = dist.group.WORLD

    def collective() -> None:
        dist.all_reduce(torch.zeros(1), group=group)

    report: dict = {}
    stack = Stack(tp_group=group, share_host_pool=True, collective=collective)
    host = stack.coordinator.host_pool
    report["shared"] = (stack.coordinator.shares_host_pool, host.writable, host.segment.name)
    pointers, lengths, item_lens = stack.coordinator.mem_pool_host.get_contiguous_buf_infos()
    report["regions"] = (list(lengths), list(item_lens), [pointer - pointers[0] for pointer in pointers])

    req = stack.new_req("a", 700)
    rows = stack.pd_prealloc(req, 700)
    report["prealloc rows"] = rows.tolist()
    for layer in range(LAYERS):  # what the matching prefill rank's Mooncake transfer writes here
        nope, rope = token_values(stack.uids["a"], torch.arange(700), layer)
        data = torch.cat([nope, rope], dim=-1).reshape(700, -1).view(torch.uint8).contiguous()
        row_bytes = data.shape[1]
        for index, row in enumerate(rows.tolist()):
            ctypes.memmove(pointers[layer] + row * row_bytes, data[index].data_ptr(), row_bytes)
    collective()  # SGLang all-reduces the decode ranks' transfer polls before it admits
    stack.coordinator.admit_request_direct(req)
    report["admitted as"] = stack.coordinator.core.requests[compat.req_slot(req)].mode
    for _ in range(4):
        stack.decode([req])  # asserts every top-k row holds the request's KV (on the reader: the writer's bytes)
    report["mode"] = stack.coordinator.core.requests[compat.req_slot(req)].mode  # promoted back: read from host

    locs = stack.req_to_token_pool.req_to_token[compat.req_slot(req), : stack.lens["a"]].to(torch.int64)
    copy = stack.allocator.get_cpu_copy(locs)
    expected = [part.clone() for part in copy["kv"]]
    if not host.writable:
        copy["kv"] = [torch.full_like(part, 0xEE) for part in copy["kv"]]  # would show if the reader wrote it
    resumed = stack.new_req("b", stack.lens["a"])
    new_locs = stack.pd_prealloc(resumed, stack.lens["a"])
    stack.allocator.load_cpu_copy(copy, new_locs)
    report["restored"] = all(torch.equal(layer[new_locs], want) for layer, want in zip(host.layers, expected))

    for sharing, kwargs in (
        ("dp attention", {"dp_attention": True, "share_host_pool": True}),
        ("switched off", {"share_host_pool": False}),
        ("default", {}),
    ):
        other = Stack(tp_group=group, **kwargs)
        report[sharing] = (other.coordinator.shares_host_pool, other.coordinator.host_pool.shared,
                           other.coordinator.host_pool.writable)
    dist.barrier(group=group)
    return report
