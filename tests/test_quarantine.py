"""RowQuarantine: per-request expectations, page-granular holds, exact accounting.

The property test drives a checked ``PagedAllocator`` (a page freed twice, or freed while not
allocated, raises) the way ``HiSparseTokenAllocator`` does: every free goes through ``intercept``,
what ``expired`` returns is freed. Requests fail with a random prefix of their locations expected
(the untransferred rows), are freed in random parts (a part may end mid-page: the next part then
frees the rest of that page, which only the quarantine makes legal), parts are freed at different
times, and the clock moves. A small independent model says which pages must be held until when.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hisparse_sglang.errors import HiSparseMemoryError
from hisparse_sglang.memory import PagedAllocator
from hisparse_sglang.memory.quarantine import RowQuarantine


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def page_rows(pages: list[int], page_size: int) -> torch.Tensor:
    return (torch.tensor(pages, dtype=torch.int64)[:, None] * page_size + torch.arange(page_size)).reshape(-1)


# ------------------------------------------------------------------------------------------ examples
def test_pages_of_expected_locations_are_held_until_the_deadline():
    clock = Clock()
    quarantine = RowQuarantine(10.0, page_size=64, clock=clock)
    quarantine.expect("failed", torch.arange(64, 100))
    freed_now = quarantine.intercept(torch.arange(0, 192))
    # page 1 holds expected locations: all of it stays, whatever else of it the free names
    assert torch.equal(freed_now, torch.cat([torch.arange(0, 64), torch.arange(128, 192)]))
    assert (quarantine.pages_held, quarantine.rows_held, quarantine.requests_expected) == (1, 64, 0)
    clock.now += 9.9
    assert quarantine.expired().numel() == 0
    clock.now += 0.1
    assert torch.equal(quarantine.expired(), torch.arange(64, 128))
    assert (quarantine.pages_held, quarantine.rows_held) == (0, 0)
    assert quarantine.expired().numel() == 0
    # the expectation ended with the free: the page's next owner frees it at once
    assert torch.equal(quarantine.intercept(torch.arange(64, 70)), torch.arange(64, 70))


def test_a_request_freed_in_two_parts_ends_its_expectation_and_each_page_is_released_once():
    clock = Clock()
    quarantine = RowQuarantine(5.0, page_size=64, clock=clock)
    quarantine.expect(3, torch.arange(0, 150))
    # the first part ends in the middle of page 1; the second frees the rest of page 1 and page 2
    assert quarantine.intercept(torch.arange(0, 100)).numel() == 0
    assert (quarantine.pages_held, quarantine.rows_held, quarantine.requests_expected) == (2, 100, 1)
    clock.now += 2.0
    assert quarantine.intercept(torch.arange(100, 150)).numel() == 0
    assert (quarantine.pages_held, quarantine.rows_held, quarantine.requests_expected) == (3, 150, 0)
    clock.now += 3.0  # page 0's hold is over; page 1 was freed again later, so its hold lasts longer
    assert torch.equal(quarantine.expired(), torch.arange(0, 64))
    clock.now += 2.0
    assert torch.equal(quarantine.expired(), torch.arange(64, 192))
    assert (quarantine.pages_held, quarantine.rows_held, quarantine.requests_expected) == (0, 0, 0)
    assert torch.equal(quarantine.intercept(torch.arange(0, 150)), torch.arange(0, 150))


def test_the_tail_of_a_held_page_freed_later_is_held_with_it():
    clock = Clock()
    quarantine = RowQuarantine(5.0, page_size=64, clock=clock)
    quarantine.expect("r", torch.arange(64, 100))  # the untransferred rows end mid-page
    assert quarantine.intercept(torch.arange(64, 100)).numel() == 0
    # the rest of the request (rows 100..149) is freed separately: page 1 must not be freed now
    assert torch.equal(quarantine.intercept(torch.arange(100, 150)), torch.arange(128, 150))
    assert (quarantine.pages_held, quarantine.rows_held) == (1, 64)
    clock.now += 5.0
    assert torch.equal(quarantine.expired(), torch.arange(64, 128))


def test_an_expectation_of_a_reused_request_key_replaces_the_old_one():
    quarantine = RowQuarantine(5.0, page_size=4)
    quarantine.expect(7, torch.arange(0, 8))
    quarantine.expect(7, torch.arange(16, 20))
    assert quarantine.requests_expected == 1
    assert torch.equal(quarantine.intercept(torch.arange(0, 8)), torch.arange(0, 8))
    assert quarantine.intercept(torch.arange(16, 20)).numel() == 0 and quarantine.requests_expected == 0


def test_a_quarantine_of_zero_seconds_holds_nothing():
    quarantine = RowQuarantine(0.0, page_size=4)
    quarantine.expect(1, torch.arange(8))
    assert quarantine.requests_expected == 0
    assert torch.equal(quarantine.intercept(torch.arange(8)), torch.arange(8))
    assert (quarantine.pages_held, quarantine.rows_held) == (0, 0)


def test_a_page_size_below_one_is_refused_with_the_value():
    with pytest.raises(HiSparseMemoryError, match=r"page_size \(0\) must be >= 1"):
        RowQuarantine(1.0, page_size=0)


# ------------------------------------------------------------------------------------------ property
@dataclasses.dataclass
class Request:
    locs: list[int]
    expected: set[int] = dataclasses.field(default_factory=set)
    batches: list[list[list[int]]] = dataclasses.field(default_factory=list)  # frees still to come
    freed: set[int] = dataclasses.field(default_factory=set)
    started_freeing: bool = False


class Harness:
    """The allocator, the quarantine, and a model of which pages must be held until when."""

    def __init__(self, page_size: int, num_pages: int, seconds: float) -> None:
        self.page_size = page_size
        self.seconds = seconds
        self.clock = Clock()
        self.allocator = PagedAllocator("host", num_pages, page_size, checked=True)
        self.quarantine = RowQuarantine(seconds, page_size, clock=self.clock)
        self.requests: dict[int, Request] = {}
        self.next_key = 0
        self.held_until: dict[int, float] = {}  # model: page -> deadline
        self.held_rows: dict[int, set[int]] = {}  # model: page -> freed locations on it

    # -------------------------------------------------------------- the allocator's paths
    def free(self, locs: list[int]) -> None:
        kept = self.quarantine.intercept(torch.tensor(locs, dtype=torch.int64))
        if kept.numel():
            self.allocator.free_locs(kept)

    def release(self) -> None:
        rows = self.quarantine.expired()
        released = sorted(set((rows // self.page_size).tolist()))
        due = sorted(page for page, deadline in self.held_until.items() if deadline <= self.clock.now)
        assert released == due, f"released pages {released}, due {due}"
        assert rows.numel() == len(released) * self.page_size, "a released page was returned twice"
        for page in due:
            del self.held_until[page], self.held_rows[page]
        if rows.numel():
            self.allocator.free_locs(rows)

    # -------------------------------------------------------------- operations
    def alloc(self, tokens: int) -> None:
        self.release()  # as alloc_extend does
        zero, length = torch.tensor([0]), torch.tensor([tokens])
        locs = self.allocator.alloc_extend(zero, length, torch.tensor([-1]))
        if locs is not None:
            self.requests[self.next_key] = Request(locs.tolist())
            self.next_key += 1

    def fail(self, index: int, expected_fraction: float) -> None:
        request = self._pick(index, lambda r: not r.started_freeing)
        if request is None:
            return
        key, request = request
        count = max(1, round(expected_fraction * len(request.locs)))
        request.expected = set(request.locs[:count])
        self.quarantine.expect(key, torch.tensor(request.locs[:count]))

    def start_free(self, index: int, cuts: list[int]) -> None:
        request = self._pick(index, lambda r: not r.started_freeing)
        if request is None:
            return
        key, request = request
        request.started_freeing = True
        request.batches = self._batches(request, cuts)
        self.free_next(key)

    def free_next(self, key: int) -> None:
        request = self.requests[key]
        for part in request.batches.pop(0):
            self._model_free(request, part)
            self.free(part)
        if not request.batches:
            del self.requests[key]

    def free_next_of(self, index: int) -> None:
        picked = self._pick(index, lambda r: r.started_freeing)
        if picked is not None:
            self.free_next(picked[0])

    def advance(self, seconds: float) -> None:
        self.clock.now += seconds
        self.release()

    # -------------------------------------------------------------- model
    def _batches(self, request: Request, cuts: list[int]) -> list[list[list[int]]]:
        """The request's locations in parts (at ``cuts``); parts meeting mid-page are freed in one
        go, each part with every location of the boundary page from its side. A mid-page cut is
        kept only where the quarantine holds that page (the page has an expected location);
        elsewhere it moves to the page's end, as SGLang's segment frees do."""
        n, page = len(request.locs), self.page_size
        bounds = []
        for cut in sorted(set(c for c in cuts if 0 < c < n)):
            boundary_page = request.locs[cut - cut % page : cut - cut % page + page]
            if cut % page and not (self.seconds > 0 and request.expected & set(boundary_page)):
                cut = min(n, cut - cut % page + page)
            if 0 < cut < n and (not bounds or cut > bounds[-1]):
                bounds.append(cut)
        edges = [0, *bounds, n]
        parts = [request.locs[a:b] for a, b in zip(edges, edges[1:])]
        batches = [[parts[0]]]
        for cut, part in zip(bounds, parts[1:]):
            if cut % page:
                batches[-1].append(part)  # shares a page with the part before: freed back to back
            else:
                batches.append([part])
        return batches

    def _model_free(self, request: Request, part: list[int]) -> None:
        request.freed.update(part)
        deadline = self.clock.now + self.seconds
        for loc in part:
            page = loc // self.page_size
            page_locs = set(range(page * self.page_size, (page + 1) * self.page_size))
            if page in self.held_until or (self.seconds > 0 and request.expected & page_locs):
                self.held_until[page] = max(self.held_until.get(page, deadline), deadline)
                self.held_rows.setdefault(page, set()).add(loc)

    def _pick(self, index: int, wanted):
        keys = [key for key, request in self.requests.items() if wanted(request)]
        if not keys:
            return None
        key = keys[index % len(keys)]
        return key, self.requests[key]

    # -------------------------------------------------------------- invariants
    def check(self) -> None:
        live = {
            loc // self.page_size
            for request in self.requests.values()
            for loc in request.locs
            if loc not in request.freed
        }
        held = set(self.held_until)
        assert not live & held, f"pages both in use and held: {sorted(live & held)}"
        assert self.allocator.used_pages == len(live | held), f"{self.allocator.used_pages} pages allocated, in use {sorted(live)}, held {sorted(held)}"
        assert self.quarantine.held_pages().tolist() == sorted(held) and self.quarantine.pages_held == len(held)
        assert self.quarantine.rows_held == sum(len(rows) for rows in self.held_rows.values())
        expecting = sum(
            1 for request in self.requests.values() if self.seconds > 0 and request.expected - request.freed
        )
        assert self.quarantine.requests_expected == expecting

    def drain(self) -> None:
        while self.requests:
            key = next(iter(self.requests))
            request = self.requests[key]
            if not request.started_freeing:
                request.started_freeing = True
                request.batches = self._batches(request, [])
            self.free_next(key)
            self.check()
        self.advance(self.seconds + 1.0)
        self.check()
        assert self.allocator.free_pages == self.allocator.capacity_pages, "pages leaked"
        assert (self.quarantine.pages_held, self.quarantine.rows_held, self.quarantine.requests_expected) == (0, 0, 0)


operation = st.one_of(
    st.tuples(st.just("alloc"), st.integers(1, 40)),
    st.tuples(st.just("fail"), st.integers(0, 9), st.floats(0.0, 1.0)),
    st.tuples(st.just("free"), st.integers(0, 9), st.lists(st.integers(1, 39), max_size=3)),
    st.tuples(st.just("free_next"), st.integers(0, 9)),
    st.tuples(st.just("advance"), st.sampled_from([0.5, 1.0, 2.0, 5.0])),
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    page_size=st.sampled_from([1, 2, 4, 8]),
    num_pages=st.integers(4, 24),
    seconds=st.sampled_from([0.0, 1.0, 3.0]),
    operations=st.lists(operation, max_size=40),
)
def test_random_failures_splits_and_expiry_leak_nothing_and_free_no_page_twice(page_size, num_pages, seconds, operations):
    harness = Harness(page_size, num_pages, seconds)
    for op, *args in operations:
        if op == "alloc":
            harness.alloc(*args)
        elif op == "fail":
            harness.fail(*args)
        elif op == "free":
            harness.start_free(*args)
        elif op == "free_next":
            harness.free_next_of(*args)
        else:
            harness.advance(*args)
        harness.check()
    harness.drain()
