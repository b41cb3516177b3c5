"""A simulated decode server that drives the coordinator the way SGLang does.

Used by the demo and by the lifecycle property tests. Every KV row the "model" writes carries its
identity (request uid, position, layer), so any row read back through the swap-in op can be
checked against the token it should hold.

Top-k selection: by default a stress model for correctness (``_select``: most of the last step's
choice, fresh random picks, the newest token, in random order, sometimes with a duplicate entry and
-1 padding, so the swap-in's collapsing of duplicates and padding is exercised on every run). With
``workload`` (testing/workload.py) the indexer is that model instead: distinct positions with a
named, calibrated locality, a pure function of (workload seed, request uid, layer, original prompt
length, seq_len), so two servers with different policies see identical top-k streams.

Progress: a step with nothing to decode still lets time pass for the copies in flight (on the CPU
an event completes a number of steps after it was recorded, and a real copy completes while the
scheduler idles), a request with no output ends when its prefill is collected, and a request that
could not run even on an idle server is rejected (as SGLang rejects it) instead of waiting forever.
:meth:`SimulatedServer.run_until_idle` drives everything to its end and raises
:class:`SimulationStalled` if that takes longer than :meth:`SimulatedServer.progress_bound`.

Speculative decoding (optional, :class:`SpeculativeMode`; docs/speculative.md): every step is a
target-verify of ``T`` positions per request instead of one decode token. The scheduler allocates
each request's reserve (logical locations only, SGLang's ``alloc_for_spec_decode``), the coordinator
prepares the verify, the "model" writes the KV of all ``T`` positions (the real token's for the
positions the step will accept, a rejected draft's otherwise: bytes marked so that a host row holding
them is caught), every layer's multi-position swap-in is checked (where a request's positions name more
history than its buffer holds, the positions the swap-in leaves out must come back -1; each layer's counts and
verify limits are those of a model of the grouped swap-in), the accept lengths are capped at the verify limits
(the coordinator's ``cap_verify``, as hook H10 calls it; a position the cap drops is a rejected draft from then
on), then the commit; accept lengths are random in ``[0, T]`` or scripted, and the host learns them one verify
late by default (SGLang's overlap scheduler). The draft (NextN) layer is modelled as SGLang 0.5.22+ keeps it: a
dense KV pool over the logical locations that the draft forwards write (the prompt after prefill, the draft
positions, then the draft extend over the verify positions); the coordinator never sees it.
"""

from __future__ import annotations

import collections
import dataclasses
import random
from typing import Callable

import torch

from hisparse_sglang.config import HiSparseConfig
from hisparse_sglang.coordinator import OFFLOADED, RESIDENT, Coordinator
from hisparse_sglang.errors import HiSparseMemoryError
from hisparse_sglang.memory.allocator import KVAllocator
from hisparse_sglang.memory.device_buffers import DeviceBufferPool
from hisparse_sglang.memory.host_pool import HostKVPool
from hisparse_sglang.ops import reference
from hisparse_sglang.ops.swap_in_plan import positions_per_group
from hisparse_sglang.streams import StreamSet
from hisparse_sglang.testing.workload import TopKWorkload

__all__ = [
    "SimulatedServer", "SimulationStalled", "SpeculativeMode", "StepReport", "rejected_token_rows", "token_rows",
]

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


def rejected_token_rows(uid: int, positions: torch.Tensor, layer_id: int, item_bytes: int, verify_id: int) -> torch.Tensor:
    """The KV bytes a verify forward writes for ``positions`` holding draft tokens it will reject.

    Word 0 is ``-uid`` (no real token's row has a negative first word: :func:`token_rows` puts the uid
    there), so a host row that ever holds these bytes is caught; word 3 is the verify's id, so the
    rejected KV of another verify never matches either."""
    words = item_bytes // _WORD
    values = token_rows(uid, positions, layer_id, item_bytes).view(torch.int32).reshape(-1, words).clone()
    values[:, 0] = -uid
    values[:, 3] = verify_id
    return values.view(torch.uint8).reshape(-1, item_bytes)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclasses.dataclass(frozen=True)
class SpeculativeMode:
    """Speculative decoding for :class:`SimulatedServer`: every step verifies ``T`` positions per request.

    Attributes:
        num_draft_tokens: ``T``, verify positions per request (``1 <= T <= page_size - 1``).
        host_lag: the scheduler learns a verify's accept lengths one verify late (SGLang's overlap
            scheduler): the committed length ``c`` it hands the coordinator, its reserve and its finish
            decisions trail the device's ``s`` by one step. False: ``c == s``.
        accept: scripted accept lengths, ``accept(uid, verify_index) -> a`` in ``[0, T]``
            (``verify_index`` counts the request's verifies since it was last admitted), before the cap
            (a position the swap-ins left out is never accepted). None: random, uniform in ``[0, T]``, but
            never 0 twice in a row for one request, so every request ends.
        indexer: a scripted top-k, ``indexer(uid, layer_id, s) -> [T, K]`` (entries outside a position's
            causal range ``[0, s + j]`` are padding, as -1 is). None: the stress model (``_select_verify``).
    """

    num_draft_tokens: int
    host_lag: bool = True
    accept: Callable[[int, int], int] | None = None
    indexer: Callable[[int, int, int], torch.Tensor] | None = None


@dataclasses.dataclass
class _SimRequest:
    uid: int
    slot: int
    seq_len: int  # tokens with KV
    target_len: int
    state: str  # "staging" or "decoding"
    selection: list[torch.Tensor]  # per-layer persistent top-k interest set (stress model only)
    origin_len: int = 0  # prompt length when first submitted (a retracted request keeps it)
    # Speculative mode only: seq_len is the device's committed length s; the scheduler knows host_len
    # (c, one verify late with host_lag) and allocated_len (kv_allocated_len, the reserve included).
    host_len: int = 0
    allocated_len: int = 0
    prepared_len: int = 0  # the c of its last prepare (the coordinator's seq_len)
    verifies: int = 0
    last_accept: int = -1


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
        seed: drives the top-k selection of the stress model.
        drift: stress model: share of a layer's selection replaced each step (the rest repeats).
        workload: a top-k workload model (testing/workload.py) to select with instead of the stress
            model; its ``top_k`` must be the config's. None (default) keeps the stress model, which
            the lifecycle tests rely on for duplicates, padding and shuffled entries.
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
        speculative: run verify steps instead of decode steps (:class:`SpeculativeMode`); None (the
            default) decodes one token per step. Not with ``workload`` or a shared host pool.
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
        workload: TopKWorkload | None = None,
        speculative: SpeculativeMode | None = None,
    ) -> None:
        if speculative is not None and (workload is not None or (host_pool is not None and host_pool.shared)):
            raise ValueError("speculative mode models the stress top-k only, on a private host pool: pass no workload "
                             "and no shared host pool.")
        if workload is not None and workload.params.top_k != config.top_k:
            raise ValueError(
                f"workload top_k ({workload.params.top_k}) must equal the config's top_k ({config.top_k}); "
                f"build the workload with top_k={config.top_k}."
            )
        self.workload = workload
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
        self._origin_len: dict[int, int] = {}  # uid -> prompt length when first admitted
        self.speculative = speculative
        if speculative is not None:
            # The draft layer's KV: dense on the GPU over every logical location (docs/speculative.md 2.6 A).
            self.draft_layer = torch.zeros((host_pages * config.page_size, item_bytes), dtype=torch.uint8, device=device)
            self.draft_layer_id = layer_num  # its token_rows identity, distinct from every target layer
            self._verify_id = 0
            # Where buffers are smaller than the verify positions' history: positions the swap-ins left out
            # (per row and step, each counted once) and rows whose accept length the cap lowered.
            self.left_out_positions = 0
            self.capped_accepts = 0

    # ------------------------------------------------------------------ scheduler-facing
    def fits_when_idle(self, prompt_len: int, output_len: int) -> bool:
        """Whether the request could run on an otherwise idle server: its prefill on the GPU, its
        whole length in the host pool and the context of a request slot."""
        pages = self.allocator.device_rows.capacity_pages
        fits = (
            1 <= prompt_len
            and prompt_len + output_len <= self.max_context
            and -(-prompt_len // self.page_size) <= pages
            and -(-(prompt_len + output_len) // self.page_size) <= self.allocator.logical.capacity_pages
        )
        if not fits or self.speculative is None or output_len <= 0:
            return fits
        # Speculation: the largest reserve (its logical pages), and the largest a request that cannot be
        # demoted (c - 1 < D) holds resident, must fit too.
        reserve = self._largest_reserve(prompt_len, output_len)
        target = prompt_len + output_len
        resident_peak = max(prompt_len, self._reserve_for(min(target - 1, self.config.device_buffer_size)))
        return (
            reserve <= self.max_context
            and -(-reserve // self.page_size) <= self.allocator.logical.capacity_pages
            and -(-resident_peak // self.page_size) <= pages
        )

    def _reserve_for(self, committed: int) -> int:
        """The allocated length SGLang reserves for a committed length (the 2T double buffer, whole pages)."""
        return _round_up(committed + 2 * self.speculative.num_draft_tokens, self.page_size)

    def _largest_reserve(self, prompt_len: int, output_len: int) -> int:
        """The largest allocated length a request reaches (the scheduler's c stays below its target)."""
        if self.speculative is None or output_len <= 0:
            return prompt_len + output_len
        return max(prompt_len, self._reserve_for(prompt_len + output_len - 1))

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
        total_pages = -(-self._largest_reserve(prompt_len, output_len) // self.page_size)
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
        selection = [] if self.workload is not None else [
            self._initial_selection(prompt_len) for _ in range(self.layer_num)
        ]
        origin_len = self._origin_len.setdefault(uid, prompt_len)
        self.requests[uid] = _SimRequest(
            uid, slot, prompt_len, prompt_len + output_len, "staging", selection, origin_len,
            host_len=prompt_len, allocated_len=prompt_len, prepared_len=prompt_len,
        )
        if self.speculative is not None:
            self._write_draft(uid, slot, torch.arange(prompt_len))  # the draft extend after prefill
        self.admitted.add(uid)
        return uid

    def admit_transferred(self, prompt_len: int, output_len: int, uid: int | None = None) -> int | None:
        """PD disaggregation's decode side (speculative mode only): the prefill instance wrote the
        prompt's KV into the host pool and its draft KV into the draft pool, at logical locations; the
        coordinator admits the request directly (``admit_direct``: resident when it fits a buffer, else
        offloaded with an empty buffer). None if it could never run, or slots or memory are short now."""
        if self.speculative is None:
            raise ValueError("admit_transferred models PD admission in speculative mode only.")
        if not self.free_slots or not self.fits_when_idle(prompt_len, output_len):
            return None
        if self.allocator.logical.free_pages < -(-self._largest_reserve(prompt_len, output_len) // self.page_size):
            return None
        pages = self.coordinator.direct_admission_pages(prompt_len)
        if self.allocator.device_rows.free_pages + self.coordinator.reclaimable_pages() < pages:
            return None
        if uid is None:
            uid = self._next_uid
            self._next_uid += 1
        slot = self.free_slots.pop()
        locs = self.allocator.alloc_extend(
            torch.tensor([0]), torch.tensor([prompt_len]), torch.tensor([-1], device=self.device), with_device_rows=False
        )
        self.req_to_token[slot, :prompt_len] = locs.to(torch.int32)
        positions = torch.arange(prompt_len)
        for layer_id, layer in enumerate(self.host_pool.layers):
            layer[locs.cpu()] = token_rows(uid, positions, layer_id, self.item_bytes)
        self._write_draft(uid, slot, positions)
        self.coordinator.admit_direct(slot, prompt_len)
        self._origin_len.setdefault(uid, prompt_len)
        self.requests[uid] = _SimRequest(
            uid, slot, prompt_len, prompt_len + output_len, "decoding",
            [self._initial_selection(prompt_len) for _ in range(self.layer_num)], self._origin_len[uid],
            host_len=prompt_len, allocated_len=prompt_len, prepared_len=prompt_len,
        )
        self.admitted.add(uid)
        if output_len <= 0:
            self.finish(uid)
        return uid

    def step(self) -> StepReport:
        """One scheduler iteration: collect staged requests, decode one token for every request (in
        speculative mode: verify ``T`` positions of every request)."""
        if self.speculative is not None:
            return self._verify_step()
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
            top_k = self._select_batch(batch, seq_lens, layer_id)
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
        self._origin_len.pop(uid, None)
        self.finished.append(uid)

    def abort(self, uid: int) -> None:
        self._release(self.requests.pop(uid))
        self._origin_len.pop(uid, None)
        self.aborted.append(uid)

    def retract(self, uid: int) -> None:
        """Give a request's memory back; it comes back later as a longer prefill of the same tokens."""
        request = self.requests.pop(uid)
        self._release(request)
        # (A verify whose results the scheduler has not seen yet may have taken a request past its target.)
        self.retracted.append((uid, request.seq_len, max(request.target_len - request.seq_len, 0)))

    def readmit_retracted(self) -> None:
        """Prefill retracted requests again (their KV is recomputed from the same tokens). One whose
        prompt has grown past what an idle server could prefill is rejected (SGLang aborts it)."""
        kept = []
        for uid, prompt_len, output_len in self.retracted:
            if not self.fits_when_idle(prompt_len, output_len):
                self.rejected[uid] = "outgrew the GPU pool"
                self._origin_len.pop(uid, None)
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
        tokens = sum(max(r.target_len - r.seq_len, 0) for r in self.requests.values())
        tokens += sum(output for _, _, output in self.retracted) + sum(output for _, _, output in self.waiting)
        count = len(self.requests) + len(self.retracted) + len(self.waiting)
        if self.speculative is not None:
            # A request gains at least one token every second verify (random accepts never give 0
            # twice in a row), and the scheduler sees its end one verify late.
            return (2 * tokens + 3 * count + 1) * (self.streams.cpu_event_delay_steps + 3)
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

    def apply(self, operations) -> None:
        """Runs a lifecycle script (the property tests' operations), checking the invariants after each.

        Each operation is a tuple: ``("add", prompt_len, output_len)``, ``("pd", prompt_len, output_len)``
        (a PD-transferred request), ``("step", n)`` (``n`` steps, checked after each), ``("readmit",)``,
        or ``(name, i)`` with ``name`` a request-ending method (``finish``, ``abort``, ``retract``, ...)
        applied to the ``i``-th live request modulo their count (nothing when none is live).
        """
        for op in operations:
            kind = op[0]
            if kind == "add":
                self.add_request(op[1], op[2])
            elif kind == "pd":
                self.admit_transferred(op[1], op[2])
            elif kind == "step":
                for _ in range(op[1]):
                    self.step()
                    self.check_invariants()
            elif kind == "readmit":
                self.readmit_retracted()
            elif self.requests:
                live = sorted(self.requests)
                getattr(self, kind)(live[op[1] % len(live)])
            self.check_invariants()

    def drain(self) -> None:
        """Runs until every admitted request has ended, within the progress bound; nothing may leak."""
        self.run_until_idle(check=self.check_invariants)
        self.check_every_admitted_request_ended()
        self.check_all_free()

    def check_every_admitted_request_ended(self) -> None:
        """Every request admitted so far finished, was aborted or was rejected (none is lost)."""
        ended = set(self.finished) | set(self.aborted) | set(self.rejected)
        live = set(self.requests) | {uid for uid, _, _ in self.retracted}
        lost = self.admitted - ended - live
        assert not lost, f"admitted requests neither ended nor live: {sorted(lost)[:8]}"

    # ------------------------------------------------------------------ checks
    def settle_copies(self) -> None:
        """On a GPU: wait for the copies in flight, enqueueing first the staging copies whose rows have reached the
        host (coordinator/staging.py), so that every copy is done at the step the CPU stand-in's (without a delay)
        is; nothing on the CPU."""
        if self.streams.is_cuda:
            torch.cuda.synchronize(self.device)
            staging = self.coordinator.prefill_staging
            while staging.waiting():  # every row plan has arrived and no copy is in flight: each round enqueues
                staging.issue_ready()
                torch.cuda.synchronize(self.device)

    def check_invariants(self) -> None:
        """Raise AssertionError if any ownership or content invariant is broken."""
        if self.streams.is_cuda:
            # Between steps: a staging copy enqueued by the step's prepare (its rows had just reached the
            # host) may still run on its stream; the host rows it writes are checked once it is done.
            torch.cuda.synchronize(self.device)
        if self.speculative is not None:
            self._check_speculative_invariants()
            return
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
            # Between steps every token is on the host: the prefill's once its staging copy is enqueued
            # (a CPU copy is done when enqueued), each decoded one by the swap-in of the step that wrote it
            # (backup_newest).
            unstaged = coordinator.prefill_staging.unstaged_len(request.slot)
            host = self.host_pool.layers[0][locs[unstaged:].cpu()]
            expected = token_rows(request.uid, torch.arange(unstaged, request.seq_len), 0, self.item_bytes)
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
        held = request.seq_len if self.speculative is None else request.allocated_len
        locs = self.req_to_token[request.slot, :held]
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

    def _select_batch(self, batch: list[_SimRequest], seq_lens: torch.Tensor, layer_id: int) -> torch.Tensor:
        """One layer's top-k of the batch: int32 ``[B, top_k]``."""
        if self.workload is None:
            return torch.stack([self._select(r, layer_id) for r in batch]).to(torch.int32)
        uids = torch.tensor([r.uid for r in batch], dtype=torch.int64)
        origins = torch.tensor([r.origin_len for r in batch], dtype=torch.int64)
        return self.workload.topk(uids, origins, seq_lens, layer_id).to(torch.int32)

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

    # ------------------------------------------------------------------ speculative mode
    def _verify_step(self) -> StepReport:
        """One scheduler iteration with speculative decoding: collect staged requests, then allocate
        every request's reserve, prepare, draft, verify (every layer's swap-in checked), cap the accept
        lengths at the positions the swap-ins served, commit."""
        num_positions = self.speculative.num_draft_tokens
        for slot in self.coordinator.collect_ready():
            request = self._by_slot(slot)
            request.state = "decoding"
            if request.seq_len >= request.target_len:
                self.finish(request.uid)
        batch = sorted((r for r in self.requests.values() if r.state == "decoding"), key=lambda r: r.slot)
        lookups_before, misses_before = self.coordinator.swap_counters.tolist()

        def reserve(r: _SimRequest) -> int:
            return max(r.allocated_len, self._reserve_for(r.host_len))

        def logical_pages_needed(requests: list[_SimRequest]) -> int:
            page = self.page_size
            return sum(-(-reserve(r) // page) - -(-r.allocated_len // page) for r in requests)

        # Like SGLang's check_decode_mem: retract the longest request while the reserves do not fit
        # (logical pages for every request, device pages for resident ones).
        while batch and (
            logical_pages_needed(batch) > self.allocator.logical.free_pages
            or not self.coordinator.can_verify([r.slot for r in batch], [reserve(r) for r in batch])
        ):
            victim = max(batch, key=lambda r: r.seq_len)
            self.retract(victim.uid)
            batch.remove(victim)
        if not batch:
            return self._idle(lookups_before, misses_before)

        # alloc_for_spec_decode: logical locations only, continuing each request's last page.
        growing = [r for r in batch if reserve(r) > r.allocated_len]
        if growing:
            last_loc = torch.stack([self.req_to_token[r.slot, r.allocated_len - 1] for r in growing]).to(torch.int64)
            locs = self.allocator.alloc_extend(
                torch.tensor([r.allocated_len for r in growing]), torch.tensor([reserve(r) for r in growing]),
                last_loc, with_device_rows=False,
            )
            assert locs is not None, "the logical pages were checked above"
            start = 0
            for r in growing:
                end = start + reserve(r) - r.allocated_len
                self.req_to_token[r.slot, r.allocated_len : reserve(r)] = locs[start:end].to(torch.int32)
                r.allocated_len, start = reserve(r), end

        slots = torch.tensor([r.slot for r in batch], dtype=torch.int64, device=self.device)
        seq_lens = torch.tensor([r.seq_len for r in batch], dtype=torch.int64, device=self.device)
        self.coordinator.prepare_verify(
            [r.slot for r in batch], [r.host_len for r in batch], [r.allocated_len for r in batch], slots, seq_lens,
            num_positions,
        )
        for r in batch:
            r.prepared_len = r.host_len
        self._verify_id += 1
        accepts = [self._accept_length(r) for r in batch]
        offsets = torch.arange(num_positions)
        for r, accepted in zip(batch, accepts):
            # The draft forwards (S = T - 1 of them) write the draft layer at s .. s + S - 1.
            self._write_draft(r.uid, r.slot, (r.seq_len + offsets)[: num_positions - 1], r.seq_len + accepted)
            # The target verify writes every verify position through the location -> row table.
            self._write_verify(r, r.seq_len + accepted)

        self.coordinator.num_real_reqs.fill_(len(batch))
        self.last_rows = []
        limits = [reference.NO_VERIFY_LIMIT] * len(batch)  # the model's verify limit of each row
        for layer_id in range(self.layer_num):
            top_k = torch.stack([self._select_verify(r, layer_id) for r in batch]).to(torch.int32)
            if self.verify:
                expected_counts, limits = self._expected_verify_counts(batch, top_k, layer_id, limits)
            counters_before = self.coordinator.swap_counters.tolist()
            rows = self.coordinator.swap_in_verify(slots, seq_lens, top_k.to(self.device), layer_id)
            self.collective()
            self.last_rows.append(rows.cpu().clone())
            # The first position of each row that this or an earlier layer did not serve (host read).
            left_at = self.coordinator.speculative.verify_limit[: len(batch)].tolist()
            if self.verify:
                self._verify_position_rows(batch, top_k, rows.cpu(), layer_id, accepts, left_at)
                counts = [after - before for after, before in zip(self.coordinator.swap_counters.tolist(), counters_before)]
                assert counts == expected_counts and left_at == limits, (
                    f"layer {layer_id}: (lookups, misses) {counts} and verify limits {left_at}, expected "
                    f"{expected_counts} and {limits}: every history entry of every served position is looked up, "
                    f"each group's distinct placed misses copied once, a position whose miss finds no slot left out"
                )
        self.left_out_positions += sum(max(num_positions - limit, 0) for limit in left_at)

        # SGLang's acceptance (eagle_sample) gives accept_lens and accept_index (row b's accepted verify rows
        # b * T + i, -1 padded); hook H10 caps both in place: no position the swap-ins left out is accepted.
        accept_lens = torch.tensor(accepts, dtype=torch.int64, device=self.device)
        columns = torch.arange(num_positions, dtype=torch.int64, device=self.device).reshape(1, -1)
        accepted_rows = torch.arange(len(batch), dtype=torch.int64, device=self.device).reshape(-1, 1) * num_positions
        accept_index = torch.where(columns < accept_lens.reshape(-1, 1), accepted_rows + columns, -1).to(torch.int32)
        self.coordinator.cap_verify(accept_lens, accept_index)
        capped = accept_lens.tolist()
        if self.verify:
            self._check_capped(accepts, left_at, capped, accept_index.cpu())
        for r, accepted, kept in zip(batch, accepts, capped):
            if kept < accepted:
                # Positions s + kept .. s + accepted - 1 are not accepted after all: their KV is a rejected
                # draft's from now on, so a commit or a read that takes it for a real token is caught.
                self._write_verify(r, r.seq_len + kept)
                self.capped_accepts += 1
            r.last_accept = kept
        self.coordinator.commit_verify(slots, seq_lens, accept_lens)

        for r, accepted in zip(batch, capped):
            # The draft extend runs the draft layer over the verify positions.
            self._write_draft(r.uid, r.slot, r.seq_len + offsets, r.seq_len + accepted)
            before = r.seq_len
            r.seq_len += accepted
            r.host_len = before if self.speculative.host_lag else r.seq_len
        for r in batch:
            if r.host_len >= r.target_len:
                self.finish(r.uid)
        return self._report(len(batch), lookups_before, misses_before)

    def _check_capped(
        self, accepts: list[int], limits: list[int], capped: list[int], accept_index: torch.Tensor
    ) -> None:
        """The cap (``cap_verify``) leaves a row ``min(a, max(l, 1))`` accepted positions (``l`` its verify
        limit: position 0 is always served), ``accept_index`` its first entries of those and -1 after them,
        and every verify limit reset for the next step."""
        expected = [min(accepted, max(limit, 1)) for accepted, limit in zip(accepts, limits)]
        assert capped == expected, (
            f"accept lengths {accepts} with verify limits {limits} capped to {capped}, expected {expected}: a row "
            f"accepts no position the swap-ins left out, and every position before its limit it would accept"
        )
        num_positions = accept_index.shape[1]
        for b, kept in enumerate(capped):
            want = torch.tensor([b * num_positions + i if i < kept else -1 for i in range(num_positions)])
            assert torch.equal(accept_index[b].to(torch.int64), want), (
                f"batch row {b}: accept_index {accept_index[b].tolist()} after the cap, expected {want.tolist()}"
            )
        left = self.coordinator.speculative.verify_limit[: len(capped)].tolist()
        assert left == [reference.NO_VERIFY_LIMIT] * len(capped), f"verify limits {left} not reset by the cap"

    def _accept_length(self, request: _SimRequest) -> int:
        mode = self.speculative
        if mode.accept is not None:
            accepted = int(mode.accept(request.uid, request.verifies))
            if not 0 <= accepted <= mode.num_draft_tokens:
                raise ValueError(f"scripted accept length {accepted} outside [0, {mode.num_draft_tokens}].")
        else:
            accepted = self.rng.randint(1 if request.last_accept == 0 else 0, mode.num_draft_tokens)
        request.verifies += 1
        request.last_accept = accepted
        return accepted

    def _write_verify(self, request: _SimRequest, accepted_end: int) -> None:
        """The target verify's KV of positions ``s .. s + T - 1`` in every layer, written through the location
        -> row table as the forward writes it: the real token's below ``accepted_end``, a rejected draft's from
        there on."""
        positions = request.seq_len + torch.arange(self.speculative.num_draft_tokens)
        rows = self.allocator.translate(self.req_to_token[request.slot, positions.to(self.device)]).to(torch.int64)
        assert bool((rows > 0).all()), "the verify writes KV to an unmapped location"
        for layer_id, layer in enumerate(self.device_layers):
            layer[rows] = self._verify_kv(request.uid, positions, layer_id, accepted_end).to(self.device)

    def _verify_kv(self, uid: int, positions: torch.Tensor, layer_id: int, accepted_end: int) -> torch.Tensor:
        """What this verify wrote at ``positions``: the real token's KV below ``accepted_end``
        (``s + a``), a rejected draft's from there on."""
        kv = token_rows(uid, positions, layer_id, self.item_bytes)
        rejected = positions >= accepted_end
        if bool(rejected.any()):
            kv[rejected] = rejected_token_rows(uid, positions[rejected], layer_id, self.item_bytes, self._verify_id)
        return kv

    def _write_draft(self, uid: int, slot: int, positions: torch.Tensor, accepted_end: int | None = None) -> None:
        """The draft layer's KV of ``positions``, at their logical locations in the dense draft pool."""
        if positions.numel() == 0:
            return
        locs = self.req_to_token[slot, positions.to(self.device)].to(torch.int64)
        end = int(positions.max()) + 1 if accepted_end is None else accepted_end
        self.draft_layer[locs] = self._verify_kv(uid, positions, self.draft_layer_id, end).to(self.device)

    def _select_verify(self, request: _SimRequest, layer_id: int) -> torch.Tensor:
        """One layer's top-k of every verify position of a request: int64 ``[T, K]``. Entries are history
        (drawn from at most ``T * K`` positions below ``s - 1``, most of them repeated from the last step
        and across positions), the newest committed token, verify tokens within the causal range, tokens
        past it (must come back -1) and padding; or the scripted indexer's (``SpeculativeMode.indexer``)."""
        num_positions, top_k = self.speculative.num_draft_tokens, self.config.top_k
        committed = request.seq_len
        if self.speculative.indexer is not None:
            scripted = torch.as_tensor(self.speculative.indexer(request.uid, layer_id, committed)).to(torch.int64)
            if tuple(scripted.shape) != (num_positions, top_k):
                raise ValueError(
                    f"scripted top-k of shape {tuple(scripted.shape)}; expected [{num_positions}, {top_k}]."
                )
            return scripted
        history = self._verify_history(request, layer_id, num_positions * top_k)
        out = torch.full((num_positions, top_k), -1, dtype=torch.int64)
        rng = self.rng
        for j in range(num_positions):
            for k in range(top_k):
                kind = rng.random()
                if kind < 0.55 and history:
                    out[j, k] = history[rng.randrange(len(history))]
                elif kind < 0.65:
                    out[j, k] = committed - 1
                elif kind < 0.82:
                    out[j, k] = committed + rng.randint(0, j)
                elif kind < 0.9:
                    out[j, k] = committed + j + 1 + rng.randrange(num_positions)
        return out

    def _verify_history(self, request: _SimRequest, layer_id: int, count: int) -> list[int]:
        limit = request.seq_len - 1  # history: positions below the newest committed token
        if limit <= 0:
            return []
        previous = request.selection[layer_id]
        previous = previous[previous < limit]
        keep = previous[torch.rand(previous.numel(), generator=self.torch_rng) >= self.drift]
        fresh = torch.randint(0, limit, (min(count, limit),), generator=self.torch_rng)
        selection = _first_occurrences(torch.cat([keep, fresh]))[: min(count, limit)]
        request.selection[layer_id] = selection
        return selection.tolist()

    def _expected_verify_counts(
        self, batch: list[_SimRequest], top_k: torch.Tensor, layer_id: int, limits: list[int]
    ) -> tuple[list[int], list[int]]:
        """(lookups, misses) one layer's swap-in must count, and each row's verify limit after it (``limits``:
        before it), from a model of the grouped swap-in (docs/speculative.md 2.9) over the LRU tables as they
        stand. Resident rows count nothing and keep their limit. An offloaded row's positions go in consecutive
        groups of ``G`` (``positions_per_group``, what the coordinator runs); a group's positions at or past the
        row's limit are padding. The history entries (``t < s - 1``) of its served positions are looked up; the
        slots they hit are stamped ``s``; its misses are the distinct tokens no slot holds, in order of first
        occurrence (position-major). They may take the slots no entry hit and, after the first group, not
        stamped ``s`` (an earlier group's rows stay), the least recently used first (age ``s - stamp``, capped,
        the lower slot among equals); where there are fewer such slots than misses, the position of the first
        miss without one becomes the limit (if lower) and only the misses of earlier positions are copied."""
        num_positions, size = top_k.shape[1], self.config.device_buffer_size
        group = positions_per_group(num_positions, self.config.top_k, size)
        lookups = misses = 0
        limits = list(limits)
        for b, request in enumerate(batch):
            if self.coordinator.requests[request.slot].mode != OFFLOADED:
                continue
            committed = request.seq_len
            buffer_id = self.buffers.buffer_of(request.slot)
            tokens = self.buffers.slot_tokens[layer_id, buffer_id].tolist()
            stamps = self.buffers.slot_stamps[layer_id, buffer_id].tolist()
            entries = top_k[b].tolist()
            for first in range(0, num_positions, group):
                served = min(first + group, num_positions, max(first, limits[b]))
                history = [(j, t) for j in range(first, served) for t in entries[j] if 0 <= t < committed - 1]
                lookups += len(history)
                slot_of = {token: slot for slot, token in enumerate(tokens) if token >= 0}
                hit = {slot_of[t] for _, t in history if t in slot_of}
                for slot in hit:
                    stamps[slot] = committed
                first_seen: dict[int, int] = {}  # missed token -> its first position, in order of first occurrence
                for j, t in history:
                    if t not in slot_of:
                        first_seen.setdefault(t, j)
                free = [slot for slot in range(size) if slot not in hit and (first == 0 or stamps[slot] != committed)]
                placed = list(first_seen)
                if len(placed) > len(free):
                    left_out = first_seen[placed[len(free)]]
                    assert first > 0, "the first group's history always fits the buffer (G x top_k <= D)"
                    limits[b] = min(limits[b], left_out)
                    placed = [t for t in placed if first_seen[t] < left_out]
                age = {slot: min(max(committed - stamps[slot], 0), reference.AGE_CAP) for slot in free}
                victims = sorted(free, key=lambda slot: (-age[slot], slot))[: len(placed)]
                for slot, t in zip(victims, placed):  # which miss takes which victim changes no count
                    tokens[slot], stamps[slot] = t, committed
                misses += len(placed)
        return [lookups, misses], limits

    def _verify_position_rows(
        self, batch: list[_SimRequest], top_k: torch.Tensor, rows: torch.Tensor, layer_id: int, accepts: list[int],
        limits: list[int],
    ) -> None:
        """Every entry of a position at or past its row's verify limit (``limits``, as this layer left them: left
        out here or by an earlier layer) is -1; the served positions' padding and entries past their causal
        range are -1, their other entries read rows holding the token's KV (what this verify wrote for a verify
        position)."""
        num_positions = top_k.shape[1]
        for b, request in enumerate(batch):
            committed = request.seq_len
            served = min(limits[b], num_positions)
            assert bool((rows[b][served:] == -1).all()), (
                f"request {request.uid} layer {layer_id}: a verify position at or past the row's verify limit "
                f"{limits[b]} (left out) returned a row"
            )
            tokens = top_k[b][:served].to(torch.int64)
            limit = committed + torch.arange(served).reshape(-1, 1)
            valid = (tokens >= 0) & (tokens <= limit)
            assert bool((rows[b][:served][~valid] == -1).all()), (
                "padding or a token past its position's causal range did not map to -1"
            )
            wanted = tokens[valid]
            got = self.device_layers[layer_id][rows[b][:served][valid].to(device=self.device, dtype=torch.int64)].cpu()
            want = self._verify_kv(request.uid, wanted, layer_id, committed + accepts[b])
            if not torch.equal(got, want):
                bad = int(torch.nonzero((got != want).any(dim=1))[0])
                raise AssertionError(
                    f"request {request.uid} layer {layer_id} (s = {committed}): a verify position's top-k entry for "
                    f"position {int(wanted[bad])} reads row {int(rows[b][:served][valid][bad])} holding the wrong KV"
                )

    def _check_speculative_invariants(self) -> None:
        coordinator = self.coordinator
        page = self.page_size
        owned_rows: list[torch.Tensor] = []
        logical_pages = 0
        offloaded = 0
        for request in self.requests.values():
            record = coordinator.requests[request.slot]
            assert record.seq_len == request.prepared_len <= request.host_len <= request.seq_len, (
                record.seq_len, request.prepared_len, request.host_len, request.seq_len
            )
            assert record.allocated_len == request.allocated_len, (record.allocated_len, request.allocated_len)
            held, committed = request.allocated_len, request.seq_len
            locs = self.req_to_token[request.slot, :held].to(torch.int64)
            assert torch.unique(locs).numel() == locs.numel(), "a logical location is used twice by one request"
            logical_pages += -(-held // page)
            rows = self.allocator.translate(locs).to(torch.int64)
            if record.mode == RESIDENT:
                assert bool((rows > 0).all()), f"resident request {request.uid} has unmapped locations"
                assert bool((rows % page == locs % page).all()), "resident rows lost their page alignment"
                owned_rows.append(self.allocator.device_rows.page_rows(torch.unique(rows // page)))
                for layer_id, layer in enumerate(self.device_layers):
                    got = layer[rows[:committed]].cpu()
                    assert torch.equal(got, token_rows(request.uid, torch.arange(committed), layer_id, self.item_bytes)), (
                        f"resident request {request.uid} layer {layer_id}: a committed token's device row is wrong"
                    )
            else:
                offloaded += 1
                buffer_id = self.buffers.buffer_of(request.slot)
                assert buffer_id >= 0
                slot_rows = self.buffers.slot_rows[buffer_id].to(torch.int64)
                owned_rows.append(slot_rows)
                mapped = rows[rows > 0]
                assert bool(torch.isin(mapped, slot_rows).all()), "an offloaded request's location maps to a foreign row"
                # Slot D is refreshed at the next prepare after a demotion or a PD admission (stale), and
                # at the first verify of any offloaded request.
                if record.spec is not None and not record.spec.slot_d_stale:
                    newest_row = int(slot_rows[self.config.device_buffer_size])
                    for layer_id, layer in enumerate(self.device_layers):
                        want = token_rows(request.uid, torch.tensor([committed - 1]), layer_id, self.item_bytes)
                        assert torch.equal(layer[newest_row : newest_row + 1].cpu(), want), (
                            f"request {request.uid} layer {layer_id}: slot D does not hold the newest committed token"
                        )
                self._check_buffer(request, buffer_id)
                if record.promotion is not None:
                    owned_rows.append(self.allocator.device_rows.page_rows(record.promotion.pages))
            # Every committed token is on its host row (the prefill's by staging once enqueued, or PD, each
            # accepted one by its commit), in every layer; the draft layer's too.
            unstaged = coordinator.prefill_staging.unstaged_len(request.slot)
            for layer_id, layer in enumerate(self.host_pool.layers):
                want = token_rows(request.uid, torch.arange(unstaged, committed), layer_id, self.item_bytes)
                assert torch.equal(layer[locs[unstaged:committed].cpu()], want), (
                    f"host rows of request {request.uid} layer {layer_id} are wrong"
                )
            want = token_rows(request.uid, torch.arange(committed), self.draft_layer_id, self.item_bytes)
            assert torch.equal(self.draft_layer[locs[:committed]].cpu(), want), f"draft KV of request {request.uid} is wrong"
        for layer_id, layer in enumerate(self.host_pool.layers):
            marked = torch.nonzero(layer.view(torch.int32)[:, 0] < 0).reshape(-1)
            assert marked.numel() == 0, (
                f"host row {int(marked[0])} of layer {layer_id} holds a rejected draft token's KV"
            )
        assert self.allocator.logical.used_pages == logical_pages, (
            f"host rows leaked: {self.allocator.logical.used_pages} pages allocated, {logical_pages} held"
        )
        all_rows = torch.cat(owned_rows) if owned_rows else torch.empty(0, dtype=torch.int64)
        assert torch.unique(all_rows).numel() == all_rows.numel(), "a device row is owned twice"
        assert all_rows.numel() == self.allocator.device_rows.used_pages * page, (
            f"device rows leaked: {self.allocator.device_rows.used_pages * page} allocated, {all_rows.numel()} owned"
        )
        assert self.buffers.used_buffers == offloaded, "device buffers leaked"

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
