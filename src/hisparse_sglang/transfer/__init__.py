"""Mooncake transfer engine boundary: the only package of hisparse_sglang that imports mooncake.

Importing it imports no mooncake: ``engine.py`` loads Mooncake when a :class:`TransferEngine` is
built. Modules, one job each:

* ``errors``: typed errors; Mooncake's integer return codes become exceptions here, once;
* ``protocol``: the control-plane messages (layout, request, grant, reject, done, ack, abort), validated;
* ``control``: the control channel (length-prefixed JSON over TCP), client and server;
* ``engine``: the Mooncake engine wrapper (merged runs, bounded batches, deadline, typed errors);
* ``runs``: the write entries of a request (source bytes -> decode rows) and their merging;
* ``pages``: where the decode gets host pages from (a private allocator or a ``KVAllocator``);
* ``ledger``: decode-side grants, deadlines, outcomes and the quarantine of failed requests (no I/O);
* ``receiver``: the decode side; ``sender``: the prefill side.

``docs/pd.md`` describes the design and how it relates to SGLang's own PD disaggregation.
"""

from __future__ import annotations

from hisparse_sglang.transfer.engine import TransferEngine, WriteStats
from hisparse_sglang.transfer.errors import (
    ControlProtocolError,
    LayoutMismatchError,
    PeerUnreachableError,
    RemoteAddressRejectedError,
    RequestRejectedError,
    SenderLostError,
    SessionMismatchError,
    TransferAbortedError,
    TransferEngineUnavailableError,
    TransferError,
    TransferSetupError,
    TransferTimeoutError,
)
from hisparse_sglang.transfer.pages import LogicalPages, OwnPages, PageAllocator
from hisparse_sglang.transfer.protocol import DecodeLayout, TransferGrant, TransferRequest
from hisparse_sglang.transfer.receiver import Receiver, TransferOutcome
from hisparse_sglang.transfer.runs import KVSource
from hisparse_sglang.transfer.sender import DecodeConnection, Sender

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
    "TransferEngine",
    "WriteStats",
    "DecodeLayout",
    "TransferRequest",
    "TransferGrant",
    "KVSource",
    "PageAllocator",
    "OwnPages",
    "LogicalPages",
    "Receiver",
    "TransferOutcome",
    "Sender",
    "DecodeConnection",
]
