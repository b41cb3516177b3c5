"""A simulated decode server that drives the coordinator the way SGLang does.

Used by the demo and by the lifecycle property tests. Every KV row the "model" writes carries its
identity (request uid, position, layer), so any row read back through the swap-in op can be
checked against the token it should hold.

Progress: a step with nothing to decode still lets time pass for the copies in flight (on the CPU
an event completes a number of steps after it was recorded, and a real copy completes while the
scheduler idles), a request with no output ends when its prefill is collected, and a request that
could not run even on an idle server is rejected (as SGLang rejects it) instead of waiting forever.
:meth:`SimulatedServer.run_until_idle` drives everything to its end and raises
:class:`SimulationStalled` if that takes longer than :meth:`SimulatedServer.progress_bound`.
"""

from __future__ import annotations

import collections
import dataclasses
import random

import torch

from hisparse_sglang.config import HiSparseConfig
from hisparse_sglang.coordinator import OFFLOADED, RESIDENT, Coordinator
from hisparse_sglang.errors import HiSparseMemoryError
from hisparse_sglang.memory.allocator import KVAllocator
from hisparse_sglang.memory.device_buffers import DeviceBufferPool
from hisparse_sglang.memory.host_pool import HostKVPool
from hisparse_sglang.ops import reference
from hisparse_sglang.streams import StreamSet

__all__ = ["SimulatedServer", "SimulationStalled", "StepReport", "token_rows"]

_WORD = 4


def token_rows(uid: int, positions: torch.Tensor, layer_id: int, item_bytes: int) -> torch.Tensor:
    """The KV bytes the simulated model writes for ``positions`` of request ``uid`` in a layer."""
    words = item_bytes // _WORD
    positions = positions.to(torch.int64).reshape(-1, 1)
    column = torch.arange(words, dtype=torch.int64).reshape(1, -1)
    values = (uid * 1_000_003 + positions * 7919 + layer_id * 104_729 + column * 31) % (2**31 - 1)
    values[:, 0] = uid
    values[:, 1] = positions[:, 0]
    if words > 2:
        values[:, 2] = layer_id
    return values.to(torch.int32).view(torch.uint8).reshape(-1, item_bytes)


@dataclasses.dataclass
class _SimRequest:
    uid: int
    slot: int
    seq_len: int  # tokens with KV
    target_len: int
    state: str  # "staging" or "decoding"
    selection: list[torch.Tensor]  # per-layer persistent top-k interest set


class SimulationStalled(AssertionError):
    """Admitted requests did not all end within the simulator's progress bound."""


@dataclasses.dataclass
class StepReport:
    batch_size: int
    resident: int
    offloaded: int
    lookups: int
    misses: int
    bytes_moved: int

    @property
    def hit_rate(self) -> float:
        return 1.0 - self.misses / self.lookups if self.lookups else 1.0


class SimulatedServer:
    """Prefill, decode, finish, abort and retract requests against a real :class:`Coordinator`.

    Args:
        config: HiSparse settings.
        layer_num: layers of the simulated model.
        item_bytes: bytes per KV row (multiple of 16).
        device_pages: device KV pool pages (page 0 included).
        max_reqs: request slots.
        max_context: context capacity per slot.
        seed: drives the top-k selection.
        drift: share of a layer's selection replaced each step (the rest repeats: locality).
        cpu_event_delay_steps: steps before a CPU copy reports completion (exercises in-flight states).
        verify: check every returned row against the token it must hold.
        ops: the op module (reference by default).
        device: where the device pools and tables live.
        checked: verify every free against an ownership table (a host sync per call on a GPU).
        host_pool: the host pool (default: a private one); a shared one makes this server one TP
            rank of several (testing/tp_ranks.py), which then also pass:
        agree, rank_check: as :class:`Coordinator`.
        collective: called where a TP model's forward has a collective: after each layer's swap-in
            and at the end of a prefill (the ranks' forwards advance in lockstep through them).
    """

    def __init__(
        self,
        config: HiSparseConfig,
        layer_num: int = 2,
        item_bytes: int = 64,
        device_pages: int = 64,
        max_reqs: int = 8,
        max_context: int = 4096,
        seed: int = 0,
        drift: float = 0.2,
        cpu_event_delay_steps: int = 0,
        verify: bool = True,
        ops=reference,
        device: str = "cpu",
        checked: bool = True,
        host_pool: HostKVPool | None = None,
        agree=None,
        rank_check=None,
        collective=None,
    ) -> None:
        self.config = config
        self.layer_num = layer_num
        self.item_bytes = item_bytes
        self.page_size = config.page_size
        self.max_context = max_context
        self.drift = drift
        self.verify = verify
        self.rng = random.Random(seed)
        self.torch_rng = torch.Generator().manual_seed(seed)
        host_pages = device_pages * config.host_to_device_ratio
        # checked: every free is verified against an ownership table (a host sync per call on a GPU);
        # benchmarks of the decode step's host time turn it off.
        self.allocator = KVAllocator(host_pages, device_pages, config.page_size, device, checked=checked)
        num_buffers = (device_pages - 1) * config.page_size // config.padded_buffer_size
        self.buffers = DeviceBufferPool(
            layer_num, max_reqs, max(num_buffers, 1), config.device_buffer_size, config.page_size, max_context, device
        )
        self.device = torch.device(device)
        if host_pool is None:
            host_pool = HostKVPool(layer_num, host_pages * config.page_size, item_bytes, pin=self.device.type == "cuda")
        self.host_pool = host_pool
        self.collective = collective or (lambda: None)
        self.device_layers = [
            torch.zeros((device_pages * config.page_size, item_bytes), dtype=torch.uint8, device=device)
            for _ in range(layer_num)
        ]
        self.req_to_token = torch.zeros((max_reqs, max_context), dtype=torch.int32, device=device)
        self.streams = StreamSet(torch.device(device), cpu_event_delay_steps=cpu_event_delay_steps)
        self.coordinator = Coordinator(
            config,
            self.allocator,
            self.buffers,
            self.host_pool,
            self.device_layers,
            self.req_to_token,
            ops=ops,
            streams=self.streams,
            agree=agree,
            rank_check=rank_check,
            ranks_share_host_pool=host_pool.shared,  # the simulated ranks run on one node
        )
        self.max_reqs = max_reqs
        self.free_slots = list(range(max_reqs - 1, -1, -1))
        self.requests: dict[int, _SimRequest] = {}
        self.finished: list[int] = []
        self.aborted: list[int] = []
        # Requests that could not run even on an idle server, with why: "too large" when submitted,
        # "outgrew the GPU pool" when retracted with more tokens than an idle server can prefill.
        self.rejected: dict[int, str] = {}
        self.admitted: set[int] = set()
        self.retracted: list[tuple[int, int, int]] = []
        self.waiting: collections.deque[tuple[int, int, int]] = collections.deque()  # uid, prompt, output
        self.last_rows: list[torch.Tensor] = []  # swap-in output of each layer in the last step
        self._next_uid = 1

    # ------------------------------------------------------------------ scheduler-facing
    def fits_when_idle(self, prompt_len: int, output_len: int) -> bool:
        """Whether the request could run on an otherwise idle server: its prefill on the GPU, its
        whole length in the host pool and the context of a request slot."""
        pages = self.allocator.device_rows.capacity_pages
        return (
            1 <= prompt_len
            and prompt_len + output_len <= self.max_context
            and -(-prompt_len // self.page_size) <= pages
            and -(-(prompt_len + output_len) // self.page_size) <= self.allocator.logical.capacity_pages
        )

    def submit(self, prompt_len: int, output_len: int) -> int:
        """Queue a request (admitted by :meth:`admit_waiting`); returns its uid. A request that could
        not run even on an idle server is rejected at once (listed in ``rejected``)."""
        uid = self._next_uid
        self._next_uid += 1
        if self.fits_when_idle(prompt_len, output_len):
            self.waiting.append((uid, prompt_len, output_len))
        else:
            self.rejected[uid] = "too large"
        return uid

    def admit_waiting(self) -> None:
        """Admit queued requests in order while they fit now (the first that does not waits)."""
        while self.waiting:
            uid, prompt_len, output_len = self.waiting[0]
            if self.add_request(prompt_len, output_len, uid=uid) is None:
                return
            self.waiting.popleft()

    def add_request(self, prompt_len: int, output_len: int, uid: int | None = None) -> int | None:
        """Prefill a request (two chunks when long); None if slots or memory are short."""
        if prompt_len < 1 or prompt_len + output_len > self.max_context:
            raise ValueError(f"prompt_len {prompt_len} + output_len {output_len} exceeds max_context {self.max_context}.")
        if not self.free_slots:
            return None
        total_pages = -(-(prompt_len + output_len) // self.page_size)
        prompt_pages = -(-prompt_len // self.page_size)
        if self.allocator.logical.free_pages < total_pages:
            return None
        device_ok = self.allocator.device_rows.free_pages + self.coordinator.reclaimable_pages() >= prompt_pages
        if not device_ok or not self.coordinator.reclaim(prompt_pages):
            return None
        if uid is None:
            uid = self._next_uid
            self._next_uid += 1
        slot = self.free_slots.pop()
        # Two chunks split off a page boundary (any page size, page size 1 included).
        chunks = [prompt_len] if prompt_len <= 2 * self.page_size else [min(prompt_len // 2 + 3, prompt_len - 1), prompt_len]
        start = 0
        for end in chunks:
            last_loc = (
                self.req_to_token[slot, start - 1 : start].to(torch.int64)
                if start
                else torch.tensor([-1], device=self.device)
            )
            locs = self.allocator.alloc_extend(torch.tensor([start]), torch.tensor([end]), last_loc)
            if locs is None:
                raise HiSparseMemoryError("simulated prefill could not allocate after reclaim.")
            self.req_to_token[slot, start:end] = locs.to(torch.int32)
            self._write_kv(uid, slot, torch.arange(start, end))
            start = end
        self.collective()  # the prefill forward's last collective: every rank has written its KV
        self.coordinator.admit_prefilled(slot, prompt_len)
        self.requests[uid] = _SimRequest(
            uid, slot, prompt_len, prompt_len + output_len, "staging", [self._initial_selection(prompt_len) for _ in range(self.layer_num)]
        )
        self.admitted.add(uid)
        return uid

    def step(self) -> StepReport:
        """One scheduler iteration: collect staged requests, decode one token for every request."""
        for slot in self.coordinator.collect_ready():
            request = self._by_slot(slot)
            request.state = "decoding"
            if request.seq_len >= request.target_len:  # no output to decode: done after its prefill
                self.finish(request.uid)
        batch = [r for r in self.requests.values() if r.state == "decoding"]
        batch.sort(key=lambda r: r.slot)
        lookups_before, misses_before = self.coordinator.swap_counters.tolist()
        if not batch:
            return self._idle(lookups_before, misses_before)

        # Like SGLang's check_decode_mem: retract the longest request while memory for the new
        # tokens is short (logical pages for every request, device pages for resident ones).
        while batch and (
            sum((r.seq_len % self.page_size) == 0 for r in batch) > self.allocator.logical.free_pages
            or not self.coordinator.can_decode([r.slot for r in batch])
        ):
            victim = max(batch, key=lambda r: r.seq_len)
            self.retract(victim.uid)
            batch.remove(victim)
        if not batch:
            return self._idle(lookups_before, misses_before)
        seq_lens = torch.tensor([r.seq_len + 1 for r in batch], dtype=torch.int64)
        slots = torch.tensor([r.slot for r in batch], dtype=torch.int64)
        slots = slots.to(self.device)
        last_loc = self.req_to_token[slots, (seq_lens - 2).to(self.device)].to(torch.int64)
        new_locs = self.allocator.alloc_decode(seq_lens, last_loc)
        self.req_to_token[slots, (seq_lens - 1).to(self.device)] = new_locs.to(torch.int32)
        self.coordinator.prepare_decode([r.slot for r in batch], seq_lens.tolist(), new_locs)

        # The forward pass: write the new token's KV, then per layer select top-k and swap in.
        self.coordinator.wait_for_pending_backup()
        for r in batch:
            r.seq_len += 1
            self._write_kv(r.uid, r.slot, torch.tensor([r.seq_len - 1]))
        self.coordinator.num_real_reqs.fill_(len(batch))
        self.last_rows = []
        for layer_id in range(self.layer_num):
            top_k = torch.stack([self._select(r, layer_id) for r in batch]).to(torch.int32)
            rows = self.coordinator.swap_in(slots, seq_lens.to(self.device), top_k.to(self.device), layer_id)
            self.collective()  # the layer's all-reduce, after its attention
            self.last_rows.append(rows.cpu().clone())
            if self.verify:
                self._verify_rows(batch, top_k, rows.cpu(), layer_id)

        for r in list(batch):
            if r.seq_len >= r.target_len:
                self.finish(r.uid)
        return self._report(len(batch), lookups_before, misses_before)

    def finish(self, uid: int) -> None:
        request = self.requests.pop(uid)
        self._release(request)
        self.finished.append(uid)

    def abort(self, uid: int) -> None:
        self._release(self.requests.pop(uid))
        self.aborted.append(uid)

    def retract(self, uid: int) -> None:
        """Give a request's memory back; it comes back later as a longer prefill of the same tokens."""
        request = self.requests.pop(uid)
        self._release(request)
        self.retracted.append((uid, request.seq_len, request.target_len - request.seq_len))

    def readmit_retracted(self) -> None:
        """Prefill retracted requests again (their KV is recomputed from the same tokens). One whose
        prompt has grown past what an idle server could prefill is rejected (SGLang aborts it)."""
        kept = []
        for uid, prompt_len, output_len in self.retracted:
            if not self.fits_when_idle(prompt_len, output_len):
                self.rejected[uid] = "outgrew the GPU pool"
            elif self.add_request(prompt_len, output_len, uid=uid) is None:
                kept.append((uid, prompt_len, output_len))
        self.retracted = kept

    # ------------------------------------------------------------------ progress
    def progress_bound(self) -> int:
        """Steps of :meth:`run_until_idle` within which every request now live, retracted or waiting
        must end when nothing else arrives.

        Each step decodes a token of some request (tokens are never lost: a retracted request comes
        back with them as its prompt) or is idle; an idle run lasts at most ``cpu_event_delay_steps``
        + 2 steps (a staged request is ready that many steps after its prefill; a retracted or
        waiting one is prefilled the step after the server empties). Hence (tokens to decode +
        2 x requests + 1) x (delay + 3).
        """
        tokens = sum(r.target_len - r.seq_len for r in self.requests.values())
        tokens += sum(output for _, _, output in self.retracted) + sum(output for _, _, output in self.waiting)
        count = len(self.requests) + len(self.retracted) + len(self.waiting)
        return (tokens + 2 * count + 1) * (self.streams.cpu_event_delay_steps + 3)

    def run_until_idle(self, check=None, max_steps: int | None = None) -> int:
        """Step (readmitting retracted and admitting waiting requests) until no request is left;
        returns the steps taken. ``check`` runs after every step (e.g. check_invariants).

        Raises:
            SimulationStalled: more than ``max_steps`` (default :meth:`progress_bound`) steps; the
                message lists what is left.
        """
        bound = self.progress_bound() if max_steps is None else max_steps
        steps = 0
        while self.requests or self.retracted or self.waiting:
            if steps == bound:
                left = ", ".join(
                    f"uid {r.uid} {r.state} {r.seq_len}/{r.target_len}" for r in list(self.requests.values())[:8]
                )
                raise SimulationStalled(
                    f"requests did not end within {bound} steps: live [{left}], retracted {self.retracted[:8]}, "
                    f"waiting {list(self.waiting)[:8]}, coordinator pending {self.coordinator.pending[:8]}"
                )
            self.readmit_retracted()
            self.admit_waiting()
            self.step()
            steps += 1
            if check is not None:
                check()
        return steps

    def check_every_admitted_request_ended(self) -> None:
        """Every request admitted so far finished, was aborted or was rejected (none is lost)."""
        ended = set(self.finished) | set(self.aborted) | set(self.rejected)
        live = set(self.requests) | {uid for uid, _, _ in self.retracted}
        lost = self.admitted - ended - live
        assert not lost, f"admitted requests neither ended nor live: {sorted(lost)[:8]}"

    # ------------------------------------------------------------------ checks
    def check_invariants(self) -> None:
        """Raise AssertionError if any ownership or content invariant is broken."""
        coordinator = self.coordinator
        page = self.page_size
        owned_rows: list[torch.Tensor] = []
        logical_pages = 0
        for request in self.requests.values():
            record = coordinator.requests[request.slot]
            assert record.seq_len == request.seq_len, (record.seq_len, request.seq_len)
            locs = self.req_to_token[request.slot, : request.seq_len].to(torch.int64)
            assert torch.unique(locs).numel() == locs.numel(), "a logical location is used twice by one request"
            logical_pages += -(-request.seq_len // page)
            rows = self.allocator.translate(locs).to(torch.int64)
            if record.mode == RESIDENT:
                assert bool((rows > 0).all()), f"resident request {request.uid} has unmapped tokens"
                assert bool((rows % page == locs % page).all()), "resident rows lost their page alignment"
                pages = torch.unique(rows // page)
                owned_rows.append(self.allocator.device_rows.page_rows(pages))
            else:
                buffer_id = self.buffers.buffer_of(request.slot)
                assert buffer_id >= 0
                slot_rows = self.buffers.slot_rows[buffer_id].to(torch.int64)
                owned_rows.append(slot_rows)
                newest_row = int(slot_rows[self.config.device_buffer_size])
                assert int(rows[-1]) == newest_row, "the newest token is not bound to the reserved slot"
                assert bool(((rows == 0) | (rows == newest_row)).all()), "an offloaded token maps to a foreign row"
                self._check_buffer(request, buffer_id)
                if record.promotion is not None:
                    owned_rows.append(self.allocator.device_rows.page_rows(record.promotion.pages))
            # Between steps every token is on the host: the prefill's by the staging copy, each
            # decoded one by the swap-in of the step that wrote it (backup_newest).
            host = self.host_pool.layers[0][locs.cpu()]
            expected = token_rows(request.uid, torch.arange(request.seq_len), 0, self.item_bytes)
            assert torch.equal(host, expected), f"host rows of request {request.uid} are wrong"
        assert self.allocator.logical.used_pages == logical_pages, (
            f"host rows leaked: {self.allocator.logical.used_pages} pages allocated, {logical_pages} owned"
        )
        all_rows = torch.cat(owned_rows) if owned_rows else torch.empty(0, dtype=torch.int64)
        assert torch.unique(all_rows).numel() == all_rows.numel(), "a device row is owned twice"
        assert all_rows.numel() == self.allocator.device_rows.used_pages * page, (
            f"device rows leaked: {self.allocator.device_rows.used_pages * page} allocated, {all_rows.numel()} owned"
        )
        assert self.buffers.used_buffers == sum(
            1 for r in self.requests.values() if coordinator.requests[r.slot].mode == OFFLOADED
        ), "device buffers leaked"

    def check_all_free(self) -> None:
        assert not self.requests
        assert self.allocator.logical.free_pages == self.allocator.logical.capacity_pages, "host rows leaked"
        assert self.allocator.device_rows.free_pages == self.allocator.device_rows.capacity_pages, "device rows leaked"
        assert self.buffers.used_buffers == 0, "buffers leaked"
        assert int((self.allocator.device_row_of_loc[:-1] != 0).sum()) == 0, "stale device mappings"
        assert not self.coordinator.requests and not self.coordinator.pending

    # ------------------------------------------------------------------ internals
    def _release(self, request: _SimRequest) -> None:
        self.coordinator.finish(request.slot)
        locs = self.req_to_token[request.slot, : request.seq_len]
        self.allocator.free(locs)
        self.req_to_token[request.slot] = 0
        self.free_slots.append(request.slot)

    def _by_slot(self, slot: int) -> _SimRequest:
        for request in self.requests.values():
            if request.slot == slot:
                return request
        raise KeyError(slot)

    def _write_kv(self, uid: int, slot: int, positions: torch.Tensor) -> None:
        positions = positions.to(self.device)
        rows = self.allocator.translate(self.req_to_token[slot, positions].to(torch.int64)).to(torch.int64)
        assert bool((rows > 0).all()), "the model writes KV to an unmapped location"
        for layer_id, layer in enumerate(self.device_layers):
            layer[rows] = token_rows(uid, positions.cpu(), layer_id, self.item_bytes).to(self.device)

    def _initial_selection(self, seq_len: int) -> torch.Tensor:
        count = min(self.config.top_k, seq_len)
        return torch.randperm(seq_len, generator=self.torch_rng)[:count].sort().values

    def _select(self, request: _SimRequest, layer_id: int) -> torch.Tensor:
        """Top-k positions with locality: most of last step's choice, some fresh picks, the newest."""
        seq_len = request.seq_len
        top_k = self.config.top_k
        previous = request.selection[layer_id]
        keep = previous[torch.rand(previous.numel(), generator=self.torch_rng) >= self.drift]
        fresh = torch.randint(0, seq_len, (top_k,), generator=self.torch_rng)
        newest = torch.tensor([seq_len - 1])
        selection = _first_occurrences(torch.cat([newest, keep, fresh]))[:top_k]
        request.selection[layer_id] = selection
        out = torch.full((top_k,), -1, dtype=torch.int64)
        out[: selection.numel()] = selection[torch.randperm(selection.numel(), generator=self.torch_rng)]
        if selection.numel() >= 2 and self.rng.random() < 0.2:
            out[-1] = out[0]  # duplicate entries happen: the op must collapse them
        return out

    def _verify_rows(self, batch: list[_SimRequest], top_k: torch.Tensor, rows: torch.Tensor, layer_id: int) -> None:
        for b, request in enumerate(batch):
            valid = top_k[b] >= 0
            assert bool((rows[b][~valid] == -1).all()), "padding did not map to -1"
            got = self.device_layers[layer_id][rows[b][valid].to(device=self.device, dtype=torch.int64)].cpu()
            want = token_rows(request.uid, top_k[b][valid], layer_id, self.item_bytes)
            if not torch.equal(got, want):
                bad = int(torch.nonzero((got != want).any(dim=1))[0])
                raise AssertionError(
                    f"request {request.uid} layer {layer_id}: top-k entry for position "
                    f"{int(top_k[b][valid][bad])} reads row {int(rows[b][valid][bad])} holding the wrong KV"
                )

    def _check_buffer(self, request: _SimRequest, buffer_id: int) -> None:
        size = self.config.device_buffer_size
        for layer_id in range(self.layer_num):
            tokens = self.buffers.slot_tokens[layer_id, buffer_id].to(torch.int64)
            stamps = self.buffers.slot_stamps[layer_id, buffer_id].to(torch.int64)
            assert bool((stamps <= request.seq_len).all()), "an LRU stamp is ahead of the request"
            held = tokens[tokens >= 0]
            assert torch.unique(held).numel() == held.numel(), "a token sits in two LRU slots"
            mapping = self.buffers.token_slot[layer_id, buffer_id, : self.max_context].to(torch.int64)
            mapped = torch.nonzero(mapping >= 0).reshape(-1)
            assert torch.equal(mapped.cpu(), torch.sort(held).values.cpu()), "token -> slot map and slots disagree"
            assert torch.equal(tokens[mapping[mapped]].cpu(), mapped.cpu()), "token -> slot map points elsewhere"
            assert bool((held < request.seq_len - 1).all()), "an LRU slot holds the newest or a future token"
            rows = self.buffers.slot_rows[buffer_id, :size].to(torch.int64)[tokens >= 0]
            got = self.device_layers[layer_id][rows].cpu()
            want = token_rows(request.uid, held.cpu(), layer_id, self.item_bytes)
            assert torch.equal(got, want), f"request {request.uid} layer {layer_id}: a buffer slot holds the wrong KV"

    def _idle(self, lookups_before: int, misses_before: int) -> StepReport:
        """A step with nothing to decode: time passes for the copies in flight (a CPU event completes
        a number of steps after it was recorded; a real one completes while the scheduler idles)."""
        self.streams.step += 1
        return self._report(0, lookups_before, misses_before)

    def _report(self, batch_size: int, lookups_before: int, misses_before: int) -> StepReport:
        lookups, misses = self.coordinator.swap_counters.tolist()
        modes = [record.mode for record in self.coordinator.requests.values()]
        return StepReport(
            batch_size=batch_size,
            resident=modes.count(RESIDENT),
            offloaded=modes.count(OFFLOADED),
            lookups=lookups - lookups_before,
            misses=misses - misses_before,
            bytes_moved=(misses - misses_before) * self.item_bytes,
        )


def _first_occurrences(values: torch.Tensor) -> torch.Tensor:
    """Distinct values in order of first occurrence."""
    distinct, inverse = torch.unique(values, return_inverse=True)
    first = torch.full((distinct.numel(),), values.numel(), dtype=torch.int64)
    first.scatter_reduce_(0, inverse, torch.arange(values.numel()), reduce="amin")
    return distinct[torch.argsort(first)]
