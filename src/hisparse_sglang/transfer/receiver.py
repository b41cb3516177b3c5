"""The decode side: a host KV pool registered with Mooncake, page grants for incoming requests, outcomes.

A :class:`Receiver` owns

* a :class:`~hisparse_sglang.memory.HostKVPool` (one region per layer; row ``i`` of every layer is
  logical token location ``i``, as in the SGLang plugin), every layer registered with its own
  Mooncake engine, layer 0 first;
* a :class:`~hisparse_sglang.transfer.ledger.RequestLedger` over a page allocator
  (``pages.py``: a private one by default, or the logical space of a ``KVAllocator``);
* a control server (``control.py``, one thread) that prefill writers connect to: they fetch the
  :class:`DecodeLayout`, ``request`` pages (``grant`` or ``reject``), write the rows with Mooncake,
  then report ``done`` or ``abort``.

A request the receiver cannot take (wrong layer count, row bytes or page size, more pages than one
request may take, not enough free pages, duplicate id) is rejected before anything is allocated.
A granted request fails, with a typed error, when its writer aborts it, disconnects before
``done`` (:class:`SenderLostError`), misses ``transfer_timeout_s`` (:class:`TransferTimeoutError`),
reports a wrong byte count or another decode instance (:class:`TransferAbortedError`,
:class:`SessionMismatchError`), or is aborted here (:meth:`Receiver.abort`). Its pages go to the
ledger's quarantine and become free again once its writer is quiet and ``quarantine_s`` passed.
Other requests and writers are unaffected, and the receiver keeps serving. It never initiates a
Mooncake contact, so a stopped or dead writer cannot stall it.

Finished requests (completed or failed) are delivered as :class:`TransferOutcome` either to the
``on_finished`` callback (called on the control thread, outside the receiver's lock: this is where
the decode admits a completed request, e.g. ``Coordinator.admit_direct``) or, without a callback,
through :meth:`Receiver.poll` and :meth:`Receiver.wait`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from typing import Callable

import torch

from hisparse_sglang.memory.host_pool import HostKVPool
from hisparse_sglang.transfer.control import Connection, ControlServer
from hisparse_sglang.transfer.engine import TransferEngine
from hisparse_sglang.transfer.errors import (
    ControlProtocolError,
    RequestRejectedError,
    SessionMismatchError,
    TransferAbortedError,
    TransferError,
    TransferSetupError,
    TransferTimeoutError,
)
from hisparse_sglang.transfer.ledger import RequestLedger, RequestRecord, RequestStatus
from hisparse_sglang.transfer.pages import OwnPages, PageAllocator
from hisparse_sglang.transfer.protocol import (
    Ack,
    DecodeLayout,
    TransferAbort,
    TransferDone,
    TransferGrant,
    TransferRequest,
)

__all__ = ["Receiver", "TransferOutcome"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class TransferOutcome:
    """How a request ended on the decode side.

    Attributes:
        status: "completed" or "failed".
        rows: int64 ``[num_tokens]`` host rows (= logical locations) of the request in token
            order; empty when the request was rejected before a grant.
        error: the typed error of a failed request.
    """

    request_id: str
    status: str
    num_tokens: int
    rows: torch.Tensor
    error: TransferError | None

    @property
    def ok(self) -> bool:
        return self.status == RequestStatus.COMPLETED.value


class Receiver:
    """Decode-side receiver of KV pages written by prefill instances.

    Args:
        pool: the host KV pool the prefill writes into.
        page_size: rows per page (64 for DSA models).
        allocator: where granted pages come from; default a private allocator over the pool.
        hostname: this host's IP address, as the prefill reaches it (Mooncake and control).
        protocol, device: Mooncake protocol ("tcp"/"rdma") and RDMA device names.
        control_host, control_port: where the control server listens (default hostname, any port).
        transfer_timeout_s: a granted request must be reported done within this time.
        quarantine_s: see ``ledger.py``; default the Mooncake transfer timeout + 5 s.
        max_pages_per_request: the most pages one request may take (default: every page).
        mooncake_timeout_s: ``MC_TRANSFER_TIMEOUT`` of this receiver's engine (None: the environment's).
        on_finished: called with every :class:`TransferOutcome` on the control thread (then
            :meth:`poll` returns nothing).

    Raises:
        TransferSetupError: the allocator does not fit the pool, or registration failed.
        TransferEngineUnavailableError: Mooncake is missing or cannot initialise.
    """

    def __init__(
        self,
        pool: HostKVPool,
        page_size: int = 64,
        *,
        allocator: PageAllocator | None = None,
        hostname: str = "127.0.0.1",
        protocol: str = "tcp",
        device: str = "",
        control_host: str | None = None,
        control_port: int = 0,
        transfer_timeout_s: float = 60.0,
        quarantine_s: float | None = None,
        max_pages_per_request: int | None = None,
        mooncake_timeout_s: float | None = None,
        on_finished: Callable[[TransferOutcome], None] | None = None,
    ) -> None:
        allocator = OwnPages(pool.num_rows // page_size, page_size) if allocator is None else allocator
        if allocator.page_size != page_size or allocator.num_pages * page_size > pool.num_rows:
            raise TransferSetupError(
                f"the page allocator ({allocator.num_pages} pages of {allocator.page_size} rows) does not fit the host "
                f"pool ({pool.num_rows} rows, page_size {page_size}). Fix: build both from the same page size and "
                f"row count."
            )
        self.pool = pool
        self.page_size = page_size
        self.on_finished = on_finished
        self.engine = TransferEngine(hostname, protocol, device, mooncake_timeout_s=mooncake_timeout_s)
        pointers, lengths = pool.region_infos()
        try:
            self.engine.register_regions(pointers, lengths)
            self.ledger = RequestLedger(
                allocator,
                transfer_timeout_s=transfer_timeout_s,
                quarantine_s=self.engine.mooncake_timeout_s + 5.0 if quarantine_s is None else quarantine_s,
                max_pages_per_request=max_pages_per_request,
            )
            self.layout = DecodeLayout(
                instance_id=uuid.uuid4().hex,
                session_id=self.engine.session_id,
                protocol=protocol,
                layer_bases=tuple(pointers),
                num_rows=allocator.num_pages * page_size,
                row_bytes=pool.item_bytes,
                page_size=page_size,
                max_pages_per_request=self.ledger.max_pages_per_request,
            )
            self._lock = threading.Lock()
            self._changed = threading.Condition(self._lock)
            self._server = ControlServer(
                control_host or hostname, control_port, self._handle, self._writer_gone, self._tick
            )
        except BaseException:
            self.engine.close()
            raise
        self.control_address = self._server.address
        logger.info(
            "KV receiver: session %s, control %s, %d layers x %d pages of %d x %d B",
            self.session_id, self.control_address, self.layout.layer_num, allocator.num_pages, page_size,
            pool.item_bytes,
        )

    @property
    def session_id(self) -> str:
        return self.layout.session_id

    # ------------------------------------------------------------------ decode-side API
    def allocate(self, request_id: str, num_tokens: int) -> TransferGrant:
        """Preallocate pages for a request (decode-driven flow); a writer claims it by requesting the same id.

        Raises:
            RequestRejectedError: duplicate id, too many pages, or not enough free pages.
        """
        with self._changed:
            record = self.ledger.open(request_id, num_tokens, None, time.monotonic())
            return self._grant(record)

    def abort(self, request_id: str, reason: str = "aborted by the decode scheduler") -> None:
        """Fail an open request (its pages are quarantined); no-op for a finished one."""
        with self._changed:
            record = self.ledger.records.get(request_id)
            error = TransferAbortedError(
                f"request {request_id!r} was aborted on the decode side: {reason}.",
                peer=None if record is None or record.owner is None else str(record.owner),
                request_id=request_id,
            )
            if self.ledger.fail(request_id, error, time.monotonic(), writer_quiet=False) is not None:
                self._changed.notify_all()

    def wait(self, request_id: str, timeout_s: float = 60.0) -> TransferOutcome:
        """Block until the request completed or failed.

        Raises:
            TransferTimeoutError: it is still open after ``timeout_s`` (it stays open).
            RequestRejectedError: the id is unknown.
        """
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                record = self.ledger.records.get(request_id)
                if record is None:
                    raise RequestRejectedError(
                        f"unknown request {request_id!r} (never granted, or released).", request_id=request_id
                    )
                if record.status != RequestStatus.OPEN:
                    return self._outcome(record)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TransferTimeoutError(
                        f"request {request_id!r} is still open after {timeout_s:.1f} s.", request_id=request_id
                    )
                self._changed.wait(remaining)

    def poll(self) -> list[TransferOutcome]:
        """Requests that completed or failed since the last call (empty when ``on_finished`` is set)."""
        if self.on_finished is not None:
            return []
        with self._lock:
            return [self._outcome(record) for record in self.ledger.take_finished()]

    def release(self, request_id: str) -> None:
        """The decode is done with a finished request: free a completed one's pages (a failed one's age out)."""
        with self._lock:
            self.ledger.release(request_id)

    def handover(self, request_id: str) -> TransferOutcome:
        """Give a completed request's pages to the caller, who frees them through the allocator.

        Use it when the request is admitted into decoding with a shared ``KVAllocator``
        (``pages.LogicalPages``): the scheduler then frees the rows when the request ends.

        Raises:
            RequestRejectedError: the request is unknown, open or failed.
        """
        with self._lock:
            record = self.ledger.records.get(request_id)
            if record is None or record.status != RequestStatus.COMPLETED:
                state = "unknown" if record is None else record.status.value
                raise RequestRejectedError(
                    f"cannot hand over request {request_id!r}: it is {state}, only a completed request can be "
                    f"admitted.",
                    request_id=request_id,
                )
            return self._outcome(self.ledger.release(request_id, free_pages=False))

    def stats(self) -> dict[str, int]:
        with self._lock:
            self.ledger.release_quarantined(time.monotonic())
            return self.ledger.stats()

    def check_invariants(self, exclusive: bool = True) -> None:
        with self._lock:
            self.ledger.check_invariants(exclusive)

    def close(self) -> None:
        """Stop serving, close every connection, unregister the pool and drop the engine."""
        self._server.close()
        self.engine.close()

    def __enter__(self) -> Receiver:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ helpers
    def _grant(self, record: RequestRecord) -> TransferGrant:
        return TransferGrant(
            request_id=record.request_id,
            instance_id=self.layout.instance_id,
            session_id=self.layout.session_id,
            num_tokens=record.num_tokens,
            page_ids=tuple(record.pages),
        )

    def _outcome(self, record: RequestRecord) -> TransferOutcome:
        pages = torch.tensor(record.pages, dtype=torch.int64)
        rows = (pages[:, None] * self.page_size + torch.arange(self.page_size)).reshape(-1)[: record.num_tokens]
        return TransferOutcome(record.request_id, record.status.value, record.num_tokens, rows, record.error)

    # ------------------------------------------------------------------ control thread
    def _handle(self, connection: Connection, kind: str, body: dict) -> tuple[str, dict]:
        now = time.monotonic()
        with self._changed:
            try:
                if kind == "hello":
                    return "layout", self.layout.to_dict()
                if kind == "request":
                    return "grant", self._on_request(connection, TransferRequest.from_dict(body), now).to_dict()
                if kind == "done":
                    done = TransferDone.from_dict(body)
                    self._check_done(connection, done, now)
                    self.ledger.complete(done.request_id, connection, now)
                    logger.info("KV receiver: request %r complete (%d bytes)", done.request_id, done.bytes_written)
                    return "ack", Ack(done.request_id).to_dict()
                if kind == "abort":
                    return "ack", self._on_abort(connection, TransferAbort.from_dict(body), now).to_dict()
                raise ControlProtocolError(
                    f"{connection} sent a {kind!r} message, which only the decode side sends; a prefill writer sends "
                    f"hello, request, done or abort.",
                    peer=connection.name,
                )
            except TransferError as exc:
                logger.warning("KV receiver: %s: %s", type(exc).__name__, exc)
                raise
            finally:
                self._changed.notify_all()

    def _on_request(self, connection: Connection, request: TransferRequest, now: float) -> TransferGrant:
        try:
            self.layout.check_source(request.layer_num, request.row_bytes, request.page_size, request.request_id)
        except TransferError as exc:
            exc.peer = connection.name
            self.ledger.reject(request.request_id, request.num_tokens, exc, connection, now)
            raise
        record = self.ledger.open(request.request_id, request.num_tokens, connection, now)
        logger.info(
            "KV receiver: granted %d pages to request %r (%d tokens) for %s",
            len(record.pages), request.request_id, request.num_tokens, connection,
        )
        return self._grant(record)

    def _on_abort(self, connection: Connection, abort: TransferAbort, now: float) -> Ack:
        record = self.ledger.records.get(abort.request_id)
        if record is None or record.owner is not connection:
            raise RequestRejectedError(
                f"{connection} cannot abort request {abort.request_id!r}: it is not a request this writer holds.",
                peer=connection.name,
                request_id=abort.request_id,
            )
        self.ledger.fail(abort.request_id, abort.to_error(connection.name), now, writer_quiet=True)
        return Ack(abort.request_id)

    def _check_done(self, connection: Connection, done: TransferDone, now: float) -> None:
        """Validate a completion before accepting it; a wrong one fails the request (its writer is quiet)."""
        record = self.ledger.records.get(done.request_id)
        if record is None or record.status != RequestStatus.OPEN or record.owner is not connection:
            return  # ledger.complete raises the right error
        error: TransferError | None = None
        expected = record.num_tokens * self.layout.row_bytes * self.layout.layer_num
        if done.instance_id != self.layout.instance_id:
            error = SessionMismatchError(
                f"done of request {done.request_id!r} names decode instance {done.instance_id!r}, this is "
                f"{self.layout.instance_id}: the prefill wrote with a stale layout.",
                peer=connection.name,
                request_id=done.request_id,
            )
        elif done.bytes_written != expected:
            error = TransferAbortedError(
                f"the decode aborted request {done.request_id!r}: {connection} reported {done.bytes_written} bytes "
                f"written, the request needs {expected} ({record.num_tokens} tokens x {self.layout.layer_num} layers "
                f"x {self.layout.row_bytes} B), so its rows are incomplete.",
                peer=connection.name,
                request_id=done.request_id,
            )
        if error is not None:
            self.ledger.fail(done.request_id, error, now, writer_quiet=True)

    def _writer_gone(self, connection: Connection) -> None:
        with self._changed:
            for record in self.ledger.owner_gone(connection, time.monotonic()):
                logger.warning("KV receiver: %s", record.error)
            self._changed.notify_all()

    def _tick(self) -> None:
        with self._changed:
            now = time.monotonic()
            expired = self.ledger.expire(now)
            freed = self.ledger.release_quarantined(now)
            for record in expired:
                logger.warning("KV receiver: %s", record.error)
            if freed:
                logger.info("KV receiver: %d quarantined pages freed", freed)
            if expired or freed:
                self._changed.notify_all()
            finished = self.ledger.take_finished() if self.on_finished is not None else []
            outcomes = [self._outcome(record) for record in finished]
        for outcome in outcomes:
            if not outcome.ok:
                logger.warning("KV receiver: request %r failed: %s", outcome.request_id, outcome.error)
            self.on_finished(outcome)
