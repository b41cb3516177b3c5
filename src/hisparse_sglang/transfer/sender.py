"""The prefill side: write a request's KV rows, every layer, into the pages a decode receiver granted.

Usage (any process; the decode's control address is all it needs)::

    sender = Sender(KVSource.from_host_pool(prefill_pool, page_size=64))
    decode = sender.connect("10.0.0.2:18001")            # fetches and validates the DecodeLayout
    grant = decode.request("req-7", num_tokens=5000)      # the decode grants pages, or rejects (typed)
    decode.send(grant, src_pages)                         # every layer, then "done"; "abort" on error

``src_pages`` are the request's pages in the source pool, in token order (the prefill's page
table); ``runs.page_write_entries`` says which bytes go where. Only the request's rows are
written: the tail of its last decode page stays untouched.

Before the first write to a decode, the sender has (1) heard the decode on its control channel,
(2) probed its Mooncake session with a bound, and (3) checked that the session's first registered
region is the layout's layer 0 (:class:`SessionMismatchError` otherwise), so a misrouted session
id never writes into another process. Each decode gets its own Mooncake engine by default, so a
peer that stops answering stalls only its own transfers (``engine.py`` explains the 60 s handshake).
"""

from __future__ import annotations

import logging
import threading
from typing import Sequence

import torch

from hisparse_sglang.transfer.control import ControlClient
from hisparse_sglang.transfer.engine import DEFAULT_MAX_BATCH_ENTRIES, TransferEngine, WriteStats
from hisparse_sglang.transfer.errors import ControlProtocolError, SessionMismatchError, TransferError
from hisparse_sglang.transfer.protocol import (
    Ack,
    DecodeLayout,
    TransferAbort,
    TransferDone,
    TransferGrant,
    TransferRequest,
)
from hisparse_sglang.transfer.runs import KVSource, page_write_entries

__all__ = ["Sender", "DecodeConnection"]

logger = logging.getLogger(__name__)

_ABORT_TIMEOUT_S = 2.0


class Sender:
    """Prefill-side writer of KV rows to decode receivers.

    Args:
        source: the KV pool the rows are read from (registered with every engine it writes with).
        hostname: this host's IP address (Mooncake).
        protocol: "tcp" or "rdma"; must match the decode's.
        device: RDMA device names ("" = all).
        max_batch_entries, max_inflight_batches: see :class:`TransferEngine`.
        control_timeout_s: connect and reply timeout of the control channel.
        mooncake_timeout_s: ``MC_TRANSFER_TIMEOUT`` of the engines (None: the environment's).
        engine_per_peer: one Mooncake engine per decode session (a stalled peer stalls only its
            own engine; the source is registered once per engine) instead of one shared engine.
    """

    def __init__(
        self,
        source: KVSource,
        *,
        hostname: str = "127.0.0.1",
        protocol: str = "tcp",
        device: str = "",
        max_batch_entries: int = DEFAULT_MAX_BATCH_ENTRIES,
        max_inflight_batches: int = 2,
        control_timeout_s: float = 10.0,
        mooncake_timeout_s: float | None = None,
        engine_per_peer: bool = True,
    ) -> None:
        self.source = source
        self._engine_args = dict(
            hostname=hostname,
            protocol=protocol,
            device=device,
            max_batch_entries=max_batch_entries,
            max_inflight_batches=max_inflight_batches,
            mooncake_timeout_s=mooncake_timeout_s,
        )
        self.control_timeout_s = control_timeout_s
        self.engine_per_peer = engine_per_peer
        self._engines: dict[str, TransferEngine] = {}
        self._connections: list[DecodeConnection] = []
        self._lock = threading.Lock()

    def engine_for(self, session: str) -> TransferEngine:
        """The engine that writes to ``session`` (created, with the source registered, on first use)."""
        key = session if self.engine_per_peer else ""
        with self._lock:
            engine = self._engines.get(key)
            if engine is None:
                engine = TransferEngine(**self._engine_args)
                try:
                    engine.register_regions(*self.source.region_infos())
                except BaseException:
                    engine.close()
                    raise
                self._engines[key] = engine
            return engine

    def connect(self, control_address: str, *, session_id: str | None = None) -> DecodeConnection:
        """Open a control connection to a decode receiver and fetch its layout.

        Args:
            control_address: the decode's control ``host:port``.
            session_id: the decode's Mooncake session as learned elsewhere (e.g. from a router);
                it must equal the session in the layout. None: use the layout's.

        Raises:
            PeerUnreachableError, TransferTimeoutError: the decode does not answer.
            ControlProtocolError: it answered with something other than a valid layout.
        """
        connection = DecodeConnection(self, control_address, session_id)
        self._connections.append(connection)
        return connection

    def close(self) -> None:
        for connection in self._connections:
            connection.close()
        self._connections.clear()
        with self._lock:
            for engine in self._engines.values():
                engine.close()
            self._engines.clear()

    def __enter__(self) -> Sender:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class DecodeConnection:
    """One prefill writer's connection to one decode receiver (not thread-safe; one per thread)."""

    def __init__(self, sender: Sender, control_address: str, session_id: str | None) -> None:
        self.sender = sender
        self.control_address = control_address
        self.control = ControlClient(control_address, sender.control_timeout_s)
        try:
            kind, body = self.control.call("hello", {})
            if kind != "layout":
                raise ControlProtocolError(
                    f"decode {control_address} answered hello with {kind!r}, not a layout.", peer=control_address
                )
            self.layout = DecodeLayout.from_dict(body)
        except BaseException:
            self.control.close()
            raise
        self.session_id = session_id or self.layout.session_id
        self._session_verified = False
        self._written: dict[str, int] = {}

    # ------------------------------------------------------------------ requests
    def request(self, request_id: str, num_tokens: int) -> TransferGrant:
        """Ask the decode for pages for ``num_tokens`` tokens of every layer.

        Raises:
            RequestRejectedError, LayoutMismatchError: the decode refused (too many pages, no room,
                wrong layer count / row bytes / page size); nothing was allocated.
            ControlProtocolError, SessionMismatchError: the grant is invalid for the decode's layout.
        """
        source = self.sender.source
        message = TransferRequest(request_id, num_tokens, source.layer_num, source.row_bytes, source.page_size)
        kind, body = self.control.call("request", message.to_dict(), request_id=request_id)
        if kind != "grant":
            raise ControlProtocolError(
                f"decode {self.control_address} answered the request of {request_id!r} with {kind!r}, not a grant.",
                peer=self.control_address,
                request_id=request_id,
            )
        grant = TransferGrant.from_dict(body)
        if grant.request_id != request_id or grant.num_tokens != num_tokens:
            raise ControlProtocolError(
                f"decode {self.control_address} answered the request of {request_id!r} ({num_tokens} tokens) with a "
                f"grant of {grant.request_id!r} ({grant.num_tokens} tokens).",
                peer=self.control_address,
                request_id=request_id,
            )
        grant.validate(self.layout)
        self._written[request_id] = 0
        return grant

    def write(
        self,
        grant: TransferGrant,
        src_pages: Sequence[int] | torch.Tensor,
        *,
        layers: Sequence[int] | None = None,
        timeout_s: float | None = None,
        deadline: float | None = None,
    ) -> WriteStats:
        """Write the request's rows of ``layers`` (default: all) without reporting completion.

        Raises the typed errors of :meth:`TransferEngine.write`; the decode learns of a failure
        only through :meth:`abort` (which :meth:`send` does for you).
        """
        entries = page_write_entries(self.sender.source, self.layout, grant, src_pages, layers)
        engine = self._engine(grant.request_id)
        stats = engine.write(
            self.session_id, *entries, timeout_s=timeout_s, deadline=deadline, request_id=grant.request_id
        )
        self._written[grant.request_id] = self._written.get(grant.request_id, 0) + stats.bytes
        return stats

    def done(self, grant: TransferGrant) -> None:
        """Report every row of the request written; the decode checks the byte count, then acknowledges.

        Raises:
            TransferAbortedError, SessionMismatchError: the decode refused the completion (it failed
                the request); TransferTimeoutError: the request had timed out on the decode side.
        """
        message = TransferDone(grant.request_id, grant.instance_id, self._written.pop(grant.request_id, 0))
        kind, body = self.control.call("done", message.to_dict(), request_id=grant.request_id)
        if kind != "ack" or Ack.from_dict(body).request_id != grant.request_id:
            raise ControlProtocolError(
                f"decode {self.control_address} answered done of {grant.request_id!r} with {kind!r} {body!r}.",
                peer=self.control_address,
                request_id=grant.request_id,
            )

    def abort(self, request_id: str, error: BaseException) -> bool:
        """Tell the decode the request failed here (best effort, bounded); True if it acknowledged."""
        self._written.pop(request_id, None)
        try:
            self.control.call(
                "abort", TransferAbort.from_error(request_id, error).to_dict(), timeout_s=_ABORT_TIMEOUT_S,
                request_id=request_id,
            )
            return True
        except TransferError as exc:
            logger.warning("could not report the failure of request %r to the decode: %s", request_id, exc)
            return False

    def send(
        self, grant: TransferGrant, src_pages: Sequence[int] | torch.Tensor, *, timeout_s: float | None = None
    ) -> WriteStats:
        """Write every layer of the request, then report it done; on a write error abort it and raise."""
        try:
            stats = self.write(grant, src_pages, timeout_s=timeout_s)
        except Exception as exc:
            self.abort(grant.request_id, exc)
            raise
        self.done(grant)
        return stats

    # ------------------------------------------------------------------ internals
    def _engine(self, request_id: str) -> TransferEngine:
        if self.session_id != self.layout.session_id:
            raise SessionMismatchError(
                f"request {request_id!r}: the Mooncake session {self.session_id} given for decode "
                f"{self.control_address} is not the session it published ({self.layout.session_id}); writing there "
                f"would hit another process. Fix: route the request with the session id from the decode's layout.",
                peer=self.session_id,
                request_id=request_id,
            )
        engine = self.sender.engine_for(self.session_id)
        if not self._session_verified:
            engine.check_peer(self.session_id, request_id)
            engine.verify_session(self.session_id, self.layout.layer_bases[0], request_id)
            self._session_verified = True
        return engine

    def close(self) -> None:
        self.control.close()

    def __enter__(self) -> DecodeConnection:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
