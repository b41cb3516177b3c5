"""Test fixture for the end-to-end benchmark: checks, inside a server with the hisparse-sglang plugin,
that every KV row attention reads for a top-k position is that position's host row.

The harness copies this module next to ``hisparse_e2e_fixture.py`` (whose ``register`` installs it) and
turns it on with ``HISPARSE_E2E_KV_CHECK=<N>`` (``run_e2e.py --kv-check-every N``): every N-th decode
batch of the scheduler is checked. It is test code, off unless that variable is set, and never part
of the package.

How, under CUDA graphs (the decode forward is replayed, so Python around ``swap_in`` runs only while a
graph is captured):

* ``Coordinator.swap_in`` is wrapped so that each layer's call also copies its inputs and its result
  (the top-k positions, the request slots, the sequence lengths, the number of real requests and the
  device rows it returned) into fixed tensors of this module, with plain device copies that a captured
  graph replays;
* ``Scheduler.run_batch`` is wrapped: after every N-th decode batch it synchronizes the device and, for
  every real request and layer, compares the bytes of each returned device row with the host row of
  the position's logical location (``req_to_token``), i.e. what the host pool holds as the truth for
  that token. A valid top-k position without a device row counts as a mismatch too.

After each check it logs one line ``[hisparse-e2e-fixture] kv-check {json}`` with the totals so far
(checks, rows compared, mismatches, the first mismatch's layer/request/position) for the harness
(logs.parse_kv_check). The rows are compared after the forward, before the scheduler prepares the next
batch: nothing writes a layer's device rows after its attention in the same forward, so they are the
rows attention read (a speculative verify's commit does, for the newest token: see ``swap_in_verify`` below).

``HISPARSE_E2E_KERNEL_DEFINES=NAME=VALUE,...`` makes the plugin build its kernels with those extra
``-D`` macros (``hisparse_sglang.ops.jit.load_module(defines=...)``), e.g. the row-corrupting test
variant that the judge and this check must reject.
"""

from __future__ import annotations

import json
import os
import sys

PREFIX = "[hisparse-e2e-fixture]"
CHECK_ENV = "HISPARSE_E2E_KV_CHECK"
DEFINES_ENV = "HISPARSE_E2E_KERNEL_DEFINES"
MAX_RECORDED_BATCH = 256  # query rows beyond this are not recorded (the correctness phase runs bs 1)
MAX_POSITIONS = 4  # query rows per request of a speculative verify (--speculative-num-draft-tokens <= 4)


def _say(msg: str) -> None:
    print(f"{PREFIX} pid={os.getpid()} {msg}", file=sys.stderr, flush=True)


class Recorder:
    """What the last decode forward's swap-in calls took and returned, per layer (device tensors)."""

    def __init__(self, coordinator) -> None:
        import torch

        device = coordinator.device
        layers = len(coordinator.layer_tables)
        rows = min(coordinator.buffers.num_req_slots * MAX_POSITIONS, MAX_RECORDED_BATCH)
        k = coordinator.config.top_k
        self.coordinator = coordinator
        self.top_k = torch.full((layers, rows, k), -1, dtype=torch.int32, device=device)
        self.rows = torch.full((layers, rows, k), -1, dtype=torch.int32, device=device)
        self.slots = torch.zeros(rows, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(rows, dtype=torch.int64, device=device)
        # query rows whose top-k entries are device rows, not positions (a resident request's, with the fused
        # verify top-k through the verify page table)
        self.given = torch.zeros(rows, dtype=torch.bool, device=device)
        self.real = torch.zeros(1, dtype=torch.int32, device=device)
        self.batch = torch.zeros(1, dtype=torch.int32, device=device)
        self.capacity = rows
        self.positions = 1  # query positions per request of the recorded forward (speculative verify: T)
        self.checks = 0
        self.rows_checked = 0
        self.mismatches = 0
        self.given_checked = 0  # query rows checked whose entries were device rows
        self.first_mismatch: dict | None = None

    def _row_inverses(self, slots, seq_lens, given, layer_rows: int) -> dict[int, object]:
        """Per query row of ``given``: a map from device row to the request's position ``p < s + T`` whose
        location maps to that row (``device_row_of_loc``; a resident request's rows are its own), -1 for every
        other row. Rows of one request share theirs."""
        import torch

        coordinator = self.coordinator
        translate = coordinator.allocator.device_row_of_loc
        by_request: dict[tuple[int, int], object] = {}
        inverses = {}
        for row in given.nonzero().flatten().tolist():
            slot = int(slots[row])
            # recorded: s - 1; the verify's query rows see positions [0, s + T)
            span = min(int(seq_lens[row, 0]) + 1 + self.positions, coordinator.req_to_token.shape[1])
            if (slot, span) not in by_request:
                locations = coordinator.req_to_token[slot, :span].to(torch.int64)
                of_position = translate[locations].to(torch.int64)
                of_position = torch.where(of_position > 0, of_position, layer_rows)  # 0 / -1: no row
                inverse = torch.full((layer_rows + 1,), -1, dtype=torch.int64, device=of_position.device)
                inverse[of_position.clamp(max=layer_rows)] = torch.arange(span, device=of_position.device)
                inverse[layer_rows] = -1
                by_request[(slot, span)] = inverse
            inverses[row] = by_request[(slot, span)]
        return inverses

    @staticmethod
    def _positions_of_given_rows(entries, inverses: dict, layer_rows: int):
        """The position each device-row entry of the query rows in ``inverses`` stands for, and the entries
        that are no row of the request's range (``stray``: a wrong row, counted as a mismatch). Entries of other
        query rows stay as they are (positions)."""
        import torch

        positions = entries.clone()
        stray = torch.zeros_like(entries, dtype=torch.bool)
        for row, inverse in inverses.items():
            picked = entries[row]
            named = picked >= 0
            found = inverse[picked.clamp(min=0, max=layer_rows)]
            positions[row] = torch.where(named, found, picked)
            stray[row] = named & (found < 0)
        return positions, stray

    def record(self, layer: int, top_k, slots, seq_lens, rows, positions: int = 1, given=None) -> None:
        """One layer's swap-in: ``top_k`` / ``rows`` ``[B, K]``, ``slots`` / ``seq_lens`` ``[B]`` (a verify's
        ``B x T`` query rows flattened, each with its request's slot and committed length, ``positions = T``);
        ``given`` ``[B]`` bool: the rows whose entries are device rows (None: none)."""
        self.positions = positions
        batch = top_k.shape[0]
        if batch > self.capacity:
            self.batch.fill_(0)  # not recorded: the check skips this forward
            return
        self.top_k[layer, :batch, : top_k.shape[1]].copy_(top_k)
        self.rows[layer, :batch, : rows.shape[1]].copy_(rows)
        if layer == 0:
            self.slots[:batch].copy_(slots)
            self.seq_lens[:batch].copy_(seq_lens)
            if given is None:
                self.given[:batch].fill_(False)
            else:
                self.given[:batch].copy_(given)
            self.real.copy_(self.coordinator.num_real_reqs)
            self.batch.fill_(batch)

    def check(self) -> None:
        import torch

        if self.coordinator.device.type == "cuda":
            torch.cuda.synchronize(self.coordinator.device)
        batch = int(self.batch.item())
        real = min(int(self.real.item()) * self.positions, batch)
        if real <= 0:
            return
        coordinator = self.coordinator
        slots = self.slots[:real]
        seq_lens = self.seq_lens[:real].unsqueeze(1)
        given = self.given[:real]
        layer_rows = coordinator.device_layers[0].shape[0]
        inverses = self._row_inverses(slots, seq_lens, given, layer_rows) if bool(given.any()) else {}
        for layer in range(self.top_k.shape[0]):
            positions = self.top_k[layer, :real].to(torch.int64)
            rows = self.rows[layer, :real].to(torch.int64)
            positions, stray = self._positions_of_given_rows(positions, inverses, layer_rows)
            valid = (positions >= 0) & (positions < seq_lens)
            unserved = (valid & (rows < 0)) | stray
            served = valid & (rows >= 0)
            locations = coordinator.req_to_token[slots].to(torch.int64).gather(1, positions.clamp(min=0))
            device_bytes = coordinator.device_layers[layer][rows[served]].cpu()
            host_bytes = coordinator.host_layers[layer][locations[served].cpu()]
            differ = (device_bytes != host_bytes).any(dim=1)
            wrong = int(differ.sum()) + int(unserved.sum())
            self.rows_checked += int(valid.sum())
            if wrong and self.first_mismatch is None:
                where = served.nonzero().cpu()[differ] if int(differ.sum()) else unserved.nonzero().cpu()
                request, entry = (int(v) for v in where[0])
                self.first_mismatch = {
                    "check": self.checks, "layer": layer, "batch_row": request, "slot": int(slots[request]),
                    "position": int(positions[request, entry]), "device_row": int(rows[request, entry]),
                    "host_row": int(locations[request, entry]), "unserved": bool(unserved[request, entry]),
                    "given_row": bool(given[request]), "stray": bool(stray[request, entry]),
                }
            self.mismatches += wrong
        self.checks += 1
        self.given_checked += int(given.sum())
        _say("kv-check " + json.dumps({"checks": self.checks, "rows": self.rows_checked,
                                       "given_query_rows": self.given_checked,
                                       "mismatches": self.mismatches, "first_mismatch": self.first_mismatch}))


_RECORDERS: list[Recorder] = []  # one per coordinator of this process (one scheduler, one coordinator)


def _wrap_swap_in(core) -> None:
    original_init = core.Coordinator.__init__
    original_swap_in = core.Coordinator.swap_in

    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        self._kv_check = Recorder(self)
        _RECORDERS.append(self._kv_check)

    def swap_in(self, req_pool_indices, seq_lens, top_k, layer_id):
        rows = original_swap_in(self, req_pool_indices, seq_lens, top_k, layer_id)
        recorder = getattr(self, "_kv_check", None)
        if recorder is not None:
            recorder.record(layer_id, top_k, req_pool_indices, seq_lens, rows)
        return rows

    original_swap_in_verify = core.Coordinator.swap_in_verify

    def swap_in_verify(self, req_pool_indices, seq_lens, top_k, layer_id, resident_rows=False):
        """A verify forward: every position's history rows before ``s - 1`` (accepted and backed up by earlier
        steps) are checked. Not checked: the verify positions' own rows, whose host truth exists only once
        accepted, and position ``s - 1``, whose row (an offloaded request's slot ``D``) the same step's commit
        rewrites with the newest accepted token after attention has read it. With ``resident_rows`` (the fused
        top-k of SGLang 0.5.17 - 0.5.21 through the verify page table) a resident request's entries are device
        rows, not positions: they are recorded as given rows, and the check finds the position each stands for
        (the request's location mapped to that row) before comparing, a row of no position being a mismatch."""
        rows = original_swap_in_verify(self, req_pool_indices, seq_lens, top_k, layer_id, resident_rows)
        recorder = getattr(self, "_kv_check", None)
        if recorder is not None:
            import torch

            batch, positions, k = top_k.shape
            # A position the swap-in left out (its request's positions named more tokens than its buffer
            # holds: at or past the row's verify limit) has every row -1 and is never accepted: not checked.
            limit = self.speculative.verify_limit[:batch].to(torch.int64).reshape(-1, 1)
            served = torch.arange(positions, device=top_k.device).reshape(1, -1) < limit
            given = None
            if resident_rows:
                given = (self.buffers.buffer_of_req[req_pool_indices.to(torch.int64)] < 0).repeat_interleave(positions)
            top_k = torch.where(served.unsqueeze(2), top_k, torch.full_like(top_k, -1))
            recorder.record(layer_id, top_k.reshape(batch * positions, k),
                            req_pool_indices.repeat_interleave(positions),
                            (seq_lens - 1).repeat_interleave(positions), rows.reshape(batch * positions, k), positions,
                            given)
        return rows

    core.Coordinator.__init__ = __init__
    core.Coordinator.swap_in = swap_in
    core.Coordinator.swap_in_verify = swap_in_verify


class _EveryNthDecode:
    def __init__(self, every: int) -> None:
        self.every = every
        self.decode_batches = 0

    def around_run_batch(self, original, scheduler, batch, *args, **kwargs):
        result = original(scheduler, batch, *args, **kwargs)
        if batch is not None and batch.forward_mode.is_decode():
            self.decode_batches += 1
            if self.decode_batches % self.every == 0:
                for recorder in _RECORDERS:
                    recorder.check()
        return result


def _use_kernel_defines(defines: tuple[str, ...]) -> None:
    from hisparse_sglang.ops import jit

    original = jit.load_module

    def load_module(defines_=(), sources=None):
        return original(tuple(defines_) or defines, sources)

    jit.load_module = load_module


def install(hook_registry, hook_type) -> None:
    """Called by hisparse_e2e_fixture.register(); a no-op unless the variables above are set."""
    import importlib.util

    every = int(os.environ.get(CHECK_ENV, "0") or 0)
    defines = tuple(d for d in os.environ.get(DEFINES_ENV, "").split(",") if d)
    if not (every or defines):
        return
    if importlib.util.find_spec("hisparse_sglang") is None:
        _say(f"{CHECK_ENV}/{DEFINES_ENV} ignored: hisparse_sglang is not importable in this server")
        return
    if defines:
        _use_kernel_defines(defines)
        _say(f"kernel variant: the plugin builds its kernels with -D {' -D '.join(defines)}")
    if every:
        from hisparse_sglang.coordinator import core

        _wrap_swap_in(core)
        hook_registry.register("sglang.srt.managers.scheduler.Scheduler.run_batch",
                               _EveryNthDecode(every).around_run_batch, hook_type.AROUND)
        _say(f"kv-check on: every {every}th decode batch")
