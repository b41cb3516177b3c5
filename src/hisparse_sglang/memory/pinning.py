"""Large host memory made ready in parallel: plain pages, touched and pinned piece by piece by threads.

``torch.empty(..., pin_memory=True)`` (``cudaHostAlloc``) faults, zeroes and pins a region page by
page in one thread: 2.0 GiB/s on an H200 host, three minutes for a 350 GB decode rank. Here the
region is one anonymous mapping (transparent huge pages requested), cut into pieces of
TOUCH_CHUNK_BYTES that never span two registration units (the layers of a pool); each piece is one
task of a thread pool, which first touches its pages (``memset`` through ctypes releases the GIL;
the kernel zeroes each page on its first touch, on the NUMA node of the touching thread) and then
registers it with CUDA (``cudaHostRegister``, page-locked, mapped and portable, so the device reads
it through the same pointer). Touching and pinning thus overlap across threads: on an H200 this made
22 GiB ready at 30.8-32.3 GiB/s against 18.4-19.0 GiB/s when every page was touched before any was
registered, on the same (used) memory (benchmarks/bench_host_pool_ways.py; registering untouched
pages, or populating them with ``madvise``, was slower still). A progress line (GiB done, rate, time
left) is logged every few seconds. If a registration fails, the pieces already registered are
released and HiSparseMemoryError names the size and the fix.

CUDA calls run in worker threads only, each with the caller's device made current: a failed call
leaves its error in the worker thread, never in the scheduler's thread, and no other GPU's context
is created.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import dataclasses
import logging
import mmap
import os
import threading
import time
import warnings
from typing import Callable, Sequence

import torch

from hisparse_sglang.errors import HiSparseMemoryError

__all__ = [
    "HostRegion",
    "CudaRegistrar",
    "anonymous_mapping",
    "request_huge_pages",
    "plan_chunks",
    "Progress",
    "default_threads",
    "TOUCH_CHUNK_BYTES",
    "MAX_REGISTER_BYTES",
    "REGISTER_ALIGN",
]

logger = logging.getLogger(__name__)

# Work unit of a thread: touched, then registered as one cudaHostRegister. Small enough to spread
# over every thread (100 GiB: 400 pieces), large enough to amortise a call.
TOUCH_CHUNK_BYTES = 256 << 20
# Largest single cudaHostRegister of a region that is registered without being touched (a reader of
# a shared segment, whose writer touched it): larger units are split so that the registrations also
# spread over the threads.
MAX_REGISTER_BYTES = 4 << 30
# cudaHostRegisterPortable | cudaHostRegisterMapped: usable from every CUDA context, device-mapped.
_REGISTER_FLAGS = 0x01 | 0x02
# Registration pieces start on this boundary, so that no two registrations share a page (CUDA
# refuses to register a page twice) and none splits a transparent huge page.
REGISTER_ALIGN = 2 << 20


def default_threads() -> int:
    """Threads for touching and registering: the CPUs this process may run on (at most 32), or
    ``$HISPARSE_PIN_THREADS``."""
    if os.environ.get("HISPARSE_PIN_THREADS"):
        return max(1, int(os.environ["HISPARSE_PIN_THREADS"]))
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 1
    return max(1, min(32, cpus))


def plan_chunks(units: Sequence[tuple[int, int]], max_bytes: int) -> list[tuple[int, int]]:
    """``(offset, length)`` units split into pieces of at most ``max_bytes``, in order; a piece
    never spans two units (zero-length units are dropped)."""
    if max_bytes < 1:
        raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
    pieces = []
    for offset, length in units:
        for start in range(offset, offset + length, max_bytes):
            pieces.append((start, min(max_bytes, offset + length - start)))
    return pieces


class Progress:
    """Bytes done of a total, advanced from any thread; :meth:`line` formats a progress log line."""

    def __init__(self, what: str, total: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.what = what
        self.total = total
        self.clock = clock
        self.started = clock()
        self._done = 0
        self._lock = threading.Lock()

    @property
    def done(self) -> int:
        return self._done

    def advance(self, count: int) -> None:
        with self._lock:
            self._done += count

    def rate(self) -> float:
        """Bytes per second so far (0 before any time passed)."""
        elapsed = self.clock() - self.started
        return self._done / elapsed if elapsed > 0 else 0.0

    def line(self) -> str:
        """'HiSparse host pool: pinned 12.0/54.0 GiB (22%) at 10.8 GiB/s, about 4 s left'."""
        rate = self.rate()
        left = f"about {(self.total - self._done) / rate:.0f} s left" if rate > 0 else "rate not known yet"
        share = 100 * self._done / self.total if self.total else 100.0
        return (
            f"HiSparse host pool: {self.what} {self._done / 2**30:.1f}/{self.total / 2**30:.1f} GiB ({share:.0f}%) at "
            f"{rate / 2**30:.1f} GiB/s, {left}"
        )


class CudaRegistrar:
    """``cudaHostRegister`` / ``cudaHostUnregister`` through torch's CUDA runtime, on ``device``'s
    context (set per worker thread by :meth:`enter_thread`). Call it from worker threads only: a
    refused registration leaves CUDA's last error in the calling thread (torch's binding does not
    clear it), where the next launch check of that thread would report it."""

    def __init__(self, device: torch.device) -> None:
        self.device_index = device.index if device.index is not None else torch.cuda.current_device()
        self._runtime = torch.cuda.cudart()

    def enter_thread(self) -> None:
        torch.cuda.set_device(self.device_index)

    def register(self, address: int, length: int) -> str | None:
        """None on success, else CUDA's error text (the error stays in this worker thread)."""
        status = self._runtime.cudaHostRegister(address, length, _REGISTER_FLAGS)
        if int(status) != 0:
            return f"{self._runtime.cudaGetErrorString(status)} (cudaError {int(status)})"
        return None

    def unregister(self, address: int) -> None:
        self._runtime.cudaHostUnregister(address)


def anonymous_mapping(nbytes: int) -> mmap.mmap:
    """A private anonymous mapping of ``nbytes`` with transparent huge pages requested."""
    try:
        mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, OverflowError, ValueError) as exc:
        raise HiSparseMemoryError(
            f"could not map {nbytes / 2**30:.2f} GiB of host memory for the HiSparse host pool: {exc}. Lower "
            f"host_to_device_ratio in --hisparse-config or --mem-fraction-static."
        ) from exc
    request_huge_pages(mapping)
    return mapping


def request_huge_pages(mapping: mmap.mmap) -> None:
    """Ask for 2 MiB pages (512x fewer faults, pins and page-table entries); where transparent huge
    pages are off for this kind of memory, 4 KiB pages work, only slower."""
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass


@dataclasses.dataclass
class _Timing:
    """Where the time went. ``ready_s``: wall time until the region was ready. ``touch_s`` /
    ``register_s``: the time a worker thread spent touching / registering, summed over the threads
    and divided by the threads that had work (so, with the threads busy, about ``ready_s`` together;
    without registration, ``touch_s`` is the wall time of the touch)."""

    touch_s: float = 0.0
    register_s: float = 0.0
    ready_s: float = 0.0


def _gaps(units: Sequence[tuple[int, int]], nbytes: int) -> list[tuple[int, int]]:
    """The ``(offset, length)`` ranges of ``[0, nbytes)`` that no unit covers, in order."""
    gaps, position = [], 0
    for offset, length in sorted(units):
        if offset > position:
            gaps.append((position, offset - position))
        position = max(position, offset + length)
    if position < nbytes:
        gaps.append((position, nbytes - position))
    return gaps


class HostRegion:
    """``nbytes`` of host memory, every page touched, and page-locked when ``registrar`` is given.

    Args:
        nbytes: size of the region.
        register_units: ``(offset, length)`` pieces that may each be one registration (the layers of
            a pool, so that no registration spans two layers); each is split at MAX_REGISTER_BYTES.
            Offsets must be multiples of REGISTER_ALIGN. Default: the whole region.
        registrar: a :class:`CudaRegistrar` (None: plain pageable memory, touched but not pinned).
        threads: worker threads (default :func:`default_threads`).
        log_every_s: seconds between progress lines while the work runs.
        clock: monotonic time source (tests pass a fake one).
        mapping: an existing mapping of at least ``nbytes`` to use instead of a new anonymous one
            (a segment shared between processes, memory/shared_host_pool.py); it may be read-only.
        touch: touch every page first (default). A process that attaches to a segment another
            process has touched already skips it (a read-only mapping cannot be touched).

    Attributes:
        tensor: uint8 ``[nbytes]`` CPU tensor over the region (views of it stay valid while this
            object or any view lives; the region is unregistered when this object is closed or
            collected, so keep it as long as the GPU reads the memory).
        timing: seconds spent touching and registering (:class:`_Timing`).
    """

    def __init__(
        self,
        nbytes: int,
        register_units: Sequence[tuple[int, int]] | None = None,
        registrar: CudaRegistrar | None = None,
        threads: int | None = None,
        log_every_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        mapping: mmap.mmap | None = None,
        touch: bool = True,
    ) -> None:
        if nbytes < 1:
            raise HiSparseMemoryError(f"a host region needs a positive size, got {nbytes} bytes.")
        self.nbytes = nbytes
        self.registrar = registrar
        self.threads = threads or default_threads()
        self.timing = _Timing()
        self._registered: list[int] = []
        if mapping is None:
            mapping = anonymous_mapping(nbytes)
        elif len(mapping) < nbytes:
            raise HiSparseMemoryError(f"a host region of {nbytes} bytes cannot use a mapping of {len(mapping)} bytes.")
        self._mapping = mapping
        with warnings.catch_warnings():
            # A read-only mapping (a reader of a shared segment) gives a tensor that must never be
            # written; torch warns that it cannot enforce that.
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            self.tensor = torch.frombuffer(self._mapping, dtype=torch.uint8, count=nbytes)
        self.address = self.tensor.data_ptr()
        units = register_units if register_units is not None else [(0, nbytes)]
        if registrar is not None and any(offset % REGISTER_ALIGN or offset + length > nbytes for offset, length in units):
            raise HiSparseMemoryError(
                f"host region of {nbytes} bytes: registration units must start at multiples of {REGISTER_ALIGN} "
                f"and end inside the region, got {list(units)[:4]}."
            )
        self._prepare(units, log_every_s, clock, touch)

    def _prepare(
        self, units: Sequence[tuple[int, int]], log_every_s: float, clock: Callable[[], float], touch: bool
    ) -> None:
        registrar = self.registrar
        if registrar is None and not touch:
            return
        started = clock()
        if registrar is None and self.nbytes <= TOUCH_CHUNK_BYTES:  # small and pageable: no threads needed
            self._touch((0, self.nbytes), Progress("touched", self.nbytes, clock))
            self.timing.touch_s = self.timing.ready_s = clock() - started
            return
        self._clock = clock
        self._busy_lock = threading.Lock()
        initializer = registrar.enter_thread if registrar is not None else None
        with concurrent.futures.ThreadPoolExecutor(self.threads, thread_name_prefix="hisparse-pin",
                                                   initializer=initializer) as pool:
            if registrar is None:  # touch only (a shared segment's writer)
                touched = Progress("touched", self.nbytes, clock)
                pieces = plan_chunks([(0, self.nbytes)], TOUCH_CHUNK_BYTES)
                self._run(pool, [(self._touch, piece, touched) for piece in pieces], touched, log_every_s)
                self.timing.touch_s = self.timing.ready_s = clock() - started
                return
            if touch:
                pieces = plan_chunks(units, TOUCH_CHUNK_BYTES)
                pinned = Progress("pinned", sum(length for _, length in pieces), clock)
                work = [(self._touch_and_register, piece, pinned) for piece in pieces]
                # Bytes outside every unit (padding between layers) are touched too, as before.
                outside = Progress("touched", self.nbytes, clock)
                work += [(self._touch, piece, outside) for piece in plan_chunks(_gaps(units, self.nbytes),
                                                                                TOUCH_CHUNK_BYTES)]
            else:
                pieces = plan_chunks(units, MAX_REGISTER_BYTES)
                pinned = Progress("pinned", sum(length for _, length in pieces), clock)
                work = [(self._register, piece, pinned) for piece in pieces]
            self._busy = {"touch": 0.0, "register": 0.0}
            failures = self._run(pool, work, pinned, log_every_s)
        self.timing.ready_s = clock() - started
        if touch:
            workers = max(1, min(self.threads, len(work)))
            self.timing.touch_s = self._busy["touch"] / workers
            self.timing.register_s = self._busy["register"] / workers
        else:
            self.timing.register_s = self.timing.ready_s
        if failures:
            offset, length, error = min(failures)
            self.close()
            raise HiSparseMemoryError(
                f"could not pin the HiSparse host pool: {self.nbytes / 2**30:.2f} GiB in all; cudaHostRegister of "
                f"{length / 2**30:.2f} GiB at offset {offset / 2**30:.2f} GiB failed: {error} ({len(failures)} of "
                f"{len(pieces)} pieces failed; nothing stays pinned). Lower host_to_device_ratio in --hisparse-config "
                f"or --mem-fraction-static, or raise the host's locked-memory limits."
            )

    def _run(self, pool, work, progress: Progress, log_every_s: float) -> list[tuple[int, int, str]]:
        """Run ``work`` (function, piece, progress) on the pool, logging progress until all is done;
        returns the failures (offset, length, error) reported by the functions."""
        futures = [pool.submit(function, piece, counter) for function, piece, counter in work]
        pending = set(futures)
        while pending:
            _, pending = concurrent.futures.wait(pending, timeout=log_every_s)
            if pending:
                logger.info("%s", progress.line())
        return [failure for future in futures if (failure := future.result()) is not None]

    def _touch(self, piece: tuple[int, int], progress: Progress) -> None:
        offset, length = piece
        ctypes.memset(self.address + offset, 0, length)
        progress.advance(length)

    def _touch_and_register(self, piece: tuple[int, int], progress: Progress) -> tuple[int, int, str] | None:
        offset, length = piece
        started = self._clock()
        ctypes.memset(self.address + offset, 0, length)
        touched = self._clock()
        self._add_busy("touch", touched - started)
        try:
            return self._register(piece, progress)
        finally:
            self._add_busy("register", self._clock() - touched)

    def _register(self, piece: tuple[int, int], progress: Progress) -> tuple[int, int, str] | None:
        offset, length = piece
        error = self.registrar.register(self.address + offset, length)
        if error is not None:
            return offset, length, error
        self._registered.append(self.address + offset)  # list.append is atomic
        progress.advance(length)
        return None

    def _add_busy(self, what: str, seconds: float) -> None:
        with self._busy_lock:
            self._busy[what] += seconds

    @property
    def pinned(self) -> bool:
        return bool(self._registered)

    def close(self) -> None:
        """Unregister what was registered (the memory stays mapped while views of it live)."""
        registered, self._registered = self._registered, []
        if registered and self.registrar is not None:
            with concurrent.futures.ThreadPoolExecutor(1, initializer=self.registrar.enter_thread) as pool:
                pool.map(self.registrar.unregister, registered)

    def __del__(self) -> None:
        # The garbage collector runs this wherever an allocation triggers it, for example inside
        # another thread pool's submit() while it holds concurrent.futures' module-wide lock: a
        # pool started here would wait for that lock forever (seen on an H100 in
        # tests/gpu/test_coordinator_gpu.py). So no thread: unregister in the calling thread.
        # cudaHostUnregister needs no particular device (the registrations are portable).
        registered, self._registered = self._registered, []
        if not registered or self.registrar is None:
            return
        try:
            for address in registered:
                self.registrar.unregister(address)
        except Exception:  # interpreter shutdown: CUDA may be gone; the process ends anyway
            pass
