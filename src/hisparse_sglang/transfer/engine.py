"""A Mooncake ``TransferEngine`` with typed errors, bounded batches and a deadline.

What :class:`TransferEngine` adds to ``mooncake.engine.TransferEngine`` (0.3.13):

* **Lazy import**: Mooncake is imported when an engine is built, never when this module is; a
  missing wheel or system library is :class:`TransferEngineUnavailableError` with the install line.
* **Bounded batches**: :meth:`TransferEngine.write` merges contiguous runs (``src`` and ``dst`` both
  continue the previous entry; over TCP each entry costs a fixed 40-60 us), then submits batches of
  at most ``max_batch_entries`` (1024) with the asynchronous API, at most ``max_inflight_batches``
  (2) in flight and never more than 2048 entries: Mooncake's TCP transport rejects more per peer
  after writing part of them. One write at a time per engine keeps the bound per peer.
* **Batch-id guard**: a failed asynchronous submit returns 0 or ``2**64 - 1``, and
  ``get_batch_transfer_status`` on such an id dereferences it (SIGSEGV); every id is checked first.
* **Deadline**: checked before every batch; a batch in flight is bounded by Mooncake's
  ``MC_TRANSFER_TIMEOUT`` (seconds, minimum 5, default 30, plus 1 ns per byte), which Mooncake
  reads when an engine is created: ``mooncake_timeout_s`` sets it around this engine's creation.
* **Typed failures** (``errors.write_failure``): a batch that failed after about
  ``MC_TRANSFER_TIMEOUT`` is a :class:`TransferTimeoutError`; otherwise a bounded probe tells
  :class:`PeerUnreachableError` from :class:`RemoteAddressRejectedError` (a live peer refused a
  destination).

A failed write is **not atomic**: earlier batches landed, part of the failed one may have, and
after a timeout queued writes may land later. The destination rows are dirty; the decode must not
reuse them until the writer is quiet (``ledger.py``). :meth:`TransferEngine.write` waits for every
batch it submitted, failed or not, so the caller may free the source once it returns.

First contact with a peer is Mooncake's P2P handshake: a hard-coded 60 s receive timeout, with the
engine's mutex held. A silent peer (a stopped process, a port that accepts but never answers)
stalls every transfer of that engine for about 60 s, ``send_probe`` and
``get_first_buffer_address`` hang the same way, and ``MC_TRANSFER_TIMEOUT`` does not apply; a second
engine in the same process is unaffected (measured: 3 ms). So the sender (1) hears the decode on
its control channel before any Mooncake contact, (2) probes the session from a thread with a bound
(:meth:`TransferEngine.check_peer`), and (3) uses one engine per decode peer, so a stall stays with
the peer that caused it.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import threading
import time
from typing import Sequence

import torch

from hisparse_sglang.transfer.errors import (
    MOONCAKE_INSTALL_FIX,
    PeerUnreachableError,
    SessionMismatchError,
    TransferEngineUnavailableError,
    TransferError,
    TransferSetupError,
    TransferTimeoutError,
    error_for_code,
    write_failure,
)
from hisparse_sglang.transfer.runs import merge_runs

__all__ = [
    "DEFAULT_MAX_BATCH_ENTRIES",
    "MAX_INFLIGHT_ENTRIES",
    "P2P_METADATA",
    "TransferEngine",
    "WriteStats",
    "load_mooncake",
    "mooncake_transfer_timeout_s",
]

logger = logging.getLogger(__name__)

DEFAULT_MAX_BATCH_ENTRIES = 1024
# Mooncake's TCP transport admits 1024 queued + 1024 pending entries per peer.
MAX_INFLIGHT_ENTRIES = 2048
P2P_METADATA = "P2PHANDSHAKE"
# A batch that failed after this share of MC_TRANSFER_TIMEOUT is taken for a timeout.
_TIMEOUT_SHARE = 0.9
# Batch ids Mooncake returns for a failed asynchronous submit.
_INVALID_BATCH_IDS = (0, 2**64 - 1)
_ENV_LOCK = threading.Lock()


def load_mooncake():
    """Import ``mooncake.engine``; raises :class:`TransferEngineUnavailableError` with the install fix."""
    try:
        import mooncake.engine as module
    except (ImportError, OSError) as exc:
        missing = "a system library" if ".so" in str(exc) else "the mooncake package"
        raise TransferEngineUnavailableError(
            f"the Mooncake transfer engine cannot be imported ({missing} is missing: {exc}). "
            f"Fix: {MOONCAKE_INSTALL_FIX}."
        ) from exc
    return module


def mooncake_transfer_timeout_s(value: str | None = None) -> float:
    """The transfer timeout Mooncake derives from ``MC_TRANSFER_TIMEOUT`` (seconds; min 5, default 30)."""
    value = os.environ.get("MC_TRANSFER_TIMEOUT") if value is None else value
    if value is None:
        return 30.0
    try:
        parsed = int(value)
    except ValueError:
        parsed = 0  # Mooncake parses with atoi(), which reads garbage as 0, then clamps to 5
    return float(max(5, parsed))


@dataclasses.dataclass(frozen=True)
class WriteStats:
    """What one :meth:`TransferEngine.write` did: entries given, after merging, batches, bytes, seconds."""

    entries: int
    merged_entries: int
    batches: int
    bytes: int
    seconds: float

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


@dataclasses.dataclass
class _Batch:
    batch_id: int
    index: int
    first_dst: int
    first_len: int
    nbytes: int
    submitted: float


class TransferEngine:
    """One initialised Mooncake engine.

    Args:
        hostname: the local IP address other engines reach this one at (no port: with
            P2PHANDSHAKE Mooncake picks the RPC port; the session id is ``hostname:port``).
        protocol: "tcp" or "rdma".
        device: RDMA device names, comma separated ("" = all; ignored by tcp).
        metadata_server: "P2PHANDSHAKE" (no metadata service) or an etcd/http address.
        max_batch_entries: most entries per submitted batch.
        max_inflight_batches: most batches in flight per write; the product with
            ``max_batch_entries`` must stay <= 2048.
        mooncake_timeout_s: ``MC_TRANSFER_TIMEOUT`` for this engine (seconds, >= 5); None keeps
            the environment's value (default 30).
        probe_timeout_s: how long a probe of a peer may take before it counts as unanswered.

    Raises:
        TransferSetupError: an argument is out of range.
        TransferEngineUnavailableError: Mooncake is missing, or initialisation failed.
    """

    def __init__(
        self,
        hostname: str = "127.0.0.1",
        protocol: str = "tcp",
        device: str = "",
        metadata_server: str = P2P_METADATA,
        max_batch_entries: int = DEFAULT_MAX_BATCH_ENTRIES,
        max_inflight_batches: int = 2,
        mooncake_timeout_s: float | None = None,
        probe_timeout_s: float = 2.0,
    ) -> None:
        inflight_entries = max_batch_entries * max_inflight_batches
        if max_batch_entries < 1 or max_inflight_batches < 1 or inflight_entries > MAX_INFLIGHT_ENTRIES:
            raise TransferSetupError(
                f"max_batch_entries ({max_batch_entries}) x max_inflight_batches ({max_inflight_batches}) must be "
                f"between 1 and {MAX_INFLIGHT_ENTRIES}: Mooncake's TCP transport rejects, after writing part of them, "
                f"more entries in flight to one peer. Fix: use the defaults (1024 x 2)."
            )
        if protocol not in ("tcp", "rdma"):
            raise TransferSetupError(f"protocol {protocol!r} is not supported; use 'tcp' or 'rdma'.")
        if hostname.count(":") == 1:  # "host:port"; an IPv6 address has several colons
            raise TransferSetupError(
                f"hostname {hostname!r} must be an IP address without a port; with P2PHANDSHAKE Mooncake picks "
                f"the port."
            )
        module = load_mooncake()
        with _ENV_LOCK:
            saved = os.environ.get("MC_TRANSFER_TIMEOUT")
            if mooncake_timeout_s is not None:
                os.environ["MC_TRANSFER_TIMEOUT"] = str(max(5, int(mooncake_timeout_s)))
            try:
                self.mooncake_timeout_s = mooncake_transfer_timeout_s()
                self._engine = module.TransferEngine()
                code = self._engine.initialize(hostname, metadata_server, protocol, device)
            finally:
                if mooncake_timeout_s is not None:
                    if saved is None:
                        os.environ.pop("MC_TRANSFER_TIMEOUT", None)
                    else:
                        os.environ["MC_TRANSFER_TIMEOUT"] = saved
        if code != 0:
            raise TransferEngineUnavailableError(
                f"Mooncake could not initialise (returned {code}) with hostname={hostname!r}, protocol={protocol!r}, "
                f"device={device!r}, metadata={metadata_server!r}. Fix: for RDMA check the device against "
                f"`ibv_devices`; without RDMA use protocol 'tcp'; with P2PHANDSHAKE no metadata service is needed. "
                f"Mooncake's log on stderr has the cause.",
                code=code,
            )
        self.hostname = hostname
        self.protocol = protocol
        self.device = device
        self.max_batch_entries = max_batch_entries
        self.max_inflight_batches = max_inflight_batches
        self.probe_timeout_s = probe_timeout_s
        self.session_id = f"{hostname}:{self._engine.get_rpc_port()}"
        self._regions: dict[int, int] = {}
        self._write_lock = threading.Lock()
        self.closed = False

    # ------------------------------------------------------------------ memory
    def register_regions(self, pointers: Sequence[int], lengths: Sequence[int]) -> None:
        """Register memory regions, in this order (a peer's first-buffer lookup sees the first).

        Raises:
            TransferSetupError: the lists are empty or differ in length, a range overlaps one
                registered already, or the NIC cannot register it (RDMA: ``ulimit -l``).
        """
        pointers, lengths = [int(p) for p in pointers], [int(n) for n in lengths]
        if not pointers or len(pointers) != len(lengths):
            raise TransferSetupError(
                f"register_regions needs matching, non-empty lists of addresses and lengths (got {len(pointers)} "
                f"and {len(lengths)})."
            )
        code = self._engine.batch_register_memory(pointers, lengths)
        if code != 0:
            error = error_for_code(
                code,
                operation="register_memory",
                detail=f"{len(pointers)} regions, the first at {pointers[0]:#x} of {lengths[0]} bytes; for RDMA also "
                f"check `ulimit -l` (locked memory)",
            )
            raise TransferSetupError(str(error), code=code)
        self._regions.update(zip(pointers, lengths))

    def unregister_regions(self, pointers: Sequence[int] | None = None) -> None:
        """Unregister the given regions (default: every region this engine registered)."""
        pointers = list(self._regions) if pointers is None else [int(p) for p in pointers]
        if not pointers:
            return
        unknown = [p for p in pointers if p not in self._regions]
        if unknown:
            raise TransferSetupError(
                f"unregister_regions: address {unknown[0]:#x} was not registered with engine {self.session_id}; "
                f"unregister only the base addresses passed to register_regions."
            )
        code = self._engine.batch_unregister_memory(pointers)
        for pointer in pointers:
            self._regions.pop(pointer, None)
        if code != 0:
            error = error_for_code(code, operation="unregister_memory", detail=f"{len(pointers)} regions")
            raise TransferSetupError(str(error), code=code)

    @property
    def registered_regions(self) -> dict[int, int]:
        return dict(self._regions)

    # ------------------------------------------------------------------ peers
    def probe(self, session: str, timeout_s: float | None = None) -> int | None:
        """Mooncake's ``send_probe`` with a bound: its code, or None if it did not return in time.

        A probe of a silent peer blocks for Mooncake's 60 s handshake timeout; it then runs on in
        a daemon thread (holding this engine's handshake path) while the caller moves on.
        """
        timeout_s = self.probe_timeout_s if timeout_s is None else timeout_s
        result: list[int] = []
        thread = threading.Thread(
            target=lambda: result.append(int(self._engine.send_probe(session))), name="mooncake-probe", daemon=True
        )
        thread.start()
        thread.join(timeout_s)
        return result[0] if result else None

    def check_peer(self, session: str, request_id: str | None = None) -> None:
        """Raise :class:`PeerUnreachableError` unless ``session`` answers a probe within the bound."""
        code = self.probe(session)
        if code is None:
            raise PeerUnreachableError(
                f"Mooncake session {session} did not answer a probe within {self.probe_timeout_s:.1f} s (request "
                f"{request_id!r}): the decode process is stopped or the port belongs to another service. Fix: check "
                f"the decode instance; this engine may stall up to 60 s on that peer.",
                peer=session,
                request_id=request_id,
            )
        if code != 0:
            raise error_for_code(code, operation="probe", peer=session, request_id=request_id)

    def verify_session(self, session: str, first_region: int, request_id: str | None = None) -> None:
        """Raise :class:`SessionMismatchError` unless ``session``'s first registered region starts at ``first_region``.

        Call it only for a peer proven alive (:meth:`check_peer`): the lookup blocks for the
        handshake timeout on a silent peer.
        """
        actual = int(self._engine.get_first_buffer_address(session))
        if actual != first_region:
            raise SessionMismatchError(
                f"Mooncake session {session} is not the decode instance that granted request {request_id!r}: its "
                f"first registered region is at {actual:#x}, the layout says {first_region:#x}"
                f"{' (no region, or unreachable)' if actual == 0 else ''}. Writing there would corrupt another "
                f"process's memory. Fix: take the session id from the decode's layout; reconnect if it restarted.",
                peer=session,
                request_id=request_id,
            )

    # ------------------------------------------------------------------ data
    def write(
        self,
        session: str,
        src: Sequence[int] | torch.Tensor,
        dst: Sequence[int] | torch.Tensor,
        lengths: Sequence[int] | torch.Tensor,
        *,
        timeout_s: float | None = None,
        deadline: float | None = None,
        request_id: str | None = None,
    ) -> WriteStats:
        """Write local ``[src, src+len)`` ranges to the peer's ``[dst, dst+len)`` (absolute peer addresses).

        Args:
            session: the peer's Mooncake session id.
            src, dst, lengths: ``[n]`` entries (int64-convertible); empty entries are dropped,
                contiguous runs merged.
            timeout_s: deadline relative to now; ``deadline`` (``time.monotonic()``) is absolute;
                the earlier one applies. Checked before every batch.
            request_id: named in errors.

        Returns:
            :class:`WriteStats`.

        Raises:
            TransferTimeoutError: the deadline passed before a batch, or a batch hit MC_TRANSFER_TIMEOUT.
            PeerUnreachableError: the peer is gone.
            RemoteAddressRejectedError: the peer refused a destination.
            The destination ranges are dirty after any error (batches are not atomic).
        """
        if self.closed:
            raise TransferSetupError(f"the transfer engine {self.session_id} is closed.", request_id=request_id)
        started = time.monotonic()
        if timeout_s is not None:
            deadline = started + timeout_s if deadline is None else min(deadline, started + timeout_s)
        entries = int(torch.as_tensor(lengths).numel())
        src_m, dst_m, len_m = merge_runs(src, dst, lengths)
        src_l, dst_l, len_l = src_m.tolist(), dst_m.tolist(), len_m.tolist()
        total = sum(len_l)
        step = self.max_batch_entries
        batches = (len(len_l) + step - 1) // step
        progress = {"acknowledged": 0, "total": total, "batches": batches}
        with self._write_lock:
            inflight: collections.deque[_Batch] = collections.deque()
            try:
                for index, begin in enumerate(range(0, len(len_l), step)):
                    end = begin + step
                    now = time.monotonic()
                    if deadline is not None and now >= deadline:
                        raise TransferTimeoutError(
                            f"write of request {request_id!r} to {session} missed its deadline after "
                            f"{now - started:.2f} s: {progress['acknowledged']} of {total} bytes acknowledged, batch "
                            f"{index + 1} of {batches} not started. The destination rows are incomplete. Fix: raise "
                            f"the request's timeout or check the link.",
                            peer=session,
                            request_id=request_id,
                        )
                    batch_id = int(
                        self._engine.batch_transfer_async_write(
                            session, src_l[begin:end], dst_l[begin:end], len_l[begin:end]
                        )
                    )
                    batch = _Batch(batch_id, index, dst_l[begin], len_l[begin], sum(len_l[begin:end]), now)
                    if batch_id in _INVALID_BATCH_IDS:
                        raise self._classify_failure(-1, session, request_id, batch, progress, submitted=False)
                    inflight.append(batch)
                    if len(inflight) >= self.max_inflight_batches:
                        self._wait(inflight.popleft(), session, request_id, progress)
                while inflight:
                    self._wait(inflight.popleft(), session, request_id, progress)
            finally:
                # Never leave a batch behind: the caller may free the source once write() returns.
                for batch in inflight:
                    self._engine.get_batch_transfer_status([batch.batch_id])
        return WriteStats(entries, len(len_l), batches, total, time.monotonic() - started)

    def _wait(self, batch: _Batch, session: str, request_id: str | None, progress: dict) -> None:
        code = int(self._engine.get_batch_transfer_status([batch.batch_id]))
        if code != 0:
            raise self._classify_failure(code, session, request_id, batch, progress, submitted=True)
        progress["acknowledged"] += batch.nbytes

    def _classify_failure(
        self, code: int, session: str, request_id: str | None, batch: _Batch, progress: dict, submitted: bool
    ) -> TransferError:
        elapsed = time.monotonic() - batch.submitted
        what = "failed" if submitted else "could not be submitted (Mooncake returned an invalid batch id)"
        where = (
            f"batch {batch.index + 1} of {progress['batches']} of request {request_id!r} to {session} {what} after "
            f"{elapsed:.2f} s; {progress['acknowledged']} of {progress['total']} bytes were acknowledged before it. "
            f"Part of the batches in flight may have landed (batches are not atomic): the destination rows are dirty."
        )
        timed_out = submitted and elapsed >= _TIMEOUT_SHARE * self.mooncake_timeout_s
        return write_failure(
            code,
            where=where,
            peer=session,
            request_id=request_id,
            timed_out=timed_out,
            mooncake_timeout_s=self.mooncake_timeout_s,
            probe=None if timed_out else self.probe(session),
            destination=(batch.first_dst, batch.first_len),
        )

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Unregister every region and drop the engine (its threads and sockets go with it)."""
        if self.closed:
            return
        try:
            if self._regions:
                self._engine.batch_unregister_memory(list(self._regions))
        finally:
            self._regions.clear()
            self.closed = True
            self._engine = None

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
