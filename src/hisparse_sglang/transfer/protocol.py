"""The control-plane messages between a prefill writer and a decode receiver, validated on receipt.

The data plane is Mooncake (RDMA or TCP writes straight into the decode's host KV pool); this is
what travels beside it, one framed JSON message at a time (``control.py`` frames them). Every
message has a type and a body; the reply echoes the request's sequence number. The prefill sends,
the decode replies:

* ``hello {}`` -> ``layout`` :class:`DecodeLayout`;
* ``request`` :class:`TransferRequest` -> ``grant`` :class:`TransferGrant` or ``reject`` :class:`Reject`;
* ``done`` :class:`TransferDone` -> ``ack`` :class:`Ack` (the request is complete) or ``reject``;
* ``abort`` :class:`TransferAbort` -> ``ack`` or ``reject``.

Addressing: row ``r`` of layer ``l`` of the decode pool lives at ``layer_bases[l] + r * row_bytes``
in the decode process; token ``t`` of a request goes to row ``page_ids[t // P] * P + t % P``.

Every body is checked field by field when it arrives: a missing or mistyped field raises
:class:`ControlProtocolError` naming the field; a layout the sender cannot write raises
:class:`LayoutMismatchError`; a grant outside the layout raises :class:`RemoteAddressRejectedError`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

from hisparse_sglang.transfer.errors import (
    ControlProtocolError,
    LayoutMismatchError,
    RemoteAddressRejectedError,
    SessionMismatchError,
    TransferError,
    error_from_wire,
    error_to_wire,
)

__all__ = [
    "PROTOCOL_VERSION",
    "MAX_REQUEST_ID_CHARS",
    "MESSAGE_TYPES",
    "PagedRegions",
    "DecodeLayout",
    "TransferRequest",
    "TransferGrant",
    "TransferDone",
    "TransferAbort",
    "Ack",
    "Reject",
    "pages_for_tokens",
]

PROTOCOL_VERSION = 1
MAX_REQUEST_ID_CHARS = 512
MESSAGE_TYPES = ("hello", "layout", "request", "grant", "reject", "done", "ack", "abort")


def pages_for_tokens(num_tokens: int, page_size: int) -> int:
    return math.ceil(num_tokens / page_size)


def _field(body: dict, key: str, kind: type, what: str) -> Any:
    if key not in body:
        raise ControlProtocolError(f"{what} lacks the field {key!r} (got fields {sorted(body)}).")
    value = body[key]
    # bool is an int subclass: a JSON true must not pass for a count.
    if (isinstance(value, bool) and kind is not bool) or not isinstance(value, kind):
        raise ControlProtocolError(f"{what} field {key!r} must be of type {kind.__name__}, got {value!r}.")
    return value


def _positive(body: dict, key: str, what: str) -> int:
    value = _field(body, key, int, what)
    if value < 1:
        raise ControlProtocolError(f"{what} field {key!r} must be >= 1, got {value}.")
    return value


def _int_list(body: dict, key: str, what: str) -> tuple[int, ...]:
    values = _field(body, key, list, what)
    for index, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ControlProtocolError(f"{what} field {key!r}[{index}] must be an integer, got {value!r}.")
    return tuple(values)


def _request_id(body: dict, what: str) -> str:
    value = _field(body, "request_id", str, what)
    if not value or len(value) > MAX_REQUEST_ID_CHARS:
        raise ControlProtocolError(
            f"{what} field 'request_id' must have 1 to {MAX_REQUEST_ID_CHARS} characters, got {len(value)}."
        )
    return value


def _body(document: object, what: str) -> dict:
    if not isinstance(document, dict):
        raise ControlProtocolError(f"{what} must be a JSON object, got {type(document).__name__}.")
    return document


class _Message:
    """A message body: a frozen dataclass that turns into a JSON object and back (validated)."""

    TYPE: ClassVar[str]

    def to_dict(self) -> dict:
        body = dataclasses.asdict(self)
        return {key: list(value) if isinstance(value, tuple) else value for key, value in body.items()}


@dataclasses.dataclass(frozen=True)
class PagedRegions:
    """``len(layer_bases)`` regions (one per layer) of ``num_rows`` rows of ``row_bytes`` bytes, in pages.

    Row ``r`` of layer ``l`` is at ``layer_bases[l] + r * row_bytes``; page ``p`` holds rows
    ``[p * page_size, (p + 1) * page_size)`` of every layer.
    """

    layer_bases: tuple[int, ...]
    num_rows: int
    row_bytes: int
    page_size: int

    @property
    def layer_num(self) -> int:
        return len(self.layer_bases)

    @property
    def num_pages(self) -> int:
        return self.num_rows // self.page_size


@dataclasses.dataclass(frozen=True)
class DecodeLayout(PagedRegions, _Message):
    """The decode side's host KV pool as the prefill side must address it (the ``layout`` reply).

    Attributes:
        layer_bases: absolute address of row 0 of every layer region, in the decode process.
        num_rows: rows per layer region (whole pages; page 0 is never granted).
        row_bytes: bytes per row (1152 bf16 MLA, 656 fp8 DSA).
        page_size: rows per page.
        instance_id: random per receiver start; a grant of another instance is stale.
        session_id: Mooncake session id (``host:rpc_port``) that owns the regions.
        protocol: Mooncake protocol of the decode engine ("tcp" or "rdma").
        max_pages_per_request: the most pages one request may take.
    """

    TYPE: ClassVar[str] = "layout"
    instance_id: str
    session_id: str
    protocol: str
    max_pages_per_request: int

    @classmethod
    def from_dict(cls, document: object) -> DecodeLayout:
        what = "decode layout"
        body = _body(document, what)
        layout = cls(
            instance_id=_field(body, "instance_id", str, what),
            session_id=_field(body, "session_id", str, what),
            protocol=_field(body, "protocol", str, what),
            layer_bases=_int_list(body, "layer_bases", what),
            num_rows=_positive(body, "num_rows", what),
            row_bytes=_positive(body, "row_bytes", what),
            page_size=_positive(body, "page_size", what),
            max_pages_per_request=_positive(body, "max_pages_per_request", what),
        )
        if not layout.layer_bases or min(layout.layer_bases) <= 0:
            raise ControlProtocolError(
                f"{what} field 'layer_bases' needs one positive address per layer, got {list(layout.layer_bases)}."
            )
        if layout.num_rows < 2 * layout.page_size:
            raise ControlProtocolError(
                f"{what} field 'num_rows' ({layout.num_rows}) must hold at least 2 pages of {layout.page_size} "
                f"rows (page 0 is reserved)."
            )
        return layout

    def check_source(self, layer_num: int, row_bytes: int, page_size: int, request_id: str | None = None) -> None:
        """Raise :class:`LayoutMismatchError` unless a source of this shape can be written here."""
        problems = []
        if layer_num != self.layer_num:
            problems.append(f"layer count {layer_num} != {self.layer_num}")
        if row_bytes != self.row_bytes:
            problems.append(f"row bytes {row_bytes} != {self.row_bytes}")
        if page_size != self.page_size:
            problems.append(f"page size {page_size} != {self.page_size}")
        if problems:
            raise LayoutMismatchError(
                f"request {request_id!r}: the prefill KV layout does not match the decode instance "
                f"{self.session_id} ({'; '.join(problems)}). Fix: serve the same model with the same "
                f"--kv-cache-dtype on both instances (1152-byte rows for bf16, 656 for fp8) and page size "
                f"{self.page_size}.",
                peer=self.session_id,
                request_id=request_id,
            )


@dataclasses.dataclass(frozen=True)
class TransferRequest(_Message):
    """``request``: the prefill wants to send ``num_tokens`` rows of every layer of a request."""

    TYPE: ClassVar[str] = "request"
    request_id: str
    num_tokens: int
    layer_num: int
    row_bytes: int
    page_size: int

    @classmethod
    def from_dict(cls, document: object) -> TransferRequest:
        what = "transfer request"
        body = _body(document, what)
        return cls(
            request_id=_request_id(body, what),
            num_tokens=_positive(body, "num_tokens", what),
            layer_num=_positive(body, "layer_num", what),
            row_bytes=_positive(body, "row_bytes", what),
            page_size=_positive(body, "page_size", what),
        )


@dataclasses.dataclass(frozen=True)
class TransferGrant(_Message):
    """``grant``: the pages the decode reserved for a request, in token order.

    Attributes:
        instance_id, session_id: the receiver instance that owns the pages (see :class:`DecodeLayout`).
        num_tokens: rows per layer the prefill writes.
        page_ids: ``ceil(num_tokens / page_size)`` distinct page ids of the decode pool.
    """

    TYPE: ClassVar[str] = "grant"
    request_id: str
    instance_id: str
    session_id: str
    num_tokens: int
    page_ids: tuple[int, ...]

    @classmethod
    def from_dict(cls, document: object) -> TransferGrant:
        what = "transfer grant"
        body = _body(document, what)
        return cls(
            request_id=_request_id(body, what),
            instance_id=_field(body, "instance_id", str, what),
            session_id=_field(body, "session_id", str, what),
            num_tokens=_positive(body, "num_tokens", what),
            page_ids=_int_list(body, "page_ids", what),
        )

    def validate(self, layout: DecodeLayout) -> None:
        """Raise unless this grant fits ``layout``: same instance, the right page count, pages in range."""
        if self.instance_id != layout.instance_id or self.session_id != layout.session_id:
            raise SessionMismatchError(
                f"grant of request {self.request_id!r} comes from decode instance {self.instance_id} (session "
                f"{self.session_id}) but the layout in use is {layout.instance_id} (session {layout.session_id}); "
                f"the decode restarted or the connection is mixed up. Fix: reconnect and request again.",
                peer=self.session_id,
                request_id=self.request_id,
            )
        expected = pages_for_tokens(self.num_tokens, layout.page_size)
        if len(self.page_ids) != expected:
            raise ControlProtocolError(
                f"grant of request {self.request_id!r} field 'page_ids' has {len(self.page_ids)} pages for "
                f"{self.num_tokens} tokens; {expected} pages of {layout.page_size} expected.",
                peer=layout.session_id,
                request_id=self.request_id,
            )
        if min(self.page_ids) < 1 or max(self.page_ids) >= layout.num_pages:
            raise RemoteAddressRejectedError(
                f"grant of request {self.request_id!r} names pages {min(self.page_ids)}..{max(self.page_ids)} "
                f"outside the decode pool's pages [1, {layout.num_pages}); writing there would hit memory outside "
                f"its registered regions. Fix: run the same hisparse-sglang version on both instances.",
                peer=layout.session_id,
                request_id=self.request_id,
            )
        if len(set(self.page_ids)) != len(self.page_ids):
            raise ControlProtocolError(
                f"grant of request {self.request_id!r} field 'page_ids' repeats a page id.",
                peer=layout.session_id,
                request_id=self.request_id,
            )

    def rows(self, page_size: int) -> list[int]:
        """Destination row of every token, in token order."""
        return [self.page_ids[t // page_size] * page_size + t % page_size for t in range(self.num_tokens)]


@dataclasses.dataclass(frozen=True)
class TransferDone(_Message):
    """``done``: every row of the request was written (all synchronous writes returned).

    Attributes:
        instance_id: the decode instance the grant came from.
        bytes_written: ``num_tokens x layers x row_bytes``; the decode checks it.
    """

    TYPE: ClassVar[str] = "done"
    request_id: str
    instance_id: str
    bytes_written: int

    @classmethod
    def from_dict(cls, document: object) -> TransferDone:
        what = "done message"
        body = _body(document, what)
        bytes_written = _field(body, "bytes_written", int, what)
        if bytes_written < 0:
            raise ControlProtocolError(f"{what} field 'bytes_written' must be >= 0, got {bytes_written}.")
        return cls(_request_id(body, what), _field(body, "instance_id", str, what), bytes_written)


@dataclasses.dataclass(frozen=True)
class TransferAbort(_Message):
    """``abort``: the prefill gives up on a request; ``error`` is ``{"type", "message"}`` of why."""

    TYPE: ClassVar[str] = "abort"
    request_id: str
    error: dict

    @classmethod
    def from_error(cls, request_id: str, error: BaseException) -> TransferAbort:
        return cls(request_id, error_to_wire(error))

    @classmethod
    def from_dict(cls, document: object) -> TransferAbort:
        what = "abort message"
        body = _body(document, what)
        return cls(_request_id(body, what), _field(body, "error", dict, what))

    def to_error(self, peer: str | None = None) -> TransferError:
        return error_from_wire(self.error, peer=peer, request_id=self.request_id, prefix="prefill aborted: ")


@dataclasses.dataclass(frozen=True)
class Ack(_Message):
    """``ack``: the decode accepted a ``done`` (the request is complete) or an ``abort``."""

    TYPE: ClassVar[str] = "ack"
    request_id: str

    @classmethod
    def from_dict(cls, document: object) -> Ack:
        return cls(_request_id(_body(document, "ack"), "ack"))


@dataclasses.dataclass(frozen=True)
class Reject(_Message):
    """``reject``: the decode refused a message; ``error`` is ``{"type", "message"}`` (typed on receipt).

    ``request_id`` is None when the refused message named no valid request.
    """

    TYPE: ClassVar[str] = "reject"
    request_id: str | None
    error: dict

    @classmethod
    def from_error(cls, request_id: str | None, error: BaseException) -> Reject:
        return cls(request_id, error_to_wire(error))

    @classmethod
    def from_dict(cls, document: object) -> Reject:
        what = "reject message"
        body = _body(document, what)
        request_id = body.get("request_id")
        if request_id is not None and not isinstance(request_id, str):
            raise ControlProtocolError(f"{what} field 'request_id' must be a string or null, got {request_id!r}.")
        return cls(request_id, _field(body, "error", dict, what))

    def to_error(self, peer: str | None = None) -> TransferError:
        return error_from_wire(self.error, peer=peer, request_id=self.request_id, prefix="decode rejected: ")
