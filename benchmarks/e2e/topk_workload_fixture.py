"""Test fixture for the end-to-end benchmark: the DSA indexer's decode top-k replaced by the top-k
workload model (src/hisparse_sglang/testing/workload.py), identically in every arm.

A second SGLang general plugin (entry point ``hisparse_e2e_topk_workload`` of the fixture dist-info
that run_e2e.py puts on EVERY server's path, next to hisparse_e2e_fixture.py). Off unless
``HISPARSE_E2E_TOPK_PROFILE`` names a profile (random, calibrated, high-locality, low-locality);
``HISPARSE_E2E_TOPK_PARAMS`` is a JSON object of parameter overrides, e.g.
``{"persistence": 0.6, "context_len": 16384}`` (``context_len`` is what the persistence is solved
for: set it to the benchmark's prompt length). run_e2e.py sets both on every arm from
``--topk-profile`` and ``--topk-params``.

Why: the tiny model with dummy weights selects nearly random tokens (22 % LRU hits at saturation),
so its HiSparse figures say little about a real DSA model; the workload model has a real model's
locality, and every arm (no HiSparse, SGLang's HiSparse, the plugin) attends to the same positions
for the same request, layer and step.

Design (SGLang 0.5.17; every target is checked by tests/test_topk_workload_fixture.py):

* **What is replaced**: the return value of ``Indexer.forward_cuda``
  (``sglang.srt.layers.attention.dsa.dsa_indexer``), int32 ``[tokens, index_topk]``, for the batches
  the indexer serves through its paged top-k: decode (a draft model's decode steps too), and under
  speculative decoding the target's verify and the V2 draft extend (prefill, the draft model's
  included, keeps the real indexer). The indexer still runs first (it also stores the new
  token's index key), so every arm pays for it alike.
* **Rows under speculation**: a verify (or V2 draft extend) batch has ``T`` rows per request
  (``speculative_num_draft_tokens``), request-major; row ``i`` of a request attends to the length
  the indexer itself masks it to, ``metadata.get_seqlens_expanded()`` (its committed length plus
  ``i + 1``), and gets the workload's rows for that length: what a decode at that position would get.
* **Layout**: with HiSparse (arms b, c, d) the decode top-k is *positions* in ``[0, seq_len)`` (the
  swap-in translates them); without it (arm a) SGLang fuses the page-table transform into the top-k
  (``SGLANG_DSA_FUSE_TOPK``) and the indexer returns *KV locations*. The backend's own rule decides
  (``get_indexer_metadata(...).force_unfused_topk``): positions are translated through
  ``req_to_token`` when it returns locations, as the fused kernel does. A verify of the plugin (arms c, d
  with MTP, SGLang 0.5.17 - 0.5.21) runs SGLang's fused top-k through the plugin's verify page table
  (the metadata's ``verify_page_table``: resident requests' device pages, the identity for offloaded
  ones): positions go through that table per row, as the fused kernel maps them. -1 stays -1. (The
  fixture asks the backend for the metadata again, so the plugin builds that table twice at a forward's
  first layer: one small extra launch per forward, in the plugin's arms only.)
* **Request identity**: a GPU table per request slot of (request key, original prompt length). The
  key is the CRC-32 of the prompt's token ids (``Req.origin_input_ids``: the same in every arm, after
  a retraction and on a PD decode instance, unlike the request slot or a generated rid). A BEFORE
  hook on the worker the scheduler calls with its batch (``TpModelWorker.forward_batch_generation``,
  or ``EAGLEWorkerV2.forward_batch_generation`` under speculation, whose target forward gets no
  batch) writes the entries whose slot changed occupant, from pinned memory, on the stream the
  forward then runs on (the forward stream under the overlap scheduler), so the write is ordered
  before the forward that reads it. A PD decode instance runs its decode batches through the same
  call (its prebuilt batch never reaches the model).
* **Step**: ``forward_batch.seq_lens`` in decode (the length including the token being decoded).
* **CUDA graphs**: the wrapper runs eagerly in the warm-up runs and once at capture; everything it
  enqueues is tensor work on the graph's static inputs (``req_pool_indices``, ``seq_lens``), the
  slot table and the workload's lookup tables, which are built in the first (eager) call. A replay
  computes the rows of the new batch on the GPU: integer hash arithmetic, no host sync, bit-identical
  to the CPU generator. One fused Triton kernel per layer (5-10 us on an H100); the torch generator's
  own operations (about a hundred kernels, ~0.2-0.3 ms a layer) are the fallback
  (``HISPARSE_E2E_TOPK_GENERATOR=torch`` or no Triton).
* **Scope**: the modes above (not mixed chunked-prefill batches, off in the harness); EAGLE with
  ``topk 1`` (the only speculation the plugin serves); context parallel, attention TP with padded
  rows and ``flashinfer_sparse_mla`` decode were not read for it.

``python benchmarks/e2e/topk_workload_fixture.py --bench`` (on a GPU, no SGLang needed) checks that
the CUDA rows equal the CPU rows under CUDA-graph replay and times the replacement per layer.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

try:  # the fused generator (GPU); without Triton the torch generator runs (about 100 small kernels a layer)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - every SGLang server has Triton
    triton = None

PREFIX = "[hisparse-e2e-topk]"
ENV_PROFILE = "HISPARSE_E2E_TOPK_PROFILE"
ENV_PARAMS = "HISPARSE_E2E_TOPK_PARAMS"
# "fused" (default where Triton is importable: one kernel a layer) or "torch" (the generator's own
# tensor operations, about a hundred kernels a layer); both give the same rows.
ENV_GENERATOR = "HISPARSE_E2E_TOPK_GENERATOR"
# The workload's profiles (tests check they are workload.PROFILES); "off" disables the fixture.
PROFILE_NAMES = ("random", "calibrated", "high-locality", "low-locality")
OFF = "off"
# workload.py as benchmarks/e2e/arms.py copies it next to this module (servers without the package).
WORKLOAD_COPY = "hisparse_topk_workload"
# Hook targets, written against SGLang 0.5.17.
INDEXER_TARGET = "sglang.srt.layers.attention.dsa.dsa_indexer.Indexer.forward_cuda"
WORKER_TARGET = "sglang.srt.managers.tp_worker.TpModelWorker.forward_batch_generation"
# Under EAGLE the scheduler calls this one with its batch; the target's verify forward gets none.
SPEC_WORKER_TARGET = "sglang.srt.speculative.eagle_worker_v2.EAGLEWorkerV2.forward_batch_generation"
ATTN_BACKEND_GETTER = "sglang.srt.model_executor.forward_context.get_attn_backend"
# Cached on each Req: its key (the prompt never changes).
REQ_KEY_ATTR = "_hisparse_topk_workload_key"
# Indexer.forward_cuda(self, x, q_lora, positions, forward_batch, layer_id, return_indices=True):
# where forward_batch and layer_id are among the arguments after self when passed positionally.
_FORWARD_BATCH_INDEX, _LAYER_ID_INDEX = 3, 4


def _say(message: str) -> None:
    print(f"{PREFIX} pid={os.getpid()} {message}", file=sys.stderr, flush=True)


def load_workload_module():
    """The workload model: the copy next to this module on a server, else the package's."""
    import importlib

    try:
        return importlib.import_module(WORKLOAD_COPY)
    except ImportError:
        return importlib.import_module("hisparse_sglang.testing.workload")


def params_from_env(environ=None):
    """``(WorkloadParams, top_k_given)`` the environment asks for, ``(None, False)`` when the fixture
    is off. Without a ``top_k`` in HISPARSE_E2E_TOPK_PARAMS (``top_k_given`` False) the model's
    ``index_topk`` replaces the profile's at the first decode.

    Raises:
        ValueError: an unknown profile, or HISPARSE_E2E_TOPK_PARAMS not a JSON object of parameters.
    """
    environ = os.environ if environ is None else environ
    name = environ.get(ENV_PROFILE, "").strip().lower()
    if name in ("", OFF):
        return None, False
    if name not in PROFILE_NAMES:
        raise ValueError(f"{ENV_PROFILE}={name!r}: choose one of {', '.join(PROFILE_NAMES)} or {OFF}.")
    raw = environ.get(ENV_PARAMS, "").strip() or "{}"
    overrides = json.loads(raw)
    if not isinstance(overrides, dict):
        raise ValueError(f"{ENV_PARAMS} must be a JSON object of workload parameters, got {raw!r}.")
    workload = load_workload_module()
    known = {f for f in workload.WorkloadParams.__dataclass_fields__}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"{ENV_PARAMS}: unknown parameter(s) {unknown}; known: {sorted(known)}.")
    return workload.profile(name, **overrides), "top_k" in overrides


def workload_env(profile: str, params_json: str) -> dict[str, str]:
    """The environment run_e2e.py gives every server for ``--topk-profile`` / ``--topk-params``."""
    if profile == OFF:
        return {}
    return {ENV_PROFILE: profile, ENV_PARAMS: params_json or "{}"}


def request_key(req) -> int:
    """A request's key (CRC-32 of its prompt token ids), cached on the Req."""
    key = getattr(req, REQ_KEY_ATTR, None)
    if key is None:
        key = load_workload_module().request_key_from_tokens(req.origin_input_ids)
        setattr(req, REQ_KEY_ATTR, key)
    return key


class SlotKeys:
    """(request key, original prompt length) per request slot, int64 ``[slots, 2]`` on ``device``.

    ``update`` writes only the slots whose occupant changed since the last call, from pinned host
    memory without a host wait (the caching host allocator keeps the staging memory until the copy
    is done); rows of slots never written are (0, 0).
    """

    def __init__(self, num_slots: int, device) -> None:
        import torch

        self.device = torch.device(device)
        self.table = torch.zeros((num_slots, 2), dtype=torch.int64, device=self.device)
        self._host: list[tuple[int, int] | None] = [None] * num_slots
        self.writes = 0

    def update(self, entries) -> int:
        """``entries``: (slot, key, prompt length) triples; returns how many slots were written."""
        import torch

        changed = {}
        for slot, key, prompt_len in entries:
            value = (int(key), int(prompt_len))
            if self._host[slot] != value:
                changed[int(slot)] = value
        if not changed:
            return 0
        slots = torch.tensor(list(changed), dtype=torch.int64)
        values = torch.tensor(list(changed.values()), dtype=torch.int64)
        if self.device.type == "cuda":
            slots, values = slots.pin_memory(), values.pin_memory()
        self.table.index_copy_(0, slots.to(self.device, non_blocking=True), values.to(self.device, non_blocking=True))
        for slot, value in changed.items():
            self._host[slot] = value
        self.writes += len(changed)
        return len(changed)


def replacement_topk(
    workload, table, req_pool_indices, seq_lens, layer_id: int, rows: int, req_to_token=None, page_table=None,
    page_size: int = 0,
):
    """The decode top-k of a batch from the workload: int32 ``[rows, top_k]``.

    Args:
        workload: a ``TopKWorkload`` whose lookup tables already live on the device.
        table: int64 ``[slots, 2]`` (key, prompt length) per request slot (:class:`SlotKeys`).
        req_pool_indices, seq_lens: int ``[>= count]``, the batch (a CUDA graph's static inputs,
            padding rows included).
        layer_id: the layer.
        rows: rows of the indexer's output; rows past ``req_pool_indices`` are -1.
        req_to_token: int32 ``[slots, context]`` to return KV locations (the fused top-k layout)
            instead of positions; None: positions.
        page_table, page_size: int32 ``[>= rows, pages]`` and its page size, to return ``page_table[row, p //
            page_size] * page_size + p % page_size`` of each position ``p`` (SGLang's fused v2 top-k through
            the table it is given: hisparse-sglang's verify page table); None: not used.
    """
    import torch

    count = min(rows, req_pool_indices.shape[0])
    slots = req_pool_indices[:count].to(torch.int64)
    keyed = table[slots]
    positions = workload.topk(keyed[:, 0], keyed[:, 1], seq_lens[:count], layer_id)
    if req_to_token is not None:
        locations = req_to_token[slots.reshape(-1, 1), positions.clamp(min=0)].to(torch.int64)
        positions = torch.where(positions >= 0, locations, torch.full_like(positions, -1))
    elif page_table is not None:
        pages = page_table[:count].to(torch.int64).gather(1, positions.clamp(min=0) // page_size)
        positions = torch.where(positions >= 0, pages * page_size + positions % page_size, torch.full_like(positions, -1))
    out = torch.full((rows, workload.params.top_k), -1, dtype=torch.int32, device=positions.device)
    out[:count] = positions.to(torch.int32)
    return out


# ------------------------------------------------------------------------------------ fused twin
# One Triton kernel computing what TopKWorkload.topk computes (the same integer hash and tables, so
# the same bits) and, for the locations layout, the req_to_token translation: one launch per layer
# instead of about a hundred elementwise kernels. tests/test_topk_workload_fixture.py checks it
# against the torch generator in Triton's interpreter, ``--bench`` on a GPU.
if triton is not None:

    @triton.jit
    def _mix32(x):
        """workload._mix32 on uint32 (products wrap mod 2**32, as the int64 version masks them)."""
        x = x ^ (x >> 16)
        x = x * 0x7FEB352D
        x = x ^ (x >> 15)
        x = x * 0x1B873593
        return x ^ (x >> 16)

    @triton.jit
    def _spread(x):
        """workload._spread: the low 32 bits of a non-negative int64 times the golden constant."""
        return (x & 0xFFFFFFFF).to(tl.uint32) * 0x61C88647

    @triton.jit
    def _count_at_most(table_ptr, length, value, LOG2: tl.constexpr):
        """How many entries of a non-decreasing int64 table are <= value (searchsorted, right=True)."""
        found = tl.zeros(value.shape, dtype=tl.int64)
        for level in tl.static_range(LOG2):
            candidate = found + (1 << (LOG2 - 1 - level))
            inside = candidate <= length
            entry = tl.load(table_ptr + candidate - 1, mask=inside, other=0)
            found = tl.where(inside & (entry <= value), candidate, found)
        return found

    # Scalars that may be 1 (layer 1, a batch of one) are not specialised: a specialised 1 would
    # become a compile-time constant (and a new compilation per value).
    @triton.jit(do_not_specialize=["layer", "row_salt", "count", "dwell_len", "rank_len"])
    def _workload_topk_kernel(
        out_ptr,
        table_ptr,
        slots_ptr,
        seq_lens_ptr,
        req_to_token_ptr,
        req_to_token_stride,
        page_table_ptr,
        page_table_stride,
        dwell_ptr,
        dwell_len,
        rank_ptr,
        rank_len,
        layer,
        row_salt,
        count,
        TOP_K: tl.constexpr,
        SINKS: tl.constexpr,
        WINDOW: tl.constexpr,
        PERIOD: tl.constexpr,
        LOCATIONS: tl.constexpr,
        PAGE_SIZE: tl.constexpr,
        DWELL_LOG2: tl.constexpr,
        RANK_LOG2: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row_index = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        in_row = cols < TOP_K
        real = row_index < count
        slot = tl.load(slots_ptr + row_index, mask=real, other=0).to(tl.int64)
        n = tl.load(seq_lens_ptr + row_index, mask=real, other=1).to(tl.int64)
        key = tl.load(table_ptr + slot * 2, mask=real, other=0)
        prompt = tl.load(table_ptr + slot * 2 + 1, mask=real, other=0)
        channels = TOP_K - SINKS - WINDOW
        key32 = ((key & 0xFFFFFFFF) ^ ((key >> 32) & 0xFFFFFFFF)).to(tl.uint32)
        row = _mix32(_mix32(key32 ^ row_salt.to(tl.uint32)) ^ _spread(layer.to(tl.int64)))
        j = (cols - SINKS - WINDOW).to(tl.int64)
        channel = _mix32(row ^ _spread(tl.maximum(j, 0)))
        dwell = _count_at_most(dwell_ptr, dwell_len, _mix32(channel ^ 0x68E31DA4).to(tl.int64), DWELL_LOG2) + 1
        epoch = (n + channel.to(tl.int64) % dwell) // dwell
        pick = _mix32(_mix32(channel ^ 0x1B56C4E9) ^ _spread(epoch)).to(tl.int64)
        rank = _count_at_most(rank_ptr, rank_len, pick, RANK_LOG2)
        birth = _mix32(channel ^ 0x5F356495 ^ _spread(rank))
        floor_len = tl.maximum(prompt, TOP_K + 1)
        if PERIOD > 0:
            phase = birth.to(tl.int64) % PERIOD
            generation = (n + phase) // PERIOD
            born_at = tl.maximum(generation * PERIOD - phase, floor_len)
        else:
            generation = tl.zeros(cols.shape, dtype=tl.int64)
            born_at = floor_len + generation
        owned = (born_at - WINDOW - SINKS - j + channels - 1) // channels
        place = _mix32(birth ^ _spread(generation + 0x3C6EF372)).to(tl.int64)
        positions = SINKS + j + channels * ((place * owned) >> 32)
        positions = tl.where(cols < SINKS, cols.to(tl.int64), positions)
        positions = tl.where((cols >= SINKS) & (cols < SINKS + WINDOW), n - WINDOW + (cols - SINKS), positions)
        everything = tl.where(cols.to(tl.int64) < n, cols.to(tl.int64), -1)
        positions = tl.where(n > TOP_K, positions, everything)
        if LOCATIONS:
            valid = positions >= 0
            located = tl.load(
                req_to_token_ptr + slot * req_to_token_stride + tl.maximum(positions, 0),
                mask=valid & in_row & real,
                other=-1,
            )
            positions = tl.where(valid, located.to(tl.int64), -1)
        if PAGE_SIZE > 0:
            valid = positions >= 0
            safe = tl.maximum(positions, 0)
            page = tl.load(
                page_table_ptr + row_index.to(tl.int64) * page_table_stride + safe // PAGE_SIZE,
                mask=valid & in_row & real,
                other=-1,
            )
            positions = tl.where(valid, page.to(tl.int64) * PAGE_SIZE + safe % PAGE_SIZE, -1)
        positions = tl.where(real, positions, -1)
        tl.store(out_ptr + row_index * TOP_K + cols, positions.to(tl.int32), mask=in_row)


_FUSED_BLOCK = 256


def fused_replacement_topk(
    workload, table, req_pool_indices, seq_lens, layer_id: int, rows: int, req_to_token=None, page_table=None,
    page_size: int = 0,
):
    """:func:`replacement_topk` in one Triton launch (same arguments, same result)."""
    import torch

    params = workload.params
    dwell_table, rank_table = workload.tables(seq_lens.device)
    out = torch.empty((rows, params.top_k), dtype=torch.int32, device=seq_lens.device)
    count = min(rows, req_pool_indices.shape[0])
    locations = req_to_token is not None
    if not locations:
        req_to_token = table  # not read
    if locations or page_table is None:
        page_table, page_size = table, 0  # not read
    row_salt = workload_row_salt(workload)
    grid = (rows, -(-params.top_k // _FUSED_BLOCK))
    _workload_topk_kernel[grid](
        out,
        table,
        req_pool_indices,
        seq_lens,
        req_to_token,
        req_to_token.stride(0),
        page_table,
        page_table.stride(0),
        dwell_table,
        dwell_table.numel(),
        rank_table,
        rank_table.numel(),
        layer_id,
        row_salt,
        count,
        TOP_K=params.top_k,
        SINKS=params.sinks,
        WINDOW=params.recent_window,
        PERIOD=workload.generation_period,
        LOCATIONS=locations,
        PAGE_SIZE=page_size,
        DWELL_LOG2=max(1, (dwell_table.numel()).bit_length()),
        RANK_LOG2=max(1, (rank_table.numel()).bit_length()),
        BLOCK=_FUSED_BLOCK,
    )
    return out


def workload_row_salt(workload) -> int:
    """The seed's part of the per-row hash (workload.TopKWorkload.topk: mix32(seed ^ SALT_ROW))."""
    module = load_workload_module()
    return module._mix32(workload.params.seed ^ module._SALT_ROW)


def backend_req_to_token(backend):
    """The request-to-token table the DSA backend's fused top-k transform reads: SGLang 0.5.17's
    ``ForwardBatch`` carries no pool, the backend keeps ``model_runner.req_to_token_pool``."""
    pool = getattr(backend, "req_to_token_pool", None)
    if pool is None:
        raise RuntimeError(
            f"{PREFIX} the attention backend {type(backend).__name__} has no req_to_token_pool; the top-k "
            "fixture serves the DSA backend (--attention-backend dsa)."
        )
    return pool.req_to_token


def speculative_rows(backend, metadata, req_pool_indices, rows: int):
    """Per-row (request slot, length) of a verify or V2 draft-extend batch: ``T`` rows per request,
    request-major (``T = backend.speculative_num_draft_tokens``), each row's length the one the
    indexer masks it to (``metadata.get_seqlens_expanded()``). A slice and an expanded copy of the
    static inputs: nothing that syncs or changes shape between CUDA-graph replays.

    Raises:
        RuntimeError: the batch is not ``T`` rows per request (padded rows, topk > 1 trees).
    """
    per = int(getattr(backend, "speculative_num_draft_tokens", 0) or 0)
    count = req_pool_indices.shape[0]
    if per < 1 or rows != count * per:
        raise RuntimeError(
            f"{PREFIX} a speculative batch of {rows} indexer rows for {count} requests, with "
            f"speculative_num_draft_tokens {per}: the fixture serves {per or 'T'} rows per request "
            "(EAGLE topk 1, no attention TP padding)."
        )
    lens = metadata.get_seqlens_expanded()[:rows]
    return req_pool_indices[:, None].expand(count, per).reshape(rows), lens


class TopKReplacement:
    """The state the two hooks share (one per scheduler process)."""

    def __init__(self, params, top_k_given: bool = False) -> None:
        self.params = params
        self.top_k_given = top_k_given
        self.workload = None
        self.keys: SlotKeys | None = None
        self._logged_layouts: set[str] = set()

    # -------------------------------------------------------------------------- shared state
    def _ensure_keys(self, num_slots: int, device) -> SlotKeys:
        if self.keys is None:
            self.keys = SlotKeys(num_slots, device)
        return self.keys

    def _ensure_workload(self, index_topk: int, device):
        import torch

        if self.workload is None:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    f"{PREFIX} the first decode top-k came inside a CUDA graph capture; the workload's tables "
                    "must be built in an eager run first (SGLang 0.5.17 warms up before it captures)."
                )
            params = self.params
            if params.top_k != index_topk:
                if self.top_k_given:
                    raise RuntimeError(
                        f"{ENV_PARAMS} top_k {params.top_k} differs from the model's index_topk "
                        f"{index_topk}; drop it or set {index_topk}."
                    )
                params = params.replace(top_k=index_topk)
            self.workload = load_workload_module().TopKWorkload(params)
            self.workload.tables(device)
            _say(
                f"decode top-k from the workload model: {json.dumps(dataclasses.asdict(params))} "
                f"(channel switch rate {self.workload.switch_rate:.4f})"
            )
        return self.workload

    # -------------------------------------------------------------------------- hooks
    def before_forward(self, worker, batch=None, *args, **kwargs):
        """BEFORE ``TpModelWorker.forward_batch_generation`` and ``EAGLEWorkerV2.forward_batch_generation``:
        bring the slot table up to date for a decode batch (under EAGLE the scheduler's decode batch,
        which the worker turns into draft and verify forwards). Returns None (the arguments are unchanged).
        """
        if batch is None or not batch.forward_mode.is_decode() or not batch.reqs:
            return None
        runner = worker.model_runner if hasattr(worker, "model_runner") else worker.target_worker.model_runner
        req_to_token = runner.req_to_token_pool.req_to_token
        keys = self._ensure_keys(req_to_token.shape[0], req_to_token.device)
        keys.update((req.req_pool_idx, request_key(req), len(req.origin_input_ids)) for req in batch.reqs)
        return None

    def around_indexer(self, original, indexer, *args, **kwargs):
        """AROUND ``Indexer.forward_cuda``: the real indexer, then, for decode, verify and the V2 draft
        extend, the workload's rows."""
        result = original(indexer, *args, **kwargs)
        forward_batch = kwargs.get(
            "forward_batch", args[_FORWARD_BATCH_INDEX] if len(args) > _FORWARD_BATCH_INDEX else None
        )
        layer_id = kwargs.get("layer_id", args[_LAYER_ID_INDEX] if len(args) > _LAYER_ID_INDEX else None)
        if result is None or forward_batch is None:
            return result
        mode = forward_batch.forward_mode
        speculative = mode.is_target_verify() or mode.is_draft_extend_v2()
        if not (mode.is_decode() or speculative):
            return result
        from sglang.srt.model_executor.forward_context import get_attn_backend

        backend = get_attn_backend()
        req_to_token = backend_req_to_token(backend)
        keys = self._ensure_keys(req_to_token.shape[0], req_to_token.device)
        workload = self._ensure_workload(indexer.index_topk, result.device)
        metadata = backend.get_indexer_metadata(layer_id, forward_batch)
        # hisparse-sglang's verify runs SGLang's fused top-k through its own page table (resident requests'
        # device pages, the identity for offloaded ones): the rows go through that table.
        page_table = getattr(metadata, "verify_page_table", None)
        locations = not metadata.force_unfused_topk and page_table is None
        rows = result.shape[0]
        if speculative:
            slots, lens = speculative_rows(backend, metadata, forward_batch.req_pool_indices, rows)
        else:
            slots, lens = forward_batch.req_pool_indices, forward_batch.seq_lens
        layout = f"{mode.name.lower()} {'locations' if locations else 'positions'}"
        if page_table is not None:
            layout = f"{mode.name.lower()} verify page table"
        if layout not in self._logged_layouts:
            self._logged_layouts.add(layout)
            _say(f"top-k layout: {layout} (layer {layer_id}, {rows} rows, {keys.table.shape[0]} slots)")
        generate = self.generator(result.device)
        out = generate(
            workload, keys.table, slots, lens, layer_id, rows, req_to_token if locations else None, page_table,
            metadata.attn_metadata.page_size if page_table is not None else 0,
        )
        return out.to(result.dtype)

    @staticmethod
    def generator(device):
        """The fused kernel on a GPU with Triton (unless HISPARSE_E2E_TOPK_GENERATOR=torch), else torch."""
        if device.type == "cuda" and triton is not None and os.environ.get(ENV_GENERATOR, "fused") != "torch":
            return fused_replacement_topk
        return replacement_topk


def register() -> None:
    """Entry point (group ``sglang.srt.plugins``): the hooks when a profile is set, else nothing."""
    params, top_k_given = params_from_env()
    if params is None:
        _say(f"off ({ENV_PROFILE} unset or {OFF})")
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    replacement = TopKReplacement(params, top_k_given)
    HookRegistry.register(WORKER_TARGET, replacement.before_forward, HookType.BEFORE)
    HookRegistry.register(SPEC_WORKER_TARGET, replacement.before_forward, HookType.BEFORE)
    HookRegistry.register(INDEXER_TARGET, replacement.around_indexer, HookType.AROUND)
    _say(
        f"profile {os.environ[ENV_PROFILE]}: BEFORE hooks on {WORKER_TARGET} and {SPEC_WORKER_TARGET}, "
        f"AROUND hook on {INDEXER_TARGET}"
    )


# ------------------------------------------------------------------------------------ GPU self-check
def bench(argv: list[str] | None = None) -> int:
    """Both generators' CUDA rows == the CPU rows under CUDA-graph replay, and their time per layer."""
    import torch

    parser = argparse.ArgumentParser(description="GPU self-check and timing of the top-k replacement")
    parser.add_argument("--bench", action="store_true")
    parser.add_argument("--profile", default="calibrated", choices=PROFILE_NAMES)
    parser.add_argument("--batches", default="1,8,32,64,128")
    parser.add_argument("--slots", type=int, default=256)
    parser.add_argument("--context", type=int, default=65536)
    parser.add_argument("--replays", type=int, default=200)
    args = parser.parse_args(argv)
    workload_module = load_workload_module()
    workload = workload_module.TopKWorkload(workload_module.profile(args.profile))
    device = torch.device("cuda")
    workload.tables(device)
    generator = torch.Generator().manual_seed(0)
    req_to_token = torch.randperm(args.slots * args.context, generator=generator).to(torch.int32)
    req_to_token = req_to_token.reshape(args.slots, args.context).to(device)
    layer_id = 1  # the value Triton would specialise a scalar argument on
    generators = {"torch": replacement_topk}
    if triton is not None:
        generators["fused"] = fused_replacement_topk
    print(f"{torch.cuda.get_device_name()}, profile {args.profile}, {args.slots} slots, context {args.context}")
    print(
        "| batch | generator | CUDA == CPU (positions, locations; 3 batches) | µs per layer (graph replay, positions) "
        "| µs per layer (locations) |"
    )
    print("|---|---|---|---|---|")
    failed = False
    for batch in [int(x) for x in args.batches.split(",")]:
        for name, generate in generators.items():
            keys = SlotKeys(args.slots, device)
            static_slots = torch.zeros(batch, dtype=torch.int64, device=device)
            static_lens = torch.ones(batch, dtype=torch.int64, device=device)
            graphs = []
            for translate in (None, req_to_token):
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for _ in range(2):  # warm-up, as SGLang does before it captures
                        generate(workload, keys.table, static_slots, static_lens, layer_id, batch, translate)
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    out = generate(workload, keys.table, static_slots, static_lens, layer_id, batch, translate)
                graphs.append((graph, out, translate))
            equal = True
            for _ in range(3):
                slots = torch.randperm(args.slots, generator=generator)[:batch]
                lens = torch.randint(1, args.context, (batch,), generator=generator)
                prompts = torch.clamp(lens - torch.randint(1, 4000, (batch,), generator=generator), min=1)
                request_keys = torch.randint(0, 2**32, (batch,), generator=generator)
                keys.update(zip(slots.tolist(), request_keys.tolist(), prompts.tolist()))
                static_slots.copy_(slots)
                static_lens.copy_(lens)
                for graph, out, translate in graphs:
                    graph.replay()
                    torch.cuda.synchronize()
                    want = replacement_topk(
                        workload,
                        keys.table.cpu(),
                        slots,
                        lens,
                        layer_id,
                        batch,
                        None if translate is None else translate.cpu(),
                    )
                    equal &= torch.equal(out.cpu(), want)
            times = []
            for graph, _, _ in graphs:
                graph.replay()
                torch.cuda.synchronize()
                started = time.perf_counter()
                for _ in range(args.replays):
                    graph.replay()
                torch.cuda.synchronize()
                times.append((time.perf_counter() - started) / args.replays * 1e6)
            print(f"| {batch} | {name} | {'yes' if equal else 'NO'} | {times[0]:.1f} | {times[1]:.1f} |")
            failed |= not equal
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(bench(sys.argv[1:]))
