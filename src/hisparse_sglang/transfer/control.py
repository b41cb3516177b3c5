"""The control channel: length-prefixed JSON messages over one TCP connection per prefill writer.

Frame: a 4-byte big-endian length, then that many bytes of UTF-8 JSON, the envelope
``{"v": PROTOCOL_VERSION, "type": str, "seq": int, "body": {...}}`` (``protocol.py`` lists the
types and validates the bodies). A reply echoes the ``seq`` of its request, so a reply that
arrives after its request timed out is recognised by its old ``seq`` and dropped, never taken for
the answer to a later question.

Why a socket of our own rather than Mooncake's notify (``TransferNotify`` / ``get_notifies``): a
notify travels only after a successful write, so it can neither carry a typed error back nor tell
the decode that the writer died. A connection does both: the decode sees EOF the moment the writer
process exits (SIGKILL included), and a ``reject`` reply carries a typed error.

:class:`ControlClient` is the prefill's synchronous request/reply end; :class:`ControlServer` is
the decode's end: one thread serving every connection with ``selectors``, calling a handler per
message, a disconnect callback per closed connection and a tick callback about every 50 ms.
"""

from __future__ import annotations

import json
import logging
import selectors
import socket
import struct
import threading
import time
from typing import Callable

from hisparse_sglang.transfer.errors import (
    ControlProtocolError,
    PeerUnreachableError,
    TransferError,
    TransferTimeoutError,
)
from hisparse_sglang.transfer.protocol import MESSAGE_TYPES, PROTOCOL_VERSION, Reject

__all__ = [
    "MAX_MESSAGE_BYTES",
    "encode_message",
    "decode_message",
    "FrameBuffer",
    "ControlClient",
    "ControlServer",
    "Connection",
    "parse_address",
]

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 16 * 2**20
_HEADER = struct.Struct(">I")
_TICK_S = 0.05
_REPLY_TIMEOUT_S = 2.0


def parse_address(address: str) -> tuple[str, int]:
    """``"host:port"`` -> ``(host, port)``; raises :class:`ControlProtocolError` when malformed."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ControlProtocolError(f"control address {address!r} must be 'host:port' (e.g. '127.0.0.1:18001').")
    return host.strip("[]"), int(port)


def encode_message(kind: str, seq: int, body: dict) -> bytes:
    """One frame: length header + JSON envelope."""
    payload = json.dumps({"v": PROTOCOL_VERSION, "type": kind, "seq": seq, "body": body}, separators=(",", ":"))
    data = payload.encode()
    return _HEADER.pack(len(data)) + data


def decode_message(payload: bytes, peer: str | None = None) -> tuple[str, int, dict]:
    """Parse one frame's payload into ``(type, seq, body)``; raises :class:`ControlProtocolError`."""
    try:
        message = json.loads(payload)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ControlProtocolError(
            f"control message from {peer} is not JSON ({exc}): {payload[:80]!r}.", peer=peer
        ) from exc
    if not isinstance(message, dict):
        raise ControlProtocolError(f"control message from {peer} is not a JSON object: {payload[:80]!r}.", peer=peer)
    if message.get("v") != PROTOCOL_VERSION:
        raise ControlProtocolError(
            f"control message from {peer} has protocol version {message.get('v')!r}, this side speaks "
            f"{PROTOCOL_VERSION}; run the same hisparse-sglang version on both instances.",
            peer=peer,
        )
    kind, seq, body = message.get("type"), message.get("seq"), message.get("body")
    if kind not in MESSAGE_TYPES:
        raise ControlProtocolError(
            f"control message from {peer} has the unknown type {kind!r}; expected one of {', '.join(MESSAGE_TYPES)}.",
            peer=peer,
        )
    if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:
        raise ControlProtocolError(
            f"control message from {peer} field 'seq' must be an int >= 0, got {seq!r}.", peer=peer
        )
    if not isinstance(body, dict):
        raise ControlProtocolError(
            f"control message from {peer} field 'body' must be an object, got {body!r}.", peer=peer
        )
    return kind, seq, body


class FrameBuffer:
    """Accumulates received bytes and hands out complete frame payloads."""

    def __init__(self, peer: str | None = None) -> None:
        self._data = bytearray()
        self.peer = peer

    def feed(self, chunk: bytes) -> list[bytes]:
        self._data += chunk
        frames = []
        while len(self._data) >= _HEADER.size:
            (length,) = _HEADER.unpack_from(self._data)
            if length > MAX_MESSAGE_BYTES:
                raise ControlProtocolError(
                    f"control frame from {self.peer} announces {length} bytes, more than the {MAX_MESSAGE_BYTES} "
                    f"allowed; the peer does not speak this protocol.",
                    peer=self.peer,
                )
            if len(self._data) < _HEADER.size + length:
                break
            frames.append(bytes(self._data[_HEADER.size : _HEADER.size + length]))
            del self._data[: _HEADER.size + length]
        return frames


class ControlClient:
    """The prefill side of one control connection: synchronous request/reply with typed errors.

    Args:
        address: the decode's control address ``host:port``.
        timeout_s: connect timeout and default reply timeout.

    Raises:
        PeerUnreachableError: the connection cannot be made.
    """

    def __init__(self, address: str, timeout_s: float = 10.0) -> None:
        self.address = address
        self.timeout_s = timeout_s
        host, port = parse_address(address)
        try:
            self._sock = socket.create_connection((host, port), timeout=timeout_s)
        except OSError as exc:
            raise PeerUnreachableError(
                f"cannot connect to the decode control address {address} within {timeout_s} s: {exc!r}. Fix: check "
                f"that the decode instance is running and that the address is the one it published.",
                peer=address,
            ) from exc
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._frames = FrameBuffer(address)
        self._pending: list[bytes] = []
        self._seq = 0
        self.closed = False

    def call(
        self, kind: str, body: dict, timeout_s: float | None = None, request_id: str | None = None
    ) -> tuple[str, dict]:
        """Send one message and wait for its reply.

        Returns:
            ``(reply_type, reply_body)``; a ``reject`` reply is raised as its typed error instead.

        Raises:
            PeerUnreachableError: the connection is closed or broke.
            TransferTimeoutError: no reply within ``timeout_s`` (the connection stays usable).
        """
        if self.closed:
            raise PeerUnreachableError(
                f"the control connection to {self.address} is closed; connect again.",
                peer=self.address,
                request_id=request_id,
            )
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        self._seq += 1
        seq = self._seq
        deadline = time.monotonic() + timeout_s
        try:
            self._sock.settimeout(max(timeout_s, 0.001))
            self._sock.sendall(encode_message(kind, seq, body))
        except OSError as exc:
            self.close()
            raise PeerUnreachableError(
                f"sending {kind!r} to the decode control address {self.address} failed ({exc!r}); the decode "
                f"instance has exited or closed the connection.",
                peer=self.address,
                request_id=request_id,
            ) from exc
        while True:
            while self._pending:
                reply_kind, reply_seq, reply_body = decode_message(self._pending.pop(0), self.address)
                if reply_seq != seq:
                    continue  # the late answer to a call that timed out earlier
                if reply_kind == "reject":
                    raise Reject.from_dict(reply_body).to_error(peer=self.address)
                return reply_kind, reply_body
            self._receive(kind, timeout_s, deadline, request_id)

    def _receive(self, kind: str, timeout_s: float, deadline: float, request_id: str | None) -> None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TransferTimeoutError(
                f"the decode control address {self.address} did not answer {kind!r} within {timeout_s:.1f} s; the "
                f"decode process is stopped or overloaded. Fix: check the decode instance, or raise control_timeout_s.",
                peer=self.address,
                request_id=request_id,
            )
        try:
            self._sock.settimeout(remaining)
            chunk = self._sock.recv(1 << 16)
        except socket.timeout:
            return
        except OSError as exc:
            self.close()
            raise PeerUnreachableError(
                f"the control connection to {self.address} broke while waiting for the reply to {kind!r} ({exc!r}).",
                peer=self.address,
                request_id=request_id,
            ) from exc
        if not chunk:
            self.close()
            raise PeerUnreachableError(
                f"the decode instance at {self.address} closed the control connection while {kind!r} was pending; "
                f"it exited or restarted.",
                peer=self.address,
                request_id=request_id,
            )
        self._pending.extend(self._frames.feed(chunk))

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._sock.close()


class Connection:
    """One accepted control connection (a prefill writer); its identity owns requests."""

    def __init__(self, sock: socket.socket, address: tuple) -> None:
        self.sock = sock
        self.name = f"prefill writer {address[0]}:{address[1]}"
        self.frames = FrameBuffer(self.name)

    def __repr__(self) -> str:
        return self.name

    __str__ = __repr__


Handler = Callable[[Connection, str, dict], tuple[str, dict]]


class ControlServer:
    """The decode side of the control channel: a listening socket and one serving thread.

    Args:
        host, port: where to listen (port 0: any free port; see :attr:`address`).
        handle: ``handle(connection, type, body) -> (reply_type, reply_body)``; a
            :class:`TransferError` it raises becomes a ``reject`` reply; any other exception is
            logged and rejected as an internal error, and serving goes on.
        on_disconnect: called with a connection once it closed (EOF, error, malformed frame).
        on_tick: called about every 50 ms from the serving thread (deadlines, quarantine).
    """

    def __init__(
        self,
        host: str,
        port: int,
        handle: Handler,
        on_disconnect: Callable[[Connection], None],
        on_tick: Callable[[], None],
    ) -> None:
        self._handle = handle
        self._on_disconnect = on_disconnect
        self._on_tick = on_tick
        self._listener = socket.create_server((host, port))
        self._listener.setblocking(False)
        self.address = "{}:{}".format(*self._listener.getsockname()[:2])
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ, None)
        self._connections: set[Connection] = set()
        self._stopping = False
        self._thread = threading.Thread(target=self._serve, name="hisparse-kv-control", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop serving and close every connection (each gets its disconnect callback)."""
        if self._stopping:
            return
        self._stopping = True
        self._thread.join(timeout=5.0)
        for connection in list(self._connections):
            self._drop(connection, reason=None)
        self._selector.close()
        self._listener.close()

    def _serve(self) -> None:
        while not self._stopping:
            try:
                events = self._selector.select(timeout=_TICK_S)
            except OSError:
                break
            for key, _ in events:
                if key.data is None:
                    self._accept()
                elif key.data in self._connections:
                    self._read(key.data)
            try:
                self._on_tick()
            except Exception:  # a bug in the tick must not stop serving every other writer
                logger.exception("KV control server: tick failed")

    def _accept(self) -> None:
        try:
            sock, address = self._listener.accept()
        except OSError:
            return
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        connection = Connection(sock, address)
        self._connections.add(connection)
        self._selector.register(sock, selectors.EVENT_READ, connection)
        logger.info("KV control server: %s connected", connection)

    def _read(self, connection: Connection) -> None:
        try:
            chunk = connection.sock.recv(1 << 16)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._drop(connection, reason="disconnected")
            return
        try:
            for payload in connection.frames.feed(chunk):
                kind, seq, body = decode_message(payload, connection.name)
                self._dispatch(connection, kind, seq, body)
                if connection not in self._connections:
                    return
        except ControlProtocolError as exc:
            # The stream cannot be trusted past a bad frame: answer once, then hang up.
            self._reply(connection, "reject", 0, Reject.from_error(None, exc).to_dict())
            self._drop(connection, reason=f"sent a malformed message ({exc})")

    def _dispatch(self, connection: Connection, kind: str, seq: int, body: dict) -> None:
        request_id = body.get("request_id") if isinstance(body.get("request_id"), str) else None
        try:
            reply_kind, reply_body = self._handle(connection, kind, body)
        except TransferError as exc:
            reply_kind, reply_body = "reject", Reject.from_error(request_id, exc).to_dict()
        except Exception as exc:  # a bug here must not stop the receiver serving everyone else
            logger.exception("KV control server: %r from %s failed", kind, connection)
            error = TransferError(f"decode receiver internal error handling {kind!r}: {exc!r}", peer=connection.name)
            reply_kind, reply_body = "reject", Reject.from_error(request_id, error).to_dict()
        self._reply(connection, reply_kind, seq, reply_body)

    def _reply(self, connection: Connection, kind: str, seq: int, body: dict) -> None:
        # Replies are small; a writer that does not read them within the bound is dropped.
        try:
            connection.sock.settimeout(_REPLY_TIMEOUT_S)
            connection.sock.sendall(encode_message(kind, seq, body))
            connection.sock.setblocking(False)
        except OSError:
            self._drop(connection, reason="stopped reading replies")

    def _drop(self, connection: Connection, reason: str | None) -> None:
        if connection not in self._connections:
            return
        self._connections.discard(connection)
        try:
            self._selector.unregister(connection.sock)
        except (KeyError, ValueError):
            pass
        connection.sock.close()
        if reason:
            logger.info("KV control server: %s %s", connection, reason)
        self._on_disconnect(connection)
