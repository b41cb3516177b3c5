"""A seeded model of what a DSA indexer selects: top-k positions per request, layer and decode step.

The tiny test models run with dummy weights, so their indexer picks nearly random tokens; real DSA
models select with strong locality. This module stands in for the indexer with a model whose
locality is a set of named parameters, fitted to published figures (docs/workload.md):

* ``sinks``: positions ``[0, sinks)`` are always selected (attention sinks);
* ``recent_window``: the newest ``recent_window`` positions are always selected (the newest token
  among them, as the real indexer's local tokens);
* the other ``R = top_k - sinks - recent_window`` entries are **channels**. Channel ``j`` owns the
  positions ``sinks + j + R * u`` of the middle of the context (so channels never pick the same
  position: the output is always ``top_k`` distinct positions). Each channel has a ranked list of
  ``topic_size`` candidate positions (the **topical set**) and points at one of them; it keeps its
  choice for a dwell of ``T_j`` steps, then draws again, rank ``c`` with probability proportional
  to ``(c + 1) ** -topic_skew`` (so it often comes back to a candidate it held before: what an LRU
  buffer larger than ``top_k`` turns into hits). Dwell times differ per channel (a truncated
  geometric law whose parameter is solved so that the step-to-step overlap is ``persistence``);
* ``drift``: the share of candidates replaced per step; a replaced candidate is placed anywhere in
  the context as it is then (generated tokens included), so the topical set wanders.

Everything is a pure function of ``(seed, request key, layer, prompt length, seq_len)``, computed
with integer tensor operations (a 32-bit hash, integer lookup tables), so every arm of a benchmark,
on the CPU or on a GPU, gets bit-identical indices, and a CUDA graph can capture it (no host sync,
static shapes). When ``seq_len <= top_k`` the output is what the real indexer returns then: every
position ``0 .. seq_len - 1`` in order, then -1.

This module imports only the standard library and torch: the end-to-end harness copies it next to
its SGLang fixture (benchmarks/e2e/topk_workload_fixture.py) into servers that do not have the
package on their path.

    python -m hisparse_sglang.testing.workload --profile calibrated [--persistence 0.6 ...]

prints the measured persistence and the exact-LRU miss rates at buffers of k, 2k and 4k slots.
"""

from __future__ import annotations

import argparse
import array
import dataclasses
import json
import math
import sys
import time
import zlib
from typing import Iterable, Sequence

import torch

__all__ = [
    "WorkloadParams",
    "WorkloadParamError",
    "TopKWorkload",
    "PROFILES",
    "profile",
    "request_key_from_tokens",
    "LruCounts",
    "lru_misses",
    "step_overlap",
    "WorkloadStats",
    "measure",
    "add_workload_arguments",
    "params_from_args",
    "main",
]

_MASK32 = 0xFFFFFFFF
_TWO32 = 1 << 32
# Odd multipliers below 2**31: a 32-bit value times one stays below 2**63, so int64 tensor
# arithmetic never overflows and the CPU and CUDA results are the same bits.
_MUL_A = 0x7FEB352D
_MUL_B = 0x1B873593
_GOLDEN = 0x61C88647  # 2**32 - floor(2**32 / phi): spreads consecutive integers over 32 bits
# One salt per use of the hash, so that the draws of one channel are independent of each other.
_SALT_ROW = 0x2545F491
_SALT_DWELL = 0x68E31DA4
_SALT_PICK = 0x1B56C4E9
_SALT_BIRTH = 0x5F356495
_SALT_PLACE = 0x3C6EF372
# Longest dwell of a channel, in steps. The truncated geometric law of the dwell times lives on
# [1, MAX_DWELL]; its largest mean of 1/T (the slowest channels) bounds the persistence from above.
MAX_DWELL = 4096
# Largest topical set per channel (the lookup table of its ranks is this long at most).
MAX_TOPIC_SIZE = 4096


class WorkloadParamError(ValueError):
    """A workload parameter is out of range (the message names it and the range)."""


@dataclasses.dataclass(frozen=True)
class WorkloadParams:
    """The parameters of the top-k model (module docstring; docs/workload.md has the fit).

    Attributes:
        top_k: entries per step (the model's ``index_topk``).
        context_len: prompt length the measurement and the CLI use; the generator itself takes
            each request's prompt length.
        sinks: positions ``[0, sinks)`` are always selected.
        recent_window: the newest positions always selected (the newest token included if >= 1).
        persistence: target share of a step's top-k that the previous step also selected (the
            overlap ``|T_t & T_{t-1}| / top_k``) at ``context_len``; the dwell times are solved
            for it (reached within about 0.01; the CLI prints what it measures). Values below what
            the model can reach give every channel a dwell of one step.
        topic_size: candidates per channel; the topical set has ``topic_size x R`` positions
            (fewer where the context is shorter: a channel owns about ``context / R`` positions).
        topic_skew: Zipf exponent of a channel's draw among its candidates (0: uniform).
        drift: share of the candidates replaced per step (0: the topical set never changes;
            1: every draw is a fresh position, uniform over the context).
        seed: seeds every hash (different seeds: independent workloads).
    """

    top_k: int = 2048
    context_len: int = 32768
    sinks: int = 4
    recent_window: int = 64
    persistence: float = 0.715
    topic_size: int = 64
    topic_skew: float = 2.2
    drift: float = 0.012
    seed: int = 0

    def __post_init__(self) -> None:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise WorkloadParamError(message)

        for name in ("top_k", "context_len", "sinks", "recent_window", "topic_size", "seed"):
            value = getattr(self, name)
            need(isinstance(value, int) and not isinstance(value, bool), f"{name} must be an int, got {value!r}.")
        for name in ("persistence", "topic_skew", "drift"):
            value = getattr(self, name)
            need(
                isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
                f"{name} must be a finite number, got {value!r}.",
            )
        need(self.top_k >= 1, f"top_k must be >= 1, got {self.top_k}.")
        need(self.context_len >= 1, f"context_len must be >= 1, got {self.context_len}.")
        need(
            self.sinks >= 0 and self.recent_window >= 0,
            f"sinks ({self.sinks}) and recent_window ({self.recent_window}) must be >= 0.",
        )
        need(
            self.sinks + self.recent_window < self.top_k,
            f"sinks ({self.sinks}) + recent_window ({self.recent_window}) must be < top_k ({self.top_k}): "
            f"at least one entry must be left for the topical set.",
        )
        need(0.0 <= self.persistence <= 1.0, f"persistence must be in [0, 1], got {self.persistence}.")
        need(
            1 <= self.topic_size <= MAX_TOPIC_SIZE,
            f"topic_size must be in [1, {MAX_TOPIC_SIZE}], got {self.topic_size}.",
        )
        need(self.topic_skew >= 0.0, f"topic_skew must be >= 0, got {self.topic_skew}.")
        need(0.0 <= self.drift <= 1.0, f"drift must be in [0, 1], got {self.drift}.")
        need(0 <= self.seed < _TWO32, f"seed must be in [0, 2**32), got {self.seed}.")

    @property
    def channels(self) -> int:
        """``R``: entries of the topical set per step."""
        return self.top_k - self.sinks - self.recent_window

    def replace(self, **changes) -> "WorkloadParams":
        return dataclasses.replace(self, **changes)


PROFILES: dict[str, WorkloadParams] = {
    # What the tiny model with dummy weights does: a fresh uniform top-k every step (stratified:
    # one position per channel; no sinks, no window). Its LRU hit rate is about buffer / context.
    "random": WorkloadParams(sinks=0, recent_window=0, persistence=0.0, topic_size=1, topic_skew=0.0, drift=1.0),
    # Fitted at 32K context and top-k 2048 to the exact-LRU miss rates of GLM-5.1 (HiSparse paper:
    # 30 / 13.4 / 6.7 % at k / 2k / 4k slots) with a step-to-step overlap of 0.715 (see
    # docs/workload.md for why 0.6 cannot hold together with 30 % at k slots).
    "calibrated": WorkloadParams(),
    # Illustrative bounds around the fit (not fitted to any model).
    "high-locality": WorkloadParams(recent_window=128, persistence=0.85, topic_size=32, topic_skew=2.6, drift=0.003),
    "low-locality": WorkloadParams(recent_window=32, persistence=0.55, topic_size=128, topic_skew=1.5, drift=0.03),
}


def profile(name: str, **overrides) -> WorkloadParams:
    """The parameters of a named profile, with ``overrides`` (parameter name -> value) applied."""
    if name not in PROFILES:
        raise WorkloadParamError(f"unknown profile {name!r}; choose one of {', '.join(PROFILES)}.")
    return PROFILES[name].replace(**{k: v for k, v in overrides.items() if v is not None})


def request_key_from_tokens(token_ids) -> int:
    """A request key from its prompt tokens (CRC-32 of their native int64 bytes): the same prompt
    gives the same key in every server, whatever request slot or rid it gets. ``token_ids``: any
    iterable of ints (a list, an ``array.array``, a 1-D tensor)."""
    if isinstance(token_ids, torch.Tensor):
        token_ids = token_ids.reshape(-1).tolist()
    return zlib.crc32(array.array("q", token_ids).tobytes())


# ---------------------------------------------------------------------------------------------- hash
def _mix32(x):
    """A 32-bit integer hash (xorshift-multiply, two rounds); ``x`` in ``[0, 2**32)``, int64 tensor
    or Python int. The products stay below 2**63, so CPU and CUDA give the same bits."""
    x = x ^ (x >> 16)
    x = (x * _MUL_A) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _MUL_B) & _MASK32
    return x ^ (x >> 16)


def _spread(x):
    """``x * golden mod 2**32``: a bijection on 32-bit values, so distinct small integers (epochs,
    ranks, generations) give distinct hash inputs. Works on int64 tensors and Python ints."""
    return ((x & _MASK32) * _GOLDEN) & _MASK32


def _fold_key(keys: torch.Tensor) -> torch.Tensor:
    """Request keys (any int64) folded to 32 bits."""
    return (keys & _MASK32) ^ ((keys >> 32) & _MASK32)


# ------------------------------------------------------------------------------------------ tables
def _thresholds(weights: Sequence[float]) -> list[int]:
    """Integer CDF thresholds in ``[0, 2**32]`` of the law ``weights`` (pure Python floats, so every
    machine builds the same table); ``searchsorted(thresholds, h, right=True)`` draws an index for a
    uniform 32-bit hash ``h``."""
    total = math.fsum(weights)
    out, running = [], 0.0
    for weight in weights:
        running += weight
        out.append(min(_TWO32, int(math.floor(running / total * _TWO32))))
    out[-1] = _TWO32
    return out


def _dwell_weights(theta: float) -> list[float]:
    """P(T = t) for t = 1 .. MAX_DWELL: geometric with parameter theta, truncated."""
    if theta >= 1.0:
        return [1.0] + [0.0] * (MAX_DWELL - 1)
    return [theta * (1.0 - theta) ** (t - 1) for t in range(1, MAX_DWELL + 1)]


def _mean_inverse_dwell(theta: float) -> float:
    weights = _dwell_weights(theta)
    return math.fsum(w / t for t, w in enumerate(weights, start=1)) / math.fsum(weights)


def _solve_dwell(switch_rate: float) -> float:
    """The geometric parameter whose truncated law has mean 1/T = switch_rate (clamped to what the
    law can reach)."""
    if switch_rate >= 1.0:
        return 1.0
    low, high = 1e-9, 1.0
    if switch_rate <= _mean_inverse_dwell(low):
        return low
    for _ in range(50):
        middle = 0.5 * (low + high)
        if _mean_inverse_dwell(middle) < switch_rate:
            low = middle
        else:
            high = middle
    return 0.5 * (low + high)


# --------------------------------------------------------------------------------------- generator
class TopKWorkload:
    """The top-k generator of one :class:`WorkloadParams` (tables built once, per device on demand).

    Attributes:
        params: the parameters.
        dwell_theta: the solved geometric parameter of the channels' dwell times.
        switch_rate: the mean 1/T it gives (share of channels drawing again per step).
        reachable: whether ``persistence`` was within what the model can reach.
    """

    def __init__(self, params: WorkloadParams) -> None:
        self.params = params
        ranks = [(rank + 1.0) ** -params.topic_skew for rank in range(params.topic_size)]
        total = math.fsum(ranks)
        same = math.fsum((w / total) ** 2 for w in ranks)
        channels = params.channels
        # A channel keeps its position from one step to the next unless it draws again (rate s)
        # and gets another candidate, or its candidate is replaced (drift). Two candidates of a
        # channel fall on one position about once in the positions a channel owns at context_len:
        #   keep = (1 - s) * stay + s * (same * stay + (1 - same) / owned),
        #   stay = 1 - drift_rate * (1 - 1 / owned),
        # solved for s at the keep that gives the persistence (sinks and window always kept).
        owned = max(1.0, (params.context_len - params.sinks - params.recent_window) / channels)
        kept_fixed = params.sinks + max(params.recent_window - 1, 0)
        keep_needed = (params.persistence * params.top_k - kept_fixed) / channels
        self.generation_period = 0 if params.drift <= 0 else max(1, round(1.0 / params.drift))
        drift_rate = 1.0 / self.generation_period if self.generation_period else 0.0
        stay = 1.0 - drift_rate * (1.0 - 1.0 / owned)
        redraw_keep = same * stay + (1.0 - same) / owned
        wanted = 1.0 if stay - redraw_keep <= 0 else (stay - keep_needed) / (stay - redraw_keep)
        self.dwell_theta = _solve_dwell(wanted)
        self.switch_rate = _mean_inverse_dwell(self.dwell_theta)
        self.reachable = abs(self.switch_rate - wanted) < 1e-3
        self._dwell_thresholds = _thresholds(_dwell_weights(self.dwell_theta))
        self._rank_thresholds = _thresholds(ranks)
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def tables(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """The dwell and rank thresholds (int64) on ``device``; build them before a CUDA graph
        capture (a host-to-device copy cannot be captured)."""
        device = torch.device(device)
        if device not in self._tables:
            self._tables[device] = (
                torch.tensor(self._dwell_thresholds, dtype=torch.int64, device=device),
                torch.tensor(self._rank_thresholds, dtype=torch.int64, device=device),
            )
        return self._tables[device]

    def topk(
        self, request_keys: torch.Tensor, prompt_lens: torch.Tensor, seq_lens: torch.Tensor, layers
    ) -> torch.Tensor:
        """Top-k positions of one decode step of a batch.

        Args:
            request_keys: int64 ``[B]``, a stable identity of each request (any int64; folded to
                32 bits), e.g. :func:`request_key_from_tokens` or a simulator's uid.
            prompt_lens: int ``[B]``, each request's original prompt length (not grown by
                retraction): candidates of the initial topical set lie in the prompt.
            seq_lens: int ``[B]``, tokens including the one being decoded (the newest token is at
                ``seq_len - 1``), as SGLang's and the swap-in's ``seq_lens``.
            layers: layer index, an int or an int ``[B]``.

        Returns:
            int64 ``[B, top_k]`` on the device of ``seq_lens``: ``top_k`` distinct positions in
            ``[0, seq_len)`` when ``seq_len > top_k``; else ``0 .. seq_len - 1`` then -1. Order:
            sinks, recent window (oldest first), channels.
        """
        p = self.params
        device = seq_lens.device
        dwell_table, rank_table = self.tables(device)
        n = seq_lens.to(torch.int64).reshape(-1, 1)
        batch = n.shape[0]
        keys = _fold_key(request_keys.to(device=device, dtype=torch.int64).reshape(-1, 1))
        prompt = prompt_lens.to(device=device, dtype=torch.int64).reshape(-1, 1)
        if isinstance(layers, int):
            layer = torch.full((batch, 1), layers & _MASK32, dtype=torch.int64, device=device)
        else:
            layer = layers.to(device=device, dtype=torch.int64).reshape(-1, 1) & _MASK32
        sinks, window, channels, top_k = p.sinks, p.recent_window, p.channels, p.top_k

        row = _mix32(_mix32(keys ^ _mix32(p.seed ^ _SALT_ROW)) ^ _spread(layer))  # [B, 1]
        j = torch.arange(channels, dtype=torch.int64, device=device).reshape(1, -1)
        channel = _mix32(row ^ _spread(j))  # [B, R]
        # Dwell: channel j keeps its draw for T_j steps, epochs offset by a per-channel phase.
        dwell = torch.searchsorted(dwell_table, _mix32(channel ^ _SALT_DWELL), right=True) + 1
        epoch = (n + channel % dwell) // dwell
        rank = torch.searchsorted(rank_table, _mix32(_mix32(channel ^ _SALT_PICK) ^ _spread(epoch)), right=True)
        # The candidate of that rank: its generation (drift) and the context when it was born.
        birth = _mix32(channel ^ _SALT_BIRTH ^ _spread(rank))
        floor_len = torch.clamp(prompt, min=top_k + 1)  # >= R + 1 middle positions: every channel owns one
        if self.generation_period:
            period = self.generation_period
            phase = birth % period
            generation = (n + phase) // period
            born_at = torch.maximum(generation * period - phase, floor_len)
        else:
            generation = torch.zeros_like(birth)
            born_at = floor_len.expand_as(birth)
        middle = born_at - window - sinks
        owned = (middle - j + channels - 1) // channels  # positions sinks + j + R*u < born_at - window
        place = _mix32(birth ^ _spread(generation + _SALT_PLACE))
        positions = sinks + j + channels * ((place * owned) >> 32)

        parts = [positions]
        if window:
            parts.insert(0, n - window + torch.arange(window, dtype=torch.int64, device=device).reshape(1, -1))
        if sinks:
            parts.insert(0, torch.arange(sinks, dtype=torch.int64, device=device).reshape(1, -1).expand(batch, -1))
        selected = torch.cat(parts, dim=1)
        # seq_len <= top_k: the indexer returns every position in order, then -1 (no host branch:
        # a CUDA graph captures both and the select).
        everything = torch.arange(top_k, dtype=torch.int64, device=device).reshape(1, -1)
        short = torch.where(everything < n, everything, torch.full_like(everything, -1))
        return torch.where(n > top_k, selected, short)

    def stream(self, request_key: int, prompt_len: int, layer: int, seq_lens: torch.Tensor) -> torch.Tensor:
        """Top-k of one request and layer at each of ``seq_lens`` (int ``[T]``): int64 ``[T, top_k]``."""
        count = seq_lens.numel()
        return self.topk(
            torch.full((count,), request_key, dtype=torch.int64),
            torch.full((count,), prompt_len, dtype=torch.int64),
            seq_lens,
            layer,
        )


# --------------------------------------------------------------------------------------- measuring
@dataclasses.dataclass(frozen=True)
class LruCounts:
    """Per-step counts of an exact LRU buffer fed with one top-k stream (swap-in semantics).

    Attributes:
        lookups: int64 ``[T]``, valid entries other than the newest token (duplicates counted).
        misses: int64 ``[T]``, distinct such entries the buffer did not hold (copied host -> device).
    """

    lookups: torch.Tensor
    misses: torch.Tensor

    def miss_rate(self, start: int = 0) -> float:
        looked = int(self.lookups[start:].sum())
        return int(self.misses[start:].sum()) / looked if looked else 0.0


def lru_misses(top_k: torch.Tensor, seq_lens: torch.Tensor, buffer_slots: int, age_cap: int = 32767) -> LruCounts:
    """Feed one request's per-step top-k (one layer) to an LRU buffer of ``buffer_slots`` slots that
    starts empty, and count as the swap-in does (``ops/reference.py::swap_in``): the newest token
    (``seq_len - 1``) goes to its own slot and is not looked up; hits stamp their slots; the
    distinct misses, in order of first occurrence, replace the least recently used slots not hit
    (oldest first, lower slot first among equals; ages capped at ``age_cap``).

    Args:
        top_k: int ``[T, K]`` positions, -1 (or anything outside ``[0, seq_len)``) is padding.
        seq_lens: int ``[T]``, increasing.
        buffer_slots: ``D >= K``.
    """
    steps, width = top_k.shape
    if buffer_slots < width:
        raise WorkloadParamError(f"buffer_slots ({buffer_slots}) must be >= top_k ({width}).")
    top_k = top_k.to(torch.int64).cpu()
    seq_lens = seq_lens.to(torch.int64).cpu()
    context = int(seq_lens.max()) + 1
    token_slot = torch.full((context,), -1, dtype=torch.int64)
    slot_tokens = torch.full((buffer_slots,), -1, dtype=torch.int64)
    slot_stamps = torch.zeros(buffer_slots, dtype=torch.int64)
    lookups = torch.zeros(steps, dtype=torch.int64)
    misses = torch.zeros(steps, dtype=torch.int64)
    order = torch.arange(width, dtype=torch.int64)
    for step in range(steps):
        seq_len = int(seq_lens[step])
        row = top_k[step]
        keep = (row >= 0) & (row < seq_len - 1)
        tokens, index = row[keep], order[keep]
        lookups[step] = tokens.numel()
        if not tokens.numel():
            continue
        found = token_slot[tokens]
        hit_slots = torch.unique(found[found >= 0])
        slot_stamps[hit_slots] = seq_len
        missed, missed_index = tokens[found < 0], index[found < 0]
        if not missed.numel():
            continue
        distinct, inverse = torch.unique(missed, return_inverse=True)
        first = torch.full((distinct.numel(),), width, dtype=torch.int64)
        first.scatter_reduce_(0, inverse, missed_index, reduce="amin")
        distinct = distinct[torch.argsort(first)]
        count = distinct.numel()
        misses[step] = count
        free = torch.ones(buffer_slots, dtype=torch.bool)
        free[hit_slots] = False
        slots = torch.nonzero(free).reshape(-1)
        ages = (seq_len - slot_stamps[slots]).clamp(0, age_cap)
        chosen = torch.argsort(-ages, stable=True)[:count]
        chosen_slots, chosen_ages = slots[chosen], ages[chosen]
        youngest = chosen_ages.min()
        victims = torch.cat(
            [
                torch.sort(chosen_slots[chosen_ages > youngest]).values,
                torch.sort(chosen_slots[chosen_ages == youngest]).values,
            ]
        )
        old = slot_tokens[victims]
        token_slot[old[old >= 0]] = -1
        slot_tokens[victims] = distinct
        slot_stamps[victims] = seq_len
        token_slot[distinct] = victims
    return LruCounts(lookups, misses)


def step_overlap(top_k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Overlap and Jaccard similarity of each step's valid top-k with the step before.

    Args:
        top_k: int ``[T, K]``, one request and layer, -1 padding.

    Returns:
        float64 ``[T - 1]`` each: ``|A & B| / |B|`` (the share of step t's selection that step t-1
        also selected) and ``|A & B| / |A | B|``.
    """
    overlaps, jaccards = [], []
    previous = None
    for row in top_k.to(torch.int64).cpu():
        current = torch.unique(row[row >= 0])
        if previous is not None:
            both = int(torch.isin(current, previous).sum())
            union = current.numel() + previous.numel() - both
            overlaps.append(both / max(current.numel(), 1))
            jaccards.append(both / max(union, 1))
        previous = current
    return torch.tensor(overlaps, dtype=torch.float64), torch.tensor(jaccards, dtype=torch.float64)


def verify_unions(top_k: torch.Tensor, positions: int) -> torch.Tensor:
    """Distinct tokens named by ``positions`` consecutive steps, for every window of them: what a speculative
    verify of ``T = positions`` query positions asks one request's buffer to hold at once (its positions are
    consecutive decode steps; a buffer of ``T x top_k`` slots never leaves a position out, the default
    ``2 x top_k`` does where the union is larger: docs/speculative.md 2.9).

    Args:
        top_k: int ``[S, K]``, one request and layer, -1 padding.
        positions: ``T >= 1``.

    Returns:
        int64 ``[S - T + 1]`` (empty when ``S < T``): the union's size of steps ``i .. i + T - 1``.
    """
    if positions < 1:
        raise ValueError(f"positions must be >= 1, got {positions}")
    rows = top_k.to(torch.int64).cpu()
    sizes = []
    for first in range(rows.shape[0] - positions + 1):
        window = rows[first : first + positions]
        sizes.append(torch.unique(window[window >= 0]).numel())
    return torch.tensor(sizes, dtype=torch.int64)


@dataclasses.dataclass(frozen=True)
class WorkloadStats:
    """What :func:`measure` found: means over every request and layer, after the warm-up steps.

    Attributes:
        overlap: mean share of a step's top-k also selected the step before.
        jaccard: mean Jaccard similarity of consecutive top-k sets.
        lru_miss: buffer slots -> exact-LRU miss rate (distinct misses / lookups).
        context_len: prompt length of the measured requests.
        verify_union: verify positions ``T`` -> (median, largest) distinct tokens of ``T`` consecutive steps
            (:func:`verify_unions`), for the ``T`` asked for.
    """

    overlap: float
    jaccard: float
    lru_miss: dict[int, float]
    context_len: int
    verify_union: dict[int, tuple[int, int]] = dataclasses.field(default_factory=dict)

    def as_dict(self) -> dict:
        return {
            "context_len": self.context_len,
            "overlap": round(self.overlap, 4),
            "jaccard": round(self.jaccard, 4),
            "lru_miss": {str(slots): round(rate, 4) for slots, rate in self.lru_miss.items()},
            "verify_union": {str(t): list(sizes) for t, sizes in self.verify_union.items()},
        }


def measure(
    workload: TopKWorkload,
    *,
    context_len: int | None = None,
    requests: int = 3,
    layers: int = 2,
    steps: int = 192,
    warmup: int = 64,
    buffer_multiples: Iterable[float] = (1, 2, 4),
    verify_positions: Iterable[int] = (),
) -> WorkloadStats:
    """Persistence and exact-LRU miss rates of ``workload`` for ``requests x layers`` streams of
    ``warmup + steps`` decode steps after a prompt of ``context_len`` (default: the parameters').
    The buffers start empty; the first ``warmup`` steps fill them and are not counted. For each ``T`` of
    ``verify_positions``, the median and largest union of ``T`` consecutive counted steps."""
    p = workload.params
    context_len = p.context_len if context_len is None else context_len
    seq_lens = torch.arange(context_len + 1, context_len + 1 + warmup + steps, dtype=torch.int64)
    buffers = sorted({int(round(m * p.top_k)) for m in buffer_multiples})
    overlaps, jaccards = [], []
    looked = {slots: 0 for slots in buffers}
    missed = {slots: 0 for slots in buffers}
    unions = {positions: [] for positions in sorted(set(verify_positions))}
    for request in range(requests):
        for layer in range(layers):
            rows = workload.stream(request, context_len, layer, seq_lens)
            overlap, jaccard = step_overlap(rows[warmup:])
            overlaps.append(overlap)
            jaccards.append(jaccard)
            for positions, sizes in unions.items():
                sizes.append(verify_unions(rows[warmup:], positions))
            for slots in buffers:
                counts = lru_misses(rows, seq_lens, slots)
                looked[slots] += int(counts.lookups[warmup:].sum())
                missed[slots] += int(counts.misses[warmup:].sum())
    overlap = float(torch.cat(overlaps).mean()) if overlaps else 0.0
    jaccard = float(torch.cat(jaccards).mean()) if jaccards else 0.0
    verify_union = {}
    for positions, sizes in unions.items():
        every = torch.cat(sizes) if sizes else torch.zeros(0, dtype=torch.int64)
        if every.numel():
            verify_union[positions] = (int(every.median()), int(every.max()))
    return WorkloadStats(
        overlap, jaccard, {s: missed[s] / looked[s] if looked[s] else 0.0 for s in buffers}, context_len,
        verify_union,
    )


# --------------------------------------------------------------------------------------------- CLI
# Command-line flag of each parameter (the others: --name-with-dashes). top_k and seed are
# prefixed so that a tool with its own --top-k or --seed can take these too; drift says what drifts.
_FLAGS = {"top_k": "--workload-top-k", "seed": "--workload-seed", "drift": "--topic-drift"}
_HELP = {
    "top_k": "entries per step",
    "context_len": "prompt length",
    "sinks": "attention sinks always selected",
    "recent_window": "newest positions always selected",
    "persistence": "target step-to-step overlap",
    "topic_size": "candidates per channel",
    "topic_skew": "Zipf exponent of a channel's draw",
    "drift": "share of the topical set replaced per step",
    "seed": "workload seed",
}


def add_workload_arguments(
    parser: argparse.ArgumentParser,
    default_profile: str = "calibrated",
    extra_profiles: Sequence[str] = (),
    exclude: Sequence[str] = (),
) -> None:
    """``--profile`` and one flag per :class:`WorkloadParams` field but ``exclude`` (unset: the
    profile's value); :func:`params_from_args` reads them back."""
    group = parser.add_argument_group("top-k workload (hisparse_sglang.testing.workload)")
    group.add_argument(
        "--profile",
        choices=list(extra_profiles) + list(PROFILES),
        default=default_profile,
        help="top-k workload profile (default %(default)s); the flags below override its values",
    )
    for field in dataclasses.fields(WorkloadParams):
        if field.name in exclude:
            continue
        kind = int if field.type in ("int", int) else float
        flag = _FLAGS.get(field.name, "--" + field.name.replace("_", "-"))
        group.add_argument(
            flag,
            dest=f"workload_{field.name}",
            type=kind,
            default=None,
            help=f"{_HELP[field.name]} (default: the profile's)",
        )


def params_from_args(args: argparse.Namespace, **fixed) -> WorkloadParams:
    """The parameters ``add_workload_arguments`` parsed, ``fixed`` (name -> value) applied last."""
    overrides = {
        field.name: getattr(args, f"workload_{field.name}", None) for field in dataclasses.fields(WorkloadParams)
    }
    overrides.update(fixed)
    return profile(args.profile, **overrides)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Measure a top-k workload profile: step-to-step persistence and exact-LRU miss rates."
    )
    add_workload_arguments(parser)
    parser.add_argument("--requests", type=int, default=3, help="requests measured (default %(default)s)")
    parser.add_argument("--layers", type=int, default=2, help="layers per request (default %(default)s)")
    parser.add_argument("--steps", type=int, default=192, help="decode steps counted (default %(default)s)")
    parser.add_argument("--warmup", type=int, default=64, help="decode steps before counting (default %(default)s)")
    parser.add_argument(
        "--buffers", default="1,2,4", help="LRU buffer sizes in multiples of top_k (default %(default)s)"
    )
    parser.add_argument(
        "--contexts", default="", help="comma list of prompt lengths to measure instead of --context-len"
    )
    parser.add_argument(
        "--verify-positions", default="",
        help="comma list of speculative verify positions T: also report the median and largest number of distinct "
             "tokens T consecutive steps name (what one request's buffer must hold in a verify)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object per context instead of a table")
    args = parser.parse_args(argv)
    try:
        params = params_from_args(args)
        buffers = [float(x) for x in args.buffers.split(",") if x.strip()]
        contexts = [int(x) for x in args.contexts.split(",") if x.strip()] or [params.context_len]
        verify = [int(x) for x in args.verify_positions.split(",") if x.strip()]
        if any(t < 1 for t in verify):
            raise ValueError(f"--verify-positions must be >= 1 each, got {args.verify_positions}")
    except (WorkloadParamError, ValueError) as error:
        parser.error(str(error))
    torch.set_num_threads(1)  # small tensors: one thread is faster than two contending ones
    workload = TopKWorkload(params)
    print(f"profile {args.profile}: {json.dumps(dataclasses.asdict(params))}")
    print(
        f"solved: channel switch rate {workload.switch_rate:.4f} (dwell geometric theta {workload.dwell_theta:.4f})"
        + ("" if workload.reachable else "; persistence out of the model's reach, clamped")
    )
    labels = ["k" if m == 1 else f"{m:g}k" for m in buffers]
    header = (
        "| context | overlap | jaccard | " + " | ".join(f"LRU miss {label}" for label in labels)
        + "".join(f" | union of {t} steps, median / max" for t in verify) + " | seconds |"
    )
    if not args.json:
        print(header)
        print("|" + "---|" * (header.count("|") - 1))
    for context in contexts:
        started = time.monotonic()
        stats = measure(
            workload,
            context_len=context,
            requests=args.requests,
            layers=args.layers,
            steps=args.steps,
            warmup=args.warmup,
            buffer_multiples=buffers,
            verify_positions=verify,
        )
        if args.json:
            print(json.dumps(stats.as_dict()))
            continue
        cells = " | ".join(f"{100 * stats.lru_miss[int(round(m * params.top_k))]:.1f} %" for m in buffers)
        cells += "".join(
            " | {} / {}".format(*stats.verify_union[t]) if t in stats.verify_union else " | –" for t in verify
        )  # – : fewer counted steps than T
        print(f"| {context} | {stats.overlap:.3f} | {stats.jaccard:.3f} | {cells} | {time.monotonic() - started:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
