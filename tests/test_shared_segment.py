"""The shared host pool segment in one process (memory/shared_host_pool.py): what a reader accepts,
that it cannot write, that nobody can resize it, and that the writer hands it to announced pids only.
The ranks sharing it across processes: tests/test_shared_host_pool.py."""

from __future__ import annotations

import dataclasses
import os
import socket
import threading

import pytest
import torch

from hisparse_sglang.errors import HiSparseMemoryError, SharedHostPoolError
from hisparse_sglang.memory.host_pool import HostKVPool, layer_stride
from hisparse_sglang.memory.shared_host_pool import (
    SegmentDescriptor,
    SegmentLayout,
    SharedSegment,
    receive_segment,
    serve_segment,
)


def make_segment(layer_num=2, num_rows=64, item_bytes=32):
    layout = SegmentLayout(layer_num, num_rows, item_bytes, layer_stride(num_rows * item_bytes, pinned=False))
    segment = SharedSegment.create(layout)
    pool = HostKVPool(layer_num, num_rows, item_bytes, pin=False, segment=segment)
    return layout, segment, pool


def descriptor_of(segment, **changes) -> SegmentDescriptor:
    values = dict(node="here", socket_name="\0unused", generation=segment.generation, owner_pid=segment.owner_pid,
                  nbytes=segment.layout.nbytes)
    values.update(changes)
    return SegmentDescriptor(**values)


def test_a_reader_attaches_only_the_announced_published_segment_and_never_writes_it():
    layout, segment, pool = make_segment()
    pool.layers[1][3] = torch.arange(32, dtype=torch.uint8)
    with pytest.raises(SharedHostPoolError, match="no valid header"):
        SharedSegment.attach(os.dup(segment.fd), descriptor_of(segment), layout, map_writable=False)
    segment.publish()
    with pytest.raises(SharedHostPoolError, match="restarted or foreign writer"):
        SharedSegment.attach(os.dup(segment.fd), descriptor_of(segment, generation="0" * 32), layout, map_writable=False)
    with pytest.raises(SharedHostPoolError, match="restarted or foreign writer"):
        SharedSegment.attach(os.dup(segment.fd), descriptor_of(segment, owner_pid=1), layout, map_writable=False)
    other = dataclasses.replace(layout, item_bytes=16)
    with pytest.raises(SharedHostPoolError, match="another layout: item_bytes 32 \\(here 16\\)"):
        SharedSegment.attach(os.dup(segment.fd), descriptor_of(segment), other, map_writable=False)
    reader_segment = SharedSegment.attach(os.dup(segment.fd), descriptor_of(segment), layout, map_writable=False)
    reader = HostKVPool(2, 64, 32, pin=False, segment=reader_segment)
    assert not reader.writable and reader.shared and pool.writable
    assert torch.equal(reader.layers[1][3], torch.arange(32, dtype=torch.uint8)), "the reader sees the writer's rows"
    pool.layers[0][7] = 9
    assert int(reader.layers[0][7].sum()) == 9 * 32
    with pytest.raises(HiSparseMemoryError, match="only reads the shared host pool"):
        reader.write_rows(0, torch.tensor([1]), torch.zeros(1, 32, dtype=torch.uint8))
    with pytest.raises(TypeError):
        reader_segment.mapping[0] = 1  # mapped read-only


def test_the_segment_cannot_change_size():
    _, segment, _ = make_segment()
    with pytest.raises(PermissionError):
        os.ftruncate(segment.fd, 4096)
    with pytest.raises(PermissionError):
        os.ftruncate(segment.fd, segment.layout.nbytes * 2)


def test_the_writer_hands_the_segment_to_announced_pids_only():
    _, segment, _ = make_segment()
    segment.publish()
    name = f"\0hisparse-test-{segment.generation}"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(name)
    listener.listen(4)
    descriptor = descriptor_of(segment, socket_name=name)
    outcome = []

    def serve():
        try:
            serve_segment(listener, descriptor, segment.fd, {os.getpid() + 1_000_000: 1}, timeout_s=2.0)
        except SharedHostPoolError as exc:
            outcome.append(str(exc))

    server = threading.Thread(target=serve)
    server.start()
    with pytest.raises(SharedHostPoolError, match="did not expect this process"):
        receive_segment(descriptor, timeout_s=5.0)
    server.join(10)
    listener.close()
    assert outcome and "TP ranks [1] did not collect the shared host pool" in outcome[0]


def test_a_reader_refuses_a_listener_that_is_not_the_announced_writer():
    _, segment, _ = make_segment()
    name = f"\0hisparse-test-{segment.generation}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(name)
        listener.listen(1)
        with pytest.raises(SharedHostPoolError, match=f"pid {os.getpid()}, not the announced writer 1,"):
            receive_segment(descriptor_of(segment, socket_name=name, owner_pid=1), timeout_s=5.0)
