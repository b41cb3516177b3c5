"""One host KV pool per node, shared by the tensor-parallel ranks that hold the same requests.

MLA's latent KV is identical on every TP rank (with DP attention off every rank holds every request,
and the latent projection is replicated), so the ranks of a node can map one pool instead of one each.

Mechanism:

* The lowest TP rank of each node (the **writer**) creates an anonymous ``memfd`` of the pool's size,
  seals its size (``F_SEAL_SHRINK | F_SEAL_GROW``: no process can truncate it under the others' feet),
  touches every page from a thread pool, then writes a header (magic, layout, a random 16-byte
  generation and its pid) into the segment's first 2 MiB.
* The ranks all-gather, over the TP CPU group, their node and pid, then the writer's descriptor (an
  abstract Unix-socket name, the generation, its pid). Each **reader** connects to its node's writer;
  the writer hands the segment's descriptor over only to the pids the group announced
  (``SO_PEERCRED``), with ``SCM_RIGHTS``; the reader checks the listener's pid, maps the segment,
  checks the header against the descriptor and its own layout. Then every rank of the node pins it in
  its own CUDA context, at the same time. A last all-gather makes every rank raise the same
  :class:`~hisparse_sglang.errors.SharedHostPoolError` if any rank failed.
* Nothing names the segment in a file system: it lives while some process maps it, so it is freed
  when the last rank exits, SIGKILL included; the driver unpins a dead process's registrations.
* Readers never write: the pool they get has ``writable`` False (the coordinator skips the backup of
  new tokens and the prefill staging, ``write_rows`` raises). Their mapping stays writable, because
  CUDA pins only writable mappings (short of ``cudaHostRegisterReadOnly``) and a PD decode rank's
  Mooncake engine receives its prefill peer's (identical) bytes through it; ``read_only_readers``
  maps it read-only where neither applies (the CPU tests), so that a stray write faults. A writer
  that restarts creates a new memfd with a new generation; no code path
  opens an existing segment for writing, so it cannot reinitialise the one the others map.

The ordering of the writer's stores and the readers' loads is argued in docs/shared-host-pool.md.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import logging
import mmap
import os
import secrets
import socket
import struct
import time
from typing import Any

import torch

from hisparse_sglang.errors import HiSparseError, SharedHostPoolError
from hisparse_sglang.memory.host_pool import HostKVPool, layer_stride
from hisparse_sglang.memory.pinning import REGISTER_ALIGN, HostRegion, request_huge_pages

__all__ = [
    "open_host_pool",
    "serve_segment",
    "receive_segment",
    "SharedSegment",
    "SegmentLayout",
    "SegmentDescriptor",
    "node_identity",
    "HEADER_BYTES",
    "HANDSHAKE_TIMEOUT_S",
]

logger = logging.getLogger(__name__)

# The header takes the segment's first registration unit, so the layers stay 2 MiB aligned.
HEADER_BYTES = REGISTER_ALIGN
# Seconds the readers of a node have to connect to their writer once its descriptor is known (they
# are all past the same collective by then; the pinning that follows is not bounded by it).
HANDSHAKE_TIMEOUT_S = 120.0
_MAGIC = b"HSPHOST1"
_HEADER_VERSION = 1
# magic, version, layer_num, num_rows, item_bytes, layer_stride, data_offset, nbytes, owner_pid, generation
_HEADER = struct.Struct("<8sIQQQQQQQ16s")
_SIZE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
_PEER_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid
_DESCRIPTOR_LIMIT = 4096
_DISABLE_HINT = 'set "share_host_pool_across_tp": false in --hisparse-config to give every rank its own pool'


@dataclasses.dataclass(frozen=True)
class SegmentLayout:
    """Where a pool's layers sit in a shared segment: after the header, ``layer_stride`` apart."""

    layer_num: int
    num_rows: int
    item_bytes: int
    layer_stride: int
    data_offset: int = HEADER_BYTES

    @property
    def nbytes(self) -> int:
        return self.data_offset + self.layer_num * self.layer_stride


@dataclasses.dataclass(frozen=True)
class SegmentDescriptor:
    """What a writer tells the readers of its node (through the TP group, then the socket)."""

    node: str
    socket_name: str
    generation: str  # hex
    owner_pid: int
    nbytes: int

    def to_json(self) -> bytes:
        return json.dumps(dataclasses.asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> "SegmentDescriptor":
        return cls(**json.loads(data.decode()))


class SharedSegment:
    """A memfd mapped into this process: created by the writer, attached by readers.

    Attributes:
        mapping: the segment mapped shared (read-only for a reader that does not pin it).
        name: the memfd's name, as ``/proc/<pid>/maps`` shows it (``/memfd:<name> (deleted)``).
        generation: 32 hex digits, new for every segment created.
        owner_pid: the writer's pid.
        writable: whether this process writes the rows (the writer).
    """

    def __init__(self, fd: int, layout: SegmentLayout, generation: str, owner_pid: int, writable: bool,
                 map_writable: bool) -> None:
        self.fd: int | None = fd
        self.layout = layout
        self.generation = generation
        self.owner_pid = owner_pid
        self.writable = writable
        self.name = segment_name(generation)
        self.touched = False
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if map_writable else 0)
        self.mapping = mmap.mmap(fd, layout.nbytes, flags=mmap.MAP_SHARED, prot=prot)
        request_huge_pages(self.mapping)

    @property
    def data_offset(self) -> int:
        return self.layout.data_offset

    # ------------------------------------------------------------------ writer
    @classmethod
    def create(cls, layout: SegmentLayout) -> "SharedSegment":
        """A new memfd of ``layout.nbytes``, its size sealed, mapped here; the header is written by
        :meth:`publish` once the pool is ready (touching the pages zeroes the whole segment)."""
        generation = secrets.token_hex(16)
        try:
            fd = os.memfd_create(segment_name(generation), os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except OSError as exc:
            raise SharedHostPoolError(f"memfd_create failed ({exc}); {_DISABLE_HINT}.") from exc
        try:
            os.ftruncate(fd, layout.nbytes)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SIZE_SEALS | fcntl.F_SEAL_SEAL)
            return cls(fd, layout, generation, os.getpid(), writable=True, map_writable=True)
        except OSError as exc:
            os.close(fd)
            raise SharedHostPoolError(
                f"could not size and map a shared host pool of {layout.nbytes / 2**30:.2f} GiB ({exc}); lower "
                f"host_to_device_ratio in --hisparse-config, or {_DISABLE_HINT}."
            ) from exc

    def touch(self, threads: int | None = None) -> float:
        """Fault every page in now, from a thread pool (the pool built on this segment then only pins
        it, while the readers pin it too); returns the seconds it took."""
        region = HostRegion(self.layout.nbytes, mapping=self.mapping, threads=threads)
        self.touched = True
        return region.timing.touch_s

    def publish(self) -> None:
        """Write the header (after the pool touched every page): readers refuse a segment without it."""
        layout = self.layout
        self.mapping[: _HEADER.size] = _HEADER.pack(
            _MAGIC, _HEADER_VERSION, layout.layer_num, layout.num_rows, layout.item_bytes, layout.layer_stride,
            layout.data_offset, layout.nbytes, self.owner_pid, bytes.fromhex(self.generation),
        )

    def descriptor(self, node: str, socket_name: str) -> SegmentDescriptor:
        return SegmentDescriptor(node, socket_name, self.generation, self.owner_pid, self.layout.nbytes)

    # ------------------------------------------------------------------ reader
    @classmethod
    def attach(cls, fd: int, descriptor: SegmentDescriptor, layout: SegmentLayout, map_writable: bool) -> "SharedSegment":
        """Map a segment received from its writer and check it is the one announced, with our layout.

        Args:
            fd: the memfd received (this process owns it; it is closed here).
            descriptor: what the writer announced through the TP group.
            layout: the layout this rank computed for its own pool.
            map_writable: map it writable (to pin it with CUDA, or for a transfer engine that writes
                into it); this process's coordinator still never writes the rows.

        Raises:
            SharedHostPoolError: size, seals or header differ from what was announced or expected.
        """
        try:
            size = os.fstat(fd).st_size
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            if size != descriptor.nbytes or size != layout.nbytes:
                raise SharedHostPoolError(
                    f"the shared host pool segment holds {size} bytes; its writer (pid {descriptor.owner_pid}) "
                    f"announced {descriptor.nbytes} and this rank's pool needs {layout.nbytes}: the ranks were "
                    f"configured differently; {_DISABLE_HINT}."
                )
            if seals & _SIZE_SEALS != _SIZE_SEALS:
                raise SharedHostPoolError(
                    f"the shared host pool segment of pid {descriptor.owner_pid} can still change size (seals "
                    f"{seals:#x}); a segment others map must be sealed. {_DISABLE_HINT}."
                )
            segment = cls(fd, layout, descriptor.generation, descriptor.owner_pid, writable=False,
                          map_writable=map_writable)
        finally:
            os.close(fd)
        segment.fd = None
        segment._check_header()
        return segment

    def _check_header(self) -> None:
        values = _HEADER.unpack_from(self.mapping, 0)
        magic, version, *sizes, owner_pid, generation = values
        layout = self.layout
        expected = [layout.layer_num, layout.num_rows, layout.item_bytes, layout.layer_stride, layout.data_offset,
                    layout.nbytes]
        if magic != _MAGIC or version != _HEADER_VERSION:
            raise SharedHostPoolError(
                f"the shared host pool segment of pid {self.owner_pid} has no valid header (magic {magic!r}, "
                f"version {version}): it was not published; {_DISABLE_HINT}."
            )
        if generation.hex() != self.generation or owner_pid != self.owner_pid:
            raise SharedHostPoolError(
                f"the shared host pool segment received belongs to pid {owner_pid}, generation {generation.hex()}, "
                f"but the TP group announced pid {self.owner_pid}, generation {self.generation}: a restarted or "
                f"foreign writer; restart every rank of the node."
            )
        if list(sizes) != expected:
            names = ("layer_num", "num_rows", "item_bytes", "layer_stride", "data_offset", "nbytes")
            differ = [f"{name} {got} (here {want})" for name, got, want in zip(names, sizes, expected) if got != want]
            raise SharedHostPoolError(
                f"the shared host pool of pid {self.owner_pid} has another layout: {', '.join(differ)}; every rank "
                f"of a node needs the same model, KV dtype, --mem-fraction-static and host_to_device_ratio."
            )

    # ------------------------------------------------------------------ both
    def check_layout(self, layer_num: int, num_rows: int, item_bytes: int, stride: int) -> int:
        """The byte offset of the first layer, after checking that a pool of these sizes is this layout."""
        if (layer_num, num_rows, item_bytes, stride) != (
            self.layout.layer_num, self.layout.num_rows, self.layout.item_bytes, self.layout.layer_stride
        ):
            raise SharedHostPoolError(
                f"a pool of {layer_num} layers x {num_rows} rows x {item_bytes} B (stride {stride}) does not fit "
                f"segment {self.name} laid out as {self.layout}."
            )
        return self.layout.data_offset

    def close_fd(self) -> None:
        """Drop the descriptor (the mapping keeps the segment alive)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def segment_name(generation: str) -> str:
    return f"hisparse-host-pool-{generation}"


def node_identity() -> str:
    """This machine: host name and boot id (two machines with one host name stay apart)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as boot:
            boot_id = boot.read().strip()
    except OSError:
        boot_id = "no-boot-id"
    return f"{socket.gethostname()}/{boot_id}"


# ---------------------------------------------------------------------------------------------- factory
def open_host_pool(
    layer_num: int,
    num_rows: int,
    item_bytes: int,
    *,
    pin: bool | None = None,
    device: torch.device | None = None,
    threads: int | None = None,
    group: Any = None,
    timeout_s: float = HANDSHAKE_TIMEOUT_S,
    read_only_readers: bool = False,
) -> HostKVPool:
    """The host pool of this rank: private, or one segment shared by the ranks of ``group`` on this node.

    Every rank of ``group`` must call it with the same sizes. The ranks of a node that share: the lowest
    rank writes (``pool.writable``), the others read. A node with one rank of the group gets a private pool.

    Args:
        layer_num, num_rows, item_bytes, pin, device, threads: as :class:`HostKVPool`.
        group: a ``torch.distributed`` CPU (gloo) group of ranks that hold the same requests and take
            the same allocation decisions (the TP group with DP attention off); None: a private pool.
        timeout_s: seconds the readers of a node have to receive the segment from their writer.
        read_only_readers: readers map the segment read-only (a write faults); not with ``pin``, nor
            where a transfer engine writes into a reader's pool (PD decode).

    Raises:
        SharedHostPoolError: on every rank, if any rank failed (the message names the ranks and why).
    """
    if pin is None:
        pin = torch.cuda.is_available()
    if pin and read_only_readers:
        raise SharedHostPoolError("read_only_readers needs pin=False: CUDA pins only writable mappings.")
    if group is None or torch.distributed.get_world_size(group=group) == 1:
        return HostKVPool(layer_num, num_rows, item_bytes, pin=pin, device=device, threads=threads)
    layout = SegmentLayout(layer_num, num_rows, item_bytes, layer_stride(num_rows * item_bytes, pin))
    return _Handshake(layout, pin, device, threads, group, timeout_s, read_only_readers).run()


class _Handshake:
    """The three collectives (who is where; the writers' descriptors; every rank's outcome) and the
    socket exchange between them. Every rank runs all three whatever happens, so a failure on one rank
    becomes the same error on all of them instead of a hang. A writer touches the segment before the
    second collective and pins it after handing it over, so the ranks of a node pin at the same time."""

    def __init__(self, layout: SegmentLayout, pin: bool, device, threads, group, timeout_s: float,
                 read_only_readers: bool) -> None:
        self.layout = layout
        self.read_only_readers = read_only_readers
        self.pin = pin
        self.device = device
        self.threads = threads
        self.group = group
        self.timeout_s = timeout_s
        self.rank = torch.distributed.get_rank(group=group)
        self.pool: HostKVPool | None = None
        self.segment: SharedSegment | None = None
        self.descriptor: SegmentDescriptor | None = None
        self.listener: socket.socket | None = None

    def run(self) -> HostKVPool:
        node = node_identity()
        peers = self._gather({"node": node, "pid": os.getpid()})
        node_ranks = [rank for rank, peer in enumerate(peers) if peer["node"] == node]
        writer = node_ranks[0]
        readers = {peers[rank]["pid"]: rank for rank in node_ranks[1:]}
        if readers and self.rank == writer:
            error = self._attempt(lambda: self._create(node))
        else:
            error = None if self.rank != writer else self._attempt(self._private)
        descriptor = self.descriptor and dataclasses.asdict(self.descriptor)
        posted = self._gather({"descriptor": descriptor, "error": error})
        self._raise_failures([post["error"] for post in posted], peers, "creating the pools")
        if self.rank == writer and readers:
            error = self._attempt(lambda: self._serve(readers))
        elif self.rank != writer:
            error = self._attempt(lambda: self._attach(SegmentDescriptor(**posted[writer]["descriptor"])))
        outcomes = self._gather(error)
        self._close_handshake()
        self._raise_failures(outcomes, peers, "sharing the pools")
        if readers:
            logger.info(
                "HiSparse: host pool segment %s shared by TP ranks %s of this node (rank %d writes it; this rank %s)",
                self.pool.segment.name, node_ranks, writer, "writes" if self.pool.writable else "reads",
            )
        return self.pool

    # ------------------------------------------------------------------ the steps of one rank
    def _private(self) -> None:
        self.pool = self._pool(segment=None)

    def _pool(self, segment: SharedSegment | None) -> HostKVPool:
        layout = self.layout
        return HostKVPool(layout.layer_num, layout.num_rows, layout.item_bytes, pin=self.pin, device=self.device,
                          threads=self.threads, segment=segment)

    def _create(self, node: str) -> None:
        self.segment = SharedSegment.create(self.layout)
        seconds = self.segment.touch(self.threads)
        logger.info("HiSparse: shared host pool segment of %.2f GiB touched in %.1f s", self.layout.nbytes / 2**30,
                    seconds)
        self.segment.publish()
        socket_name = "\0" + self.segment.name  # abstract: no file to clean up after a crash
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self.listener.bind(socket_name)
        self.listener.listen(64)
        self.descriptor = self.segment.descriptor(node, socket_name)

    def _serve(self, readers: dict[int, int]) -> None:
        """Hand the segment over, then pin it here while the readers pin it in their processes."""
        serve_segment(self.listener, self.descriptor, self.segment.fd, readers, self.timeout_s)
        self.pool = self._pool(self.segment)

    def _attach(self, descriptor: SegmentDescriptor) -> None:
        fd = receive_segment(descriptor, self.timeout_s)
        self.segment = SharedSegment.attach(fd, descriptor, self.layout, map_writable=not self.read_only_readers)
        self.pool = self._pool(self.segment)

    # ------------------------------------------------------------------ helpers
    def _attempt(self, step) -> str | None:
        """None, or why the step failed on this rank (raised on every rank after the next collective)."""
        try:
            step()
            return None
        except HiSparseError as exc:
            return f"{type(exc).__name__}: {exc}"
        except Exception as exc:  # any failure must reach the other ranks, not leave them in a collective
            logger.exception("HiSparse: rank %d failed while sharing the host pool", self.rank)
            return f"{type(exc).__name__}: {exc}"

    def _gather(self, value):
        values = [None] * torch.distributed.get_world_size(group=self.group)
        torch.distributed.all_gather_object(values, value, group=self.group)
        return values

    def _raise_failures(self, errors: list[str | None], peers: list[dict], what: str) -> None:
        failed = [(rank, error) for rank, error in enumerate(errors) if error is not None]
        if not failed:
            return
        self._close_handshake()
        if self.pool is not None:
            self.pool.region.close()
            self.pool = None
        listed = "; ".join(f"rank {rank} (pid {peers[rank]['pid']}): {error}" for rank, error in failed[:4])
        raise SharedHostPoolError(f"{len(failed)} TP rank(s) failed {what}: {listed}")

    def _close_handshake(self) -> None:
        if self.listener is not None:
            self.listener.close()
            self.listener = None
        if self.segment is not None:
            self.segment.close_fd()


def serve_segment(listener: socket.socket, descriptor: SegmentDescriptor, fd: int, readers: dict[int, int],
                  timeout_s: float) -> None:
    """Hand the segment's ``fd`` to every reader pid of ``readers`` (pid -> TP rank), and to no other process.

    Raises:
        SharedHostPoolError: some readers did not connect within ``timeout_s`` (named by rank).
    """
    deadline = time.monotonic() + timeout_s
    served: set[int] = set()
    message = descriptor.to_json()
    while len(served) < len(readers):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            missing = sorted(readers[pid] for pid in readers if pid not in served)
            raise SharedHostPoolError(
                f"TP ranks {missing} did not collect the shared host pool within {timeout_s:.0f} s; {_DISABLE_HINT}."
            )
        listener.settimeout(remaining)
        try:
            connection, _ = listener.accept()
        except TimeoutError:
            continue
        with connection:
            pid = peer_pid(connection)
            if pid not in readers or pid in served:
                logger.warning("HiSparse: pid %d asked for the shared host pool and was refused", pid)
                continue
            socket.send_fds(connection, [message], [fd])
            served.add(pid)


def peer_pid(connection: socket.socket) -> int:
    """The pid of the process at the other end of a Unix socket (from the kernel, not from the peer)."""
    pid, _, _ = _PEER_CREDENTIALS.unpack(
        connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEER_CREDENTIALS.size)
    )
    return pid


def receive_segment(descriptor: SegmentDescriptor, timeout_s: float) -> int:
    """The memfd of ``descriptor``'s segment, received from its writer's socket.

    Raises:
        SharedHostPoolError: no writer, a listener that is not the announced writer, or a refusal.
    """
    deadline = time.monotonic() + timeout_s
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as connection:
        while True:
            try:
                connection.connect(descriptor.socket_name)
                break
            except (ConnectionRefusedError, FileNotFoundError) as exc:
                if time.monotonic() > deadline:
                    raise SharedHostPoolError(
                        f"no writer listens for shared host pool {descriptor.generation} (pid {descriptor.owner_pid}): "
                        f"{exc}; the ranks of a node must share a network namespace, or {_DISABLE_HINT}."
                    ) from exc
                time.sleep(0.05)
        pid = peer_pid(connection)
        if pid != descriptor.owner_pid:
            raise SharedHostPoolError(
                f"pid {pid}, not the announced writer {descriptor.owner_pid}, listens for shared host pool "
                f"{descriptor.generation}; restart the ranks of this node."
            )
        connection.settimeout(max(deadline - time.monotonic(), 1.0))
        message, fds, _, _ = socket.recv_fds(connection, _DESCRIPTOR_LIMIT, 1)
    if not fds:
        raise SharedHostPoolError(
            f"the writer (pid {descriptor.owner_pid}) closed the connection without handing over the shared host "
            f"pool: it did not expect this process (pid {os.getpid()}) among its node's TP ranks."
        )
    received = SegmentDescriptor.from_json(message)
    if received.generation != descriptor.generation:
        for fd in fds:
            os.close(fd)
        raise SharedHostPoolError(
            f"the writer handed over segment {received.generation}, the TP group announced {descriptor.generation}."
        )
    return fds[0]
