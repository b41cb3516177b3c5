"""Decode-side bookkeeping of incoming requests: grants, deadlines, outcomes and the quarantine (no I/O).

Every page the ledger took from its :class:`~hisparse_sglang.transfer.pages.PageAllocator` is, at
any time, in exactly one place: held by an open or completed request, or quarantined. Pages go
back to the allocator when a completed request is released, or when a quarantine ends; a
completed request can instead be handed over to the caller (its pages then belong to the decode
scheduler, which frees them through the same allocator).

Why a quarantine: a failed transfer is not clean. Mooncake batches are not atomic, a writer killed
mid-request leaves part of its rows written, and after a timeout writes already in flight can
still land. Reusing those pages at once would let stale bytes of a dead request overwrite a new
request's KV. So the pages of a failed request are held back until

1. the writer is known to be *quiet*: its control connection closed (the process is gone), or it
   sent a message about that request after the failure (its writes have returned), or the
   request never had a writer (a decode-side preallocation nobody claimed); and then
2. ``quarantine_s`` seconds have passed since it became quiet, long enough for bytes still queued
   in sockets or in Mooncake's lanes to land (the receiver's default is the Mooncake transfer
   timeout + 5 s).

A writer that stays alive and silent (a stopped process) keeps its failed pages quarantined until
it exits or speaks: no time-only bound is safe, because a stopped writer may resume and write.
A completed request never passes through the quarantine: its writer reported completion after
its last write returned.
"""

from __future__ import annotations

import dataclasses
import enum
import math

from hisparse_sglang.transfer.errors import (
    RequestRejectedError,
    SenderLostError,
    TransferError,
    TransferTimeoutError,
)
from hisparse_sglang.transfer.pages import PageAllocator

__all__ = ["RequestStatus", "RequestRecord", "RequestLedger"]


class RequestStatus(str, enum.Enum):
    OPEN = "open"
    COMPLETED = "completed"
    FAILED = "failed"


@dataclasses.dataclass
class RequestRecord:
    """One request as the decode side sees it.

    Attributes:
        pages: granted page ids in token order (empty for a request rejected before a grant).
        owner: the writer (control connection) that claimed it, or None.
        deadline: ``time.monotonic()`` by which the writer must report it done.
        error: why it failed (``status == FAILED``).
    """

    request_id: str
    num_tokens: int
    pages: list[int]
    status: RequestStatus
    owner: object | None
    opened_at: float
    deadline: float
    error: TransferError | None = None
    finished_at: float | None = None


@dataclasses.dataclass
class _Quarantined:
    request_id: str
    pages: list[int]
    owner: object | None
    quiet_since: float | None


def _peer(owner: object | None) -> str | None:
    return None if owner is None else str(owner)


class RequestLedger:
    """Grants and outcomes of the requests a decode receiver serves.

    Args:
        allocator: where pages come from (see ``pages.py``).
        transfer_timeout_s: an open request fails with :class:`TransferTimeoutError` this long
            after its grant unless its writer reported it done.
        quarantine_s: see the module docstring.
        max_pages_per_request: requests needing more pages are rejected (default: every page).
    """

    def __init__(
        self,
        allocator: PageAllocator,
        *,
        transfer_timeout_s: float,
        quarantine_s: float,
        max_pages_per_request: int | None = None,
    ) -> None:
        self.allocator = allocator
        self.page_size = allocator.page_size
        self.transfer_timeout_s = transfer_timeout_s
        self.quarantine_s = quarantine_s
        capacity = allocator.num_pages - 1
        self.max_pages_per_request = capacity if max_pages_per_request is None else max_pages_per_request
        self.records: dict[str, RequestRecord] = {}
        self._quarantine: list[_Quarantined] = []
        self._finished: list[RequestRecord] = []

    # ------------------------------------------------------------------ accounting
    @property
    def quarantined_pages(self) -> int:
        return sum(len(entry.pages) for entry in self._quarantine)

    def held_pages(self) -> list[int]:
        """Every page the ledger holds: open and completed requests, and the quarantine."""
        live = [record for record in self.records.values() if record.status != RequestStatus.FAILED]
        held = [page for record in live for page in record.pages]
        return held + [page for entry in self._quarantine for page in entry.pages]

    def stats(self) -> dict[str, int]:
        pages = {status: 0 for status in RequestStatus}
        for record in self.records.values():
            pages[record.status] += len(record.pages)
        return {
            "free_pages": self.allocator.free_page_count,
            "open_pages": pages[RequestStatus.OPEN],
            "completed_pages": pages[RequestStatus.COMPLETED],
            "quarantined_pages": self.quarantined_pages,
            "open_requests": sum(r.status == RequestStatus.OPEN for r in self.records.values()),
        }

    def check_invariants(self, exclusive: bool = True) -> None:
        """Raise :class:`TransferError` if a page is held twice, out of range or (``exclusive``) lost.

        ``exclusive``: the ledger is the allocator's only user, so every page is free or held.
        """
        held = self.held_pages()
        if len(set(held)) != len(held):
            raise TransferError(f"ledger holds a page twice: {sorted(held)}.")
        if held and (min(held) < 1 or max(held) >= self.allocator.num_pages):
            raise TransferError(f"ledger holds a page outside [1, {self.allocator.num_pages}): {sorted(held)}.")
        capacity = self.allocator.num_pages - 1
        if exclusive and len(held) + self.allocator.free_page_count != capacity:
            raise TransferError(
                f"ledger lost pages: {len(held)} held + {self.allocator.free_page_count} free != {capacity} pages."
            )

    # ------------------------------------------------------------------ granting
    def open(self, request_id: str, num_tokens: int, owner: object | None, now: float) -> RequestRecord:
        """Grant pages to a request, or let ``owner`` claim a decode-side preallocation of it.

        Raises:
            RequestRejectedError: duplicate id, too many pages, or not enough free pages. A new
                request refused this way is recorded as failed (the decode sees why); nothing is taken.
        """
        existing = self.records.get(request_id)
        if existing is not None and existing.status == RequestStatus.FAILED and not existing.pages:
            del self.records[request_id]  # refused before a grant: a retry is a new request
            existing = None
        if existing is not None:
            return self._claim(existing, num_tokens, owner)
        pages_needed = math.ceil(num_tokens / self.page_size)
        problem = None
        if num_tokens < 1:
            problem = f"it has {num_tokens} tokens; send at least 1"
        elif pages_needed > self.max_pages_per_request:
            problem = (
                f"it needs {pages_needed} pages of {self.page_size} tokens ({num_tokens} tokens), more than the "
                f"{self.max_pages_per_request} one request may take. Fix: cap the context length, or give the decode "
                f"a larger host pool (host_to_device_ratio)"
            )
        else:
            pages = self.allocator.alloc_pages(pages_needed)
            if pages is None:
                problem = (
                    f"it needs {pages_needed} pages but only {self.allocator.free_page_count} are free "
                    f"({self.quarantined_pages} quarantined after failed transfers). Fix: retry later, or give the "
                    f"decode more host memory"
                )
        if problem is not None:
            error = RequestRejectedError(
                f"decode rejected request {request_id!r}: {problem}.", peer=_peer(owner), request_id=request_id
            )
            self.reject(request_id, num_tokens, error, owner, now)
            raise error
        deadline = now + self.transfer_timeout_s
        record = RequestRecord(request_id, num_tokens, pages, RequestStatus.OPEN, owner, now, deadline)
        self.records[request_id] = record
        return record

    def _claim(self, existing: RequestRecord, num_tokens: int, owner: object | None) -> RequestRecord:
        if existing.status == RequestStatus.OPEN and existing.owner is None and owner is not None:
            if existing.num_tokens != num_tokens:
                raise RequestRejectedError(
                    f"request {existing.request_id!r} was preallocated for {existing.num_tokens} tokens, the prefill "
                    f"wants to send {num_tokens}. Fix: send exactly the preallocated length.",
                    peer=_peer(owner),
                    request_id=existing.request_id,
                )
            existing.owner = owner
            return existing
        raise RequestRejectedError(
            f"request {existing.request_id!r} is already {existing.status.value} on this decode instance; request ids "
            f"must be unique until the decode releases them.",
            peer=_peer(owner),
            request_id=existing.request_id,
        )

    def reject(self, request_id: str, num_tokens: int, error: TransferError, owner: object | None, now: float) -> None:
        """Record a request refused before any page was taken (the decode sees why; a retry may reuse the id)."""
        existing = self.records.get(request_id)
        if existing is not None and not (existing.status == RequestStatus.FAILED and not existing.pages):
            return  # the id belongs to a live request; the refusal goes to the writer only
        record = RequestRecord(request_id, num_tokens, [], RequestStatus.FAILED, owner, now, now, error)
        self.records[request_id] = record
        self._finish(record, now)

    # ------------------------------------------------------------------ outcomes
    def complete(self, request_id: str, owner: object | None, now: float) -> RequestRecord:
        """Mark a request's rows written. Raises the typed error if it cannot complete."""
        record = self.records.get(request_id)
        if record is None:
            raise RequestRejectedError(
                f"done for unknown request {request_id!r}: it was never granted here, or was released already.",
                peer=_peer(owner),
                request_id=request_id,
            )
        if record.status == RequestStatus.FAILED:
            # The writer speaks about the request: its writes have returned, the rows can age out.
            self.writer_reported(request_id, owner, now)
            raise record.error
        if record.status == RequestStatus.COMPLETED or record.owner is not owner:
            raise RequestRejectedError(
                f"request {request_id!r} is {record.status.value} and owned by {record.owner}; {owner} cannot report "
                f"it done.",
                peer=_peer(owner),
                request_id=request_id,
            )
        record.status = RequestStatus.COMPLETED
        self._finish(record, now)
        return record

    def fail(self, request_id: str, error: TransferError, now: float, *, writer_quiet: bool) -> RequestRecord | None:
        """Fail an open request: its pages go to the quarantine. ``writer_quiet``: its writes have stopped.

        Failing a request that failed already only records the writer as quiet (if so). Returns the
        record, or None if the id is unknown or completed (nothing to do).
        """
        record = self.records.get(request_id)
        if record is None or record.status == RequestStatus.COMPLETED:
            return None
        if record.status == RequestStatus.FAILED:
            if writer_quiet:
                self.writer_reported(request_id, record.owner, now)
            return record
        record.status = RequestStatus.FAILED
        record.error = error
        quiet = writer_quiet or record.owner is None
        self._quarantine.append(_Quarantined(request_id, record.pages, record.owner, now if quiet else None))
        self._finish(record, now)
        return record

    def writer_reported(self, request_id: str, owner: object | None, now: float) -> None:
        for entry in self._quarantine:
            if entry.request_id == request_id and entry.owner is owner and entry.quiet_since is None:
                entry.quiet_since = now

    def owner_gone(self, owner: object, now: float) -> list[RequestRecord]:
        """The writer disconnected: fail its open requests; every page it could write is now quiet."""
        failed = []
        for record in list(self.records.values()):
            if record.status == RequestStatus.OPEN and record.owner is owner:
                error = SenderLostError(
                    f"{owner} disconnected before reporting request {record.request_id!r} done ({len(record.pages)} "
                    f"pages of {record.num_tokens} tokens): it exited or was killed. Part of the rows may have been "
                    f"written, so they are quarantined for {self.quarantine_s:.1f} s. Fix: run the prefill of this "
                    f"request again.",
                    peer=_peer(owner),
                    request_id=record.request_id,
                )
                failed.append(self.fail(record.request_id, error, now, writer_quiet=True))
        for entry in self._quarantine:
            if entry.owner is owner and entry.quiet_since is None:
                entry.quiet_since = now
        return failed

    def expire(self, now: float) -> list[RequestRecord]:
        """Fail every open request past its deadline with :class:`TransferTimeoutError`."""
        failed = []
        for record in list(self.records.values()):
            if record.status != RequestStatus.OPEN or now < record.deadline:
                continue
            who = "no prefill writer claimed it" if record.owner is None else f"{record.owner} did not report it done"
            error = TransferTimeoutError(
                f"request {record.request_id!r} timed out on the decode side after {self.transfer_timeout_s:.1f} s: "
                f"{who}. Its {len(record.pages)} pages are quarantined until the writer exits or speaks, plus "
                f"{self.quarantine_s:.1f} s, because late writes may still land. Fix: check that the prefill "
                f"instance is alive and not stopped; raise transfer_timeout_s for very long prompts.",
                peer=_peer(record.owner),
                request_id=record.request_id,
            )
            failed.append(self.fail(record.request_id, error, now, writer_quiet=False))
        return failed

    def release_quarantined(self, now: float) -> int:
        """Free the quarantined pages whose writer has been quiet for ``quarantine_s``; returns pages freed."""
        freed = 0
        keep = []
        for entry in self._quarantine:
            if entry.quiet_since is not None and now >= entry.quiet_since + self.quarantine_s:
                self.allocator.free_pages(entry.pages)
                freed += len(entry.pages)
            else:
                keep.append(entry)
        self._quarantine = keep
        return freed

    def force_release_quarantined(self) -> int:
        """Free every quarantined page now (an operator's call once the writers are known dead)."""
        freed = self.quarantined_pages
        for entry in self._quarantine:
            self.allocator.free_pages(entry.pages)
        self._quarantine = []
        return freed

    def release(self, request_id: str, *, free_pages: bool = True) -> RequestRecord:
        """Forget a finished request. A completed one's pages are freed, or with ``free_pages=False``
        handed over to the caller (who frees them through the allocator); a failed one's follow the quarantine.

        Raises:
            RequestRejectedError: the request is unknown or still open (abort it first).
        """
        record = self.records.get(request_id)
        if record is None or record.status == RequestStatus.OPEN:
            state = "unknown" if record is None else "still open (abort it first)"
            raise RequestRejectedError(f"cannot release request {request_id!r}: it is {state}.", request_id=request_id)
        del self.records[request_id]
        if record.status == RequestStatus.COMPLETED and free_pages:
            self.allocator.free_pages(record.pages)
        return record

    def take_finished(self) -> list[RequestRecord]:
        """Requests that completed or failed since the last call, in order."""
        finished, self._finished = self._finished, []
        return finished

    def _finish(self, record: RequestRecord, now: float) -> None:
        record.finished_at = now
        self._finished.append(record)
