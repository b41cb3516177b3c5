"""Host memory made ready in parallel (memory/pinning.py): chunking, progress, registration order and
failure handling, on the CPU with a registrar that records calls instead of pinning."""

import logging
import threading
import time

import pytest
import torch

from hisparse_sglang.errors import HiSparseMemoryError
from hisparse_sglang.memory import HostKVPool
from hisparse_sglang.memory.pinning import REGISTER_ALIGN, HostRegion, Progress, plan_chunks

MiB = 1 << 20


def test_chunks_cover_every_unit_in_order_and_never_span_two():
    units = [(0, 10), (10, 0), (10, 25), (40, 7)]
    pieces = plan_chunks(units, 8)
    assert pieces == [(0, 8), (8, 2), (10, 8), (18, 8), (26, 8), (34, 1), (40, 7)]
    for offset, length in pieces:
        assert 0 < length <= 8
        assert any(start <= offset and offset + length <= start + size for start, size in units)
    assert sum(length for _, length in pieces) == 42
    with pytest.raises(ValueError):
        plan_chunks(units, 0)


def test_progress_line_reports_done_rate_and_time_left():
    now = [100.0]
    progress = Progress("pinned", 54 * 2**30, clock=lambda: now[0])
    assert "rate not known yet" in progress.line()
    progress.advance(12 * 2**30)
    now[0] += 1.0
    assert progress.line() == "HiSparse host pool: pinned 12.0/54.0 GiB (22%) at 12.0 GiB/s, about 4 s left"


def test_progress_counts_every_advance_from_many_threads():
    progress = Progress("touched", 8 * 1000 * 4096)
    workers = [threading.Thread(target=lambda: [progress.advance(4096) for _ in range(1000)]) for _ in range(8)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert progress.done == progress.total


class RecordingRegistrar:
    """Stands in for CUDA: records which thread registered which range; can fail a piece or be slow."""

    def __init__(self, fail_at: int | None = None, delay_s: float = 0.0) -> None:
        self.fail_at = fail_at
        self.delay_s = delay_s
        self.entered: set[int] = set()
        self.registered: list[tuple[int, int, int]] = []
        self.unregistered: list[int] = []
        self.calls = 0
        self.lock = threading.Lock()

    def enter_thread(self) -> None:
        self.entered.add(threading.get_ident())

    def register(self, address: int, length: int):
        time.sleep(self.delay_s)
        with self.lock:
            self.calls += 1
            if self.calls == self.fail_at:
                return "out of memory (cudaError 2)"
            self.registered.append((address, length, threading.get_ident()))
        return None

    def unregister(self, address: int) -> None:
        self.unregistered.append(address)


def test_every_unit_is_registered_once_from_worker_threads_and_released_on_close():
    units = [(layer * 2 * MiB, 2 * MiB) for layer in range(6)]
    registrar = RecordingRegistrar()
    region = HostRegion(12 * MiB, register_units=units, registrar=registrar, threads=3)
    base = region.address
    assert sorted((address - base, length) for address, length, _ in registrar.registered) == units
    assert threading.get_ident() not in {thread for _, _, thread in registrar.registered}
    assert {thread for _, _, thread in registrar.registered} <= registrar.entered
    assert region.pinned and bool((region.tensor == 0).all())
    region.tensor[5 * MiB] = 7  # writable
    region.close()
    assert sorted(registrar.unregistered) == sorted(address for address, _, _ in registrar.registered)
    assert not region.pinned


_COLLECTED_INSIDE_SUBMIT = """
import concurrent.futures.thread, gc, sys
sys.path.insert(0, {tests!r})
from test_pinning import RecordingRegistrar
from hisparse_sglang.memory.pinning import HostRegion
registrar = RecordingRegistrar()
region = HostRegion(4 << 20, registrar=registrar, threads=2)
region.cycle = region  # collected only by the garbage collector, as the sim's pools are
addresses = [address for address, _, _ in registrar.registered]
del region
gc.disable()
# What ThreadPoolExecutor.submit holds while it starts a worker thread, where the collection ran.
with concurrent.futures.thread._global_shutdown_lock:
    gc.collect()
assert sorted(registrar.unregistered) == sorted(addresses), (registrar.unregistered, addresses)
print("released")
"""


def test_a_region_collected_inside_a_thread_pool_submit_unregisters_without_deadlock(tmp_path):
    """On an H100 a garbage collection inside ThreadPoolExecutor.submit (which holds concurrent.futures'
    module-wide lock) ran HostRegion.__del__, whose unregistration pool then waited for that lock forever."""
    import pathlib
    import subprocess
    import sys

    script = _COLLECTED_INSIDE_SUBMIT.format(tests=str(pathlib.Path(__file__).parent))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "released" in done.stdout, done.stderr[-2000:]


def test_a_failed_registration_releases_the_rest_and_names_the_size_and_fix():
    registrar = RecordingRegistrar(fail_at=3)
    units = [(layer * 2 * MiB, 2 * MiB) for layer in range(5)]
    with pytest.raises(HiSparseMemoryError) as info:
        HostRegion(10 * MiB, register_units=units, registrar=registrar, threads=1)
    message = str(info.value)
    for fragment in ("0.01 GiB in all", "cudaHostRegister of 0.00 GiB at offset 0.00 GiB", "out of memory",
                     "1 of 5 pieces failed", "host_to_device_ratio"):
        assert fragment in message, message
    assert sorted(registrar.unregistered) == sorted(address for address, _, _ in registrar.registered)
    assert len(registrar.registered) == 4


def test_slow_pinning_logs_progress_lines(caplog):
    registrar = RecordingRegistrar(delay_s=0.05)
    units = [(layer * 2 * MiB, 2 * MiB) for layer in range(8)]
    with caplog.at_level(logging.INFO, logger="hisparse_sglang.memory.pinning"):
        HostRegion(16 * MiB, register_units=units, registrar=registrar, threads=2, log_every_s=0.02)
    lines = [record.getMessage() for record in caplog.records if "HiSparse host pool: pinned" in record.getMessage()]
    assert lines and all("GiB/s" in line for line in lines)


def test_units_must_start_on_the_registration_boundary():
    with pytest.raises(HiSparseMemoryError, match="multiples of"):
        HostRegion(4 * MiB, register_units=[(0, 3 * MiB), (3 * MiB, MiB)], registrar=RecordingRegistrar())


def test_host_pool_layers_are_views_of_one_touched_region():
    pool = HostKVPool(3, 1000, 656, pin=False, threads=2)
    pointers, lengths = pool.region_infos()
    assert lengths == [1000 * 656] * 3
    assert pointers[0] == pool.region.address and all(b - a >= 1000 * 656 for a, b in zip(pointers, pointers[1:]))
    for layer_id, layer in enumerate(pool.layers):
        layer.fill_(layer_id + 1)
    assert [int(layer.float().mean()) for layer in pool.layers] == [1, 2, 3]  # no overlap
    assert pool.layers[0].shape == (1000, 656) and pool.layers[0].dtype == torch.uint8
    assert not pool.pinned and REGISTER_ALIGN % 4096 == 0


def resident_fraction(address: int, length: int) -> float:
    """Share of the pages of ``[address, address + length)`` in memory now (mincore)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    page = 4096
    start = address - address % page
    pages = -(-(address + length - start) // page)
    vec = (ctypes.c_ubyte * pages)()
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(pages * page), vec) == 0, ctypes.get_errno()
    return sum(byte & 1 for byte in vec) / pages


class ResidencyRegistrar(RecordingRegistrar):
    """Also notes, at every registration, how much of the piece and of the region's last piece is in memory."""

    def __init__(self, last_piece: tuple[int, int]) -> None:
        super().__init__()
        self.last_piece = last_piece
        self.base = None
        self.seen: list[tuple[float, float]] = []

    def register(self, address: int, length: int):
        offset, size = self.last_piece
        self.seen.append((resident_fraction(address, length), resident_fraction(self.base + offset, size)))
        return super().register(address, length)


def test_each_piece_is_touched_then_registered_while_later_pieces_wait(monkeypatch):
    import hisparse_sglang.memory.pinning as pinning

    monkeypatch.setattr(pinning, "TOUCH_CHUNK_BYTES", 2 * MiB)
    units = [(0, 6 * MiB), (8 * MiB, 3 * MiB)]  # a gap of 2 MiB between the units, 1 MiB after them
    registrar = ResidencyRegistrar(last_piece=(10 * MiB, MiB))
    original = pinning.anonymous_mapping

    def mapping_seen_by_registrar(nbytes):
        mapped = original(nbytes)
        registrar.base = torch.frombuffer(mapped, dtype=torch.uint8, count=1).data_ptr()
        return mapped

    monkeypatch.setattr(pinning, "anonymous_mapping", mapping_seen_by_registrar)
    region = HostRegion(12 * MiB, register_units=units, registrar=registrar, threads=1)
    pieces = sorted((address - region.address, length) for address, length, _ in registrar.registered)
    assert pieces == [(0, 2 * MiB), (2 * MiB, 2 * MiB), (4 * MiB, 2 * MiB), (8 * MiB, 2 * MiB), (10 * MiB, MiB)]
    assert all(piece == 1.0 for piece, _ in registrar.seen), "a piece was registered before it was touched"
    assert registrar.seen[0][1] < 0.5, "every page was touched before the first registration"
    assert resident_fraction(region.address, 12 * MiB) == 1.0  # the gaps are touched too
    timing = region.timing
    assert timing.ready_s > 0 and timing.touch_s > 0 and timing.register_s >= 0
    assert timing.touch_s + timing.register_s <= timing.ready_s * 1.05
    region.close()
