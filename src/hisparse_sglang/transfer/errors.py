"""Typed errors of the KV transfer layer.

Mooncake reports every failure as a negative integer (``error.h`` of its transfer engine);
:func:`error_for_code` is the one place where those integers become exceptions. Nothing above
``transfer/`` checks integers.

Every error carries the peer (a Mooncake session id ``host:port`` or a control address) and the
request it concerns, when known; its message names the operation, the value and the fix.

What each error means for the user:

* :class:`TransferEngineUnavailableError`: Mooncake is missing or cannot start here; install it.
* :class:`TransferSetupError`: registering memory (or an engine argument) failed; nothing moved.
* :class:`PeerUnreachableError`: the other instance is gone or the address is wrong; retry elsewhere.
* :class:`TransferTimeoutError`: a deadline passed; the destination rows are dirty, late writes may land.
* :class:`RemoteAddressRejectedError`: the decode refused a destination outside its registered memory.
* :class:`RequestRejectedError` (:class:`LayoutMismatchError`): the decode refused the request
  before anything was written or allocated (too long, no room, wrong shape).
* :class:`SessionMismatchError`: the Mooncake session is not the decode that granted the pages.
* :class:`ControlProtocolError`: a control message is malformed or of another protocol version.
* :class:`SenderLostError`: (decode side) the prefill writer disconnected before reporting done.
* :class:`TransferAbortedError`: one side aborted the request on purpose.
"""

from __future__ import annotations

from hisparse_sglang.errors import HiSparseError

__all__ = [
    "TransferError",
    "TransferEngineUnavailableError",
    "TransferSetupError",
    "PeerUnreachableError",
    "TransferTimeoutError",
    "RemoteAddressRejectedError",
    "RequestRejectedError",
    "LayoutMismatchError",
    "SessionMismatchError",
    "ControlProtocolError",
    "SenderLostError",
    "TransferAbortedError",
    "MOONCAKE_INSTALL_FIX",
    "MOONCAKE_ERROR_NAMES",
    "error_for_code",
    "write_failure",
    "error_to_wire",
    "error_from_wire",
]

MOONCAKE_INSTALL_FIX = (
    "pip install 'hisparse-sglang[mooncake]' (CPU: mooncake-transfer-engine-non-cuda, needs the Debian package "
    "libibverbs1: `apt-get install -y --no-install-recommends libibverbs1`; GPU servers: "
    "mooncake-transfer-engine)"
)

# The codes of Mooncake's transfer-engine error.h (0.3.13).
MOONCAKE_ERROR_NAMES = {
    -1: "ERR_INVALID_ARGUMENT",
    -2: "ERR_TOO_MANY_REQUESTS",
    -3: "ERR_ADDRESS_NOT_REGISTERED",
    -4: "ERR_BATCH_BUSY",
    -6: "ERR_DEVICE_NOT_FOUND",
    -7: "ERR_ADDRESS_OVERLAPPED",
    -8: "ERR_NOT_LOCAL_SEGMENT_OR_SHM",
    -101: "ERR_DNS",
    -102: "ERR_SOCKET",
    -103: "ERR_MALFORMED_JSON",
    -104: "ERR_REJECT_HANDSHAKE",
    -200: "ERR_METADATA",
    -201: "ERR_ENDPOINT",
    -202: "ERR_CONTEXT",
    -300: "ERR_NUMA",
    -301: "ERR_CLOCK",
    -302: "ERR_MEMORY",
    -303: "ERR_NOT_IMPLEMENTED",
}

# Operations on this process's own memory: an unregistered address there is a setup mistake.
_LOCAL_OPERATIONS = ("register_memory", "unregister_memory")


class TransferError(HiSparseError, RuntimeError):
    """A KV transfer between a prefill and a decode instance failed (also: a generic Mooncake failure).

    Attributes:
        peer: the other side (Mooncake session id or control address), if known.
        request_id: the request concerned, if any.
        code: the Mooncake return code, if the error came from one.
    """

    def __init__(
        self, message: str, *, peer: str | None = None, request_id: str | None = None, code: int | None = None
    ) -> None:
        super().__init__(message)
        self.peer = peer
        self.request_id = request_id
        self.code = code


class TransferEngineUnavailableError(TransferError):
    """Mooncake is not installed, does not import (missing system library) or cannot initialise."""


class TransferSetupError(TransferError):
    """Registering or unregistering memory, or configuring an engine, failed."""


class PeerUnreachableError(TransferError):
    """The other instance cannot be reached: it exited, or the address / session id is wrong."""


class TransferTimeoutError(TransferError):
    """A transfer or a control reply did not finish within its deadline; late writes may still land."""


class RemoteAddressRejectedError(TransferError):
    """The decode refused a write: a destination lies outside the memory it registered."""


class RequestRejectedError(TransferError):
    """The decode refused a request before allocating or receiving anything (size, room, duplicate id)."""


class LayoutMismatchError(RequestRejectedError):
    """The two sides disagree on the KV layout (layer count, row bytes, page size)."""


class SessionMismatchError(TransferError):
    """The Mooncake session, or the decode instance, is not the one that granted the pages."""


class ControlProtocolError(TransferError):
    """A control message is malformed, of an unknown type, or of an unsupported protocol version."""


class SenderLostError(TransferError):
    """(Decode side) the prefill writer disconnected before it reported the request done."""


class TransferAbortedError(TransferError):
    """A request was aborted on purpose (by the decode scheduler or by the prefill writer)."""


_WIRE_TYPES: dict[str, type[TransferError]] = {
    cls.__name__: cls
    for cls in (
        TransferError,
        TransferEngineUnavailableError,
        TransferSetupError,
        PeerUnreachableError,
        TransferTimeoutError,
        RemoteAddressRejectedError,
        RequestRejectedError,
        LayoutMismatchError,
        SessionMismatchError,
        ControlProtocolError,
        SenderLostError,
        TransferAbortedError,
    )
}

_ENGINE_FIXES = {
    -6: "no such RDMA device: check the device name against `ibv_devices`, or use protocol 'tcp'",
    -200: "metadata setup failed: use metadata server 'P2PHANDSHAKE', or check the metadata server address",
    -202: "the RDMA context could not be created: check the device, its driver and `ulimit -l`",
    -300: "NUMA binding failed: install libnuma1 and check the NUMA topology",
    -301: "the clock is unusable on this host",
    -302: "out of memory inside the transfer engine: free host memory or shrink the pool",
    -303: "this Mooncake build does not implement the operation: install a build with the protocol",
}


def _where(operation: str, peer: str | None, request_id: str | None) -> str:
    text = operation
    if request_id is not None:
        text += f" of request {request_id!r}"
    if peer is not None:
        text += f" with peer {peer}"
    return text


def _class_and_fix(code: int, operation: str) -> tuple[type[TransferError], str]:
    if code in (-101, -102, -201):
        return PeerUnreachableError, (
            "the peer process has exited, or the session id is wrong; check that the decode instance is running and "
            "that the session id is the one it published (host:rpc_port with an IP address, not a DNS name)"
        )
    if code in (-103, -104):
        return SessionMismatchError, (
            "the peer answered the handshake but refused it: the session id points at another service, or at a "
            "Mooncake of another version or protocol (tcp vs rdma); use the session id the decode published and "
            "the same Mooncake version on both sides"
        )
    if code == -3 and operation not in _LOCAL_OPERATIONS:
        return RemoteAddressRejectedError, (
            "the destination is not inside memory the peer registered; write only to pages the decode granted, "
            "at its published layer base addresses"
        )
    if code in (-3, -7, -8):
        return TransferSetupError, {
            -3: "the address was never registered (or was unregistered already); register the region first",
            -7: "the range overlaps a region registered already; register each region once",
            -8: "the segment is not local; register memory only with the engine that owns it",
        }[code]
    if code in _ENGINE_FIXES:
        return TransferEngineUnavailableError, _ENGINE_FIXES[code]
    if code in (-2, -4):
        return TransferError, (
            "too many transfers are queued for this peer: lower max_batch_entries (<= 1024 per batch) or raise "
            "MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER"
        )
    return TransferError, (
        "Mooncake rejected the call (invalid argument, unreachable peer, refused write or timeout); its log on "
        "stderr says which (set MC_LOG_LEVEL=INFO for details)"
    )


def error_for_code(
    code: int,
    *,
    operation: str,
    peer: str | None = None,
    request_id: str | None = None,
    detail: str = "",
) -> TransferError:
    """The typed error for a negative Mooncake return code.

    Args:
        code: what the Mooncake call returned (negative).
        operation: what was being done: ``"write"``, ``"register_memory"``, ``"unregister_memory"``,
            ``"probe"``, ...; decides whether -3 (address not registered) is a local setup
            mistake or a destination the peer refused.
        peer: the Mooncake session id of the other side, if any.
        request_id: the request concerned, if any.
        detail: extra context appended to the message (sizes, addresses).

    Returns:
        An instance of the matching :class:`TransferError` subclass (not raised).
    """
    cls, fix = _class_and_fix(code, operation)
    name = MOONCAKE_ERROR_NAMES.get(code, "unknown code")
    message = f"{_where(operation, peer, request_id)} failed: Mooncake returned {code} ({name}). Fix: {fix}."
    if detail:
        message += f" ({detail})"
    return cls(message, peer=peer, request_id=request_id, code=code)


def write_failure(
    code: int,
    *,
    where: str,
    peer: str,
    request_id: str | None,
    timed_out: bool,
    mooncake_timeout_s: float,
    probe: int | None,
    destination: tuple[int, int],
) -> TransferError:
    """The typed error of a write batch Mooncake failed (it reports every such failure as -1).

    Args:
        code: what Mooncake returned for the batch.
        where: which batch of which request failed, and how far the write got.
        timed_out: the batch failed after about ``MC_TRANSFER_TIMEOUT``.
        mooncake_timeout_s: that timeout, in seconds.
        probe: what a bounded probe of the peer returned afterwards (None: no answer in time;
            unused when ``timed_out``).
        destination: ``(address, length)`` of the batch's first entry in the peer.
    """
    context = {"peer": peer, "request_id": request_id, "code": code}
    if timed_out:
        return TransferTimeoutError(
            f"{where} The peer did not acknowledge within MC_TRANSFER_TIMEOUT={mooncake_timeout_s:.0f} s: it is "
            f"stopped, overloaded or the link is down; late writes may still land. Fix: check the decode process; "
            f"raise MC_TRANSFER_TIMEOUT for slow links.",
            **context,
        )
    if probe is None:
        return PeerUnreachableError(
            f"{where} The peer does not answer a probe either: it is stopped or hung. Fix: check the decode process.",
            **context,
        )
    if probe != 0:
        return error_for_code(probe, operation="write", peer=peer, request_id=request_id, detail=where)
    return RemoteAddressRejectedError(
        f"{where} The peer is alive, so it refused the write: a destination (first entry of the batch "
        f"{destination[0]:#x}, {destination[1]} bytes) lies outside its registered memory, or it unregistered its "
        f"regions. Fix: write only to pages the decode granted, at its layout's base addresses.",
        **context,
    )


def error_to_wire(error: BaseException) -> dict[str, str]:
    """A JSON-serialisable ``{"type", "message"}`` form of an error, for the control channel."""
    kind = type(error).__name__ if isinstance(error, TransferError) else "TransferError"
    return {"type": kind, "message": str(error)}


def error_from_wire(
    payload: object, *, peer: str | None = None, request_id: str | None = None, prefix: str = ""
) -> TransferError:
    """Rebuild a typed error received over the control channel (an unknown type becomes :class:`TransferError`)."""
    if not isinstance(payload, dict) or not isinstance(payload.get("message"), str):
        return ControlProtocolError(
            f"peer {peer} sent a malformed error object {payload!r} for request {request_id!r}; run the same "
            f"hisparse-sglang version on both instances.",
            peer=peer,
            request_id=request_id,
        )
    cls = _WIRE_TYPES.get(str(payload.get("type")), TransferError)
    return cls(prefix + payload["message"], peer=peer, request_id=request_id)
