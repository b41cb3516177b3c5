"""SGLang 0.5.22+'s speculative verify step through the adapter (docs/speculative.md 2.8), on CPU with
SGLang's real Req / ScheduleBatch / ReqToTokenPool, our pool, allocator and coordinator (reference ops).

Each step does what SGLang's EAGLE worker (spec v2, topk 1) does around the coordinator:
``check_decode_mem`` (our hook), the reserve of ``eagle_prepare_for_decode`` (logical locations only, the
HiSparse branch of ``alloc_for_spec_decode``; its Triton kernels have no CPU path, so the in-process
tests write ``req_to_token`` in torch and one spawned test runs SGLang's own function under Triton's
interpreter), the verify locations (``out_cache_loc``), ``prepare_spec_verify(batch)``, the target
forward writing the KV of all ``T`` positions (accepted drafts the true KV, rejected ones a poisoned
KV), the 3-D ``swap_in_selected_pages`` of every layer with ``dsa_seqlens_expanded`` and a CUDA-graph
padding row, then ``commit_spec_accept_tokens(batch=, accept_indices=)``. The host's committed length
``req.kv.kv_committed_len`` can lag the device's by one verify (the overlap scheduler).

After every step: each row the swap-in returns holds the right KV, every committed token is on its
host row in every layer, and no host row anywhere holds a rejected draft's KV. At the end (finish,
abort, retract after verify steps) nothing leaks.
"""

import contextlib
import logging
import traceback
import types

import drive
import pytest
import torch
from test_coordinator_sglang import KV_DTYPES, LAYERS, PAGE, Stack, row_uids

from hisparse_sglang.integration.sglang import compat, metrics

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.skipif(
        not compat.serves_speculative_decoding() or compat.speculative_verify_is_hooked(),
        reason=f"SGLang calls the HiSparse verify step itself from 0.5.22 (installed: {compat.sglang_version()}; "
        f"0.5.17 - 0.5.21: tests/sglang/test_speculative_hooks.py)",
    ),
]

STEPS = 1  # --speculative-num-steps
T = STEPS + 1  # --speculative-num-draft-tokens (topk 1)
RESERVE = 2 * T  # what alloc_for_spec_decode reserves beyond the committed length: 2 x max(steps x topk, T)
SPEC_ARGS = dict(
    speculative_algorithm="EAGLE",
    speculative_num_steps=STEPS,
    speculative_eagle_topk=1,
    speculative_num_draft_tokens=T,
    page_size=PAGE,
)


def publish_spec_server_args():
    from sglang.srt import runtime_context

    runtime_context.publish(drive.unresolved_server_args(**SPEC_ARGS), role="scheduler")


@pytest.fixture(autouse=True)
def spec_server_args():
    """The scheduler's published config: SGLang's sizing of the reserve reads it."""
    from sglang.srt import runtime_context

    publish_spec_server_args()
    yield
    runtime_context.reset_context()


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class Spy:
    """Records the arguments the adapter passes to one method of the coordinator core, then calls it."""

    def __init__(self, core, name: str):
        self.calls = []
        self.original = getattr(core, name)
        setattr(core, name, self)

    def __call__(self, *args):
        self.calls.append([a.tolist() if isinstance(a, torch.Tensor) else a for a in args])
        return self.original(*args)


class SpecRun:
    """A scheduler running EAGLE (topk 1) over SGLang's objects, with an expected model of every length."""

    def __init__(self, host_lag: bool, seed: int = 0, **stack_options):
        self.stack = Stack(num_draft_tokens=T, **stack_options)
        self.coordinator = self.stack.coordinator
        self.host_lag = host_lag
        self.generator = torch.Generator().manual_seed(seed)
        self.device_len: dict[str, int] = {}  # s: committed on the device
        self.committed: dict[str, int] = {}  # c: req.kv.kv_committed_len, <= s
        self.allocated: dict[str, int] = {}  # kv_allocated_len, from this model's own rule
        self.spies = {
            name: Spy(self.coordinator.core, name) for name in ("prepare_verify", "swap_in_verify", "commit_verify")
        }
        self.caps = 0  # verify rows whose accept length H10 lowered
        self.dropped = 0  # the accepted positions those caps took back

    # ------------------------------------------------------------------ admission
    def admit(self, rid: str, prompt_len: int, pd: bool = False):
        req = self.stack.new_req(rid, prompt_len)
        if pd:
            self.stack.pd_admit(req, prompt_len)
        else:
            self.stack.prefill(req, prompt_len)
            assert req in self.coordinator.collect_ready_reqs()
        self.device_len[rid] = self.committed[rid] = self.allocated[rid] = prompt_len
        return req

    # ------------------------------------------------------------------ one verify step
    def batch(self, reqs):
        from sglang.srt.managers.schedule_batch import ScheduleBatch
        from sglang.srt.model_executor.forward_batch_info import ForwardMode
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        model_config = types.SimpleNamespace(vocab_size=32000, is_encoder_decoder=False)
        batch = ScheduleBatch.init_new(
            list(reqs),
            self.stack.req_to_token_pool,
            self.stack.allocator,
            self.stack.cache,
            model_config,
            False,
            SpeculativeAlgorithm.from_string("EAGLE"),
        )
        batch.hisparse_coordinator = self.coordinator
        batch.forward_mode = ForwardMode.DECODE
        batch.req_pool_indices = torch.tensor([compat.req_slot(req) for req in reqs], dtype=torch.int64)
        batch.seq_lens = torch.tensor([self.device_len[req.rid] for req in reqs], dtype=torch.int64)
        return batch

    def fits(self, batch) -> bool:
        """ScheduleBatch.check_decode_mem through our AROUND hook (SGLang's own is never reached)."""
        from hisparse_sglang.integration.sglang.hooks import _check_decode_mem

        def unreachable(*args):
            raise AssertionError("SGLang's check_decode_mem must not run under HiSparse")

        return _check_decode_mem(unreachable, batch)

    def reserve(self, batch) -> None:
        """eagle_prepare_for_decode's reserve under HiSparse: SGLang's page-aligned lengths, logical
        locations from our allocator's alloc_logical_only (called as alloc_for_spec_decode calls it),
        written to req_to_token, kv_allocated_len raised."""
        from sglang.srt.mem_cache.allocation_sizing import get_alloc_reserve_per_decode, page_aligned_decode_alloc_lens

        cur, nxt, needed = page_aligned_decode_alloc_lens(
            batch.reqs, reserve=get_alloc_reserve_per_decode(), page_size=PAGE
        )
        if needed:
            slots = batch.req_pool_indices
            cur_t, nxt_t = torch.tensor(cur, dtype=torch.int32), torch.tensor(nxt, dtype=torch.int32)
            last_loc = self.stack.req_to_token_pool.req_to_token[slots, cur_t.long() - 1].to(torch.int64)
            locs = self.stack.allocator.alloc_logical_only(cur_t, cur_t, nxt_t, nxt_t, last_loc, needed)
            assert locs is not None and locs.numel() == needed
            offset = 0
            for slot, old, new in zip(slots.tolist(), cur, nxt):
                row = self.stack.req_to_token_pool.req_to_token[slot]
                row[old:new] = locs[offset : offset + new - old].to(torch.int32)
                offset += new - old
        for req, new in zip(batch.reqs, nxt):
            req.kv.kv_allocated_len = max(req.kv.kv_allocated_len, new)

    def step(self, reqs, accept: list[int], padded: bool = False, reserve=None) -> None:
        """One verify of ``reqs`` accepting ``accept[b]`` positions (the root counts: 1 <= a <= T)."""
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        stack, coordinator = self.stack, self.coordinator
        batch = self.batch(reqs)
        assert self.fits(batch)
        (reserve or self.reserve)(batch)
        for req in reqs:  # the model's own rule: whole pages up to c + 2T, never shrinking
            self.allocated[req.rid] = max(self.allocated[req.rid], round_up(self.committed[req.rid] + RESERVE, PAGE))
            assert req.kv.kv_allocated_len == self.allocated[req.rid]
        s = batch.seq_lens
        positions = s[:, None] + torch.arange(T)
        req_to_token = stack.req_to_token_pool.req_to_token
        batch.out_cache_loc = req_to_token[batch.req_pool_indices[:, None], positions].reshape(-1).to(torch.int64)
        coordinator.prepare_spec_verify(batch)
        batch.forward_mode = ForwardMode.TARGET_VERIFY

        # The target forward writes all T positions: an accepted draft is the true token (its KV),
        # a rejected one is a wrong token (a poisoned KV: the request's uid negated).
        for b, req in enumerate(reqs):
            for j in range(T):
                self.write(req, int(s[b]) + j, rejected=j >= accept[b])

        rows_in_graph = len(reqs) + int(padded)
        req_pool_indices = torch.cat([batch.req_pool_indices, torch.zeros(int(padded), dtype=torch.int64)])
        graph_s = torch.cat([s, torch.zeros(int(padded), dtype=torch.int64)])
        # DSA metadata of a verify: query row b * T + j attends to s + j + 1 tokens.
        dsa_seqlens_expanded = (graph_s[:, None] + torch.arange(T) + 1).reshape(-1).to(torch.int32)
        coordinator.num_real_reqs.fill_(len(reqs))
        for layer in stack.layers:
            top_k = self.top_k(graph_s, len(reqs))
            rows = coordinator.swap_in_selected_pages(req_pool_indices, dsa_seqlens_expanded, top_k, layer.layer_id)
            rows = rows.view(rows_in_graph * T, -1)  # what the DSA backend does with it
            self.check_rows(reqs, s, accept, top_k, rows.view(rows_in_graph, T, -1), layer.layer_id)

        # eagle_sample with topk 1: row b accepted its first a verify rows (b * T + i), -1 padded; then H10 (every
        # release) caps the rows whose later positions the swap-in left out.
        accept, accept_index = self.sample(batch, accept)
        coordinator.commit_spec_accept_tokens(batch=batch, accept_indices=accept_index)
        self.accepted(reqs, accept)

    def sample(self, batch, accept: list[int]) -> tuple[list[int], torch.Tensor]:
        """eagle_sample's result for these accept lengths, through hook H10 (hooks_speculative._eagle_sample_after,
        registered on every release): the accept lengths it leaves (a list) and its accept_index; records the caps."""
        from hisparse_sglang.integration.sglang.hooks_speculative import _eagle_sample_after

        rows = len(accept)
        accept_lens = torch.tensor(accept, dtype=torch.int32)
        accept_index = torch.full((rows, STEPS + 1), -1, dtype=torch.int32)
        for b, a in enumerate(accept):
            accept_index[b, :a] = b * T + torch.arange(a, dtype=torch.int32)
        result = (torch.zeros(rows * T, dtype=torch.int32), accept_lens, accept_index)
        assert _eagle_sample_after(result, None, batch, None) is result
        capped = accept_lens.tolist()
        assert accept_index.tolist() == [[b * T + i if i < a else -1 for i in range(STEPS + 1)]
                                         for b, a in enumerate(capped)], "accept_index disagrees with accept_lens"
        self.caps += sum(a < want for a, want in zip(capped, accept))
        self.dropped += sum(want - a for a, want in zip(capped, accept))
        assert all(1 <= a <= want for a, want in zip(capped, accept))
        return capped, accept_index

    def accepted(self, reqs, accept: list[int]) -> None:
        """The lengths after a committed verify, then the host check."""
        for b, req in enumerate(reqs):
            old = self.device_len[req.rid]
            self.device_len[req.rid] = old + accept[b]
            # Under the overlap scheduler the host learns this verify's result after the next one launched.
            self.committed[req.rid] = old if self.host_lag else old + accept[b]
            drive.set_kv_committed_len(req, self.committed[req.rid])
        self.check_host(reqs)

    # ------------------------------------------------------------------ KV and checks
    def write(self, req, position: int, rejected: bool) -> None:
        locs = self.stack.req_to_token_pool.req_to_token[compat.req_slot(req), [position]].to(torch.int64)
        rows = self.stack.pool.translate_loc_to_hisparse_device(locs).to(torch.int64)
        assert bool((rows > 0).all()), f"{req.rid}: verify position {position} is not bound to a device row"
        uid = self.stack.uids[req.rid] * (-1 if rejected else 1)
        for layer in self.stack.layers:
            self.stack.kv_rows(layer.layer_id)[rows] = self.stack.token_rows(
                uid, torch.tensor([position]), layer.layer_id
            )

    def top_k(self, graph_s: torch.Tensor, real: int) -> torch.Tensor:
        """int32 [B, T, K]: query position j picks among [0, s + j] (its own verify positions always),
        -1 padded; a padding row gets arbitrary entries."""
        k = self.stack.config.top_k
        top_k = torch.full((graph_s.numel(), T, k), -1, dtype=torch.int32)
        for b in range(graph_s.numel()):
            s = int(graph_s[b])
            for j in range(T):
                if b >= real:
                    top_k[b, j] = torch.randint(0, 1000, (k,), generator=self.generator, dtype=torch.int32)
                    continue
                verify = torch.arange(s, s + j + 1)
                history = torch.randperm(s, generator=self.generator)[: k - verify.numel() - 1]
                chosen = torch.cat([history, verify])
                top_k[b, j, : chosen.numel()] = chosen.to(torch.int32)
        return top_k

    def check_rows(self, reqs, s, accept, top_k, rows, layer_id: int) -> None:
        kv = self.stack.kv_rows(layer_id)
        assert bool((rows[len(reqs) :] == -1).all()), "a CUDA-graph padding row was served"
        limit = self.coordinator.core.speculative.verify_limit
        for b, req in enumerate(reqs):
            for j in range(T):
                entries = top_k[b, j]
                if j >= int(limit[b]):  # left out by the swap-in (its buffer could not hold it): never read
                    assert bool((rows[b, j] == -1).all()), f"{req.rid} layer {layer_id}: a left-out position was served"
                    continue
                valid = entries >= 0
                assert bool((rows[b, j][~valid] == -1).all())
                positions = entries[valid].to(torch.int64)
                got = kv[rows[b, j][valid].to(torch.int64)]
                uid = self.stack.uids[req.rid]
                # This verify's rejected positions read what it wrote (the poisoned KV); the rest the true KV.
                rejected = positions >= int(s[b]) + accept[b]
                for want_uid, mask in ((uid, ~rejected), (-uid, rejected)):
                    want = self.stack.token_rows(want_uid, positions[mask], layer_id)
                    assert torch.equal(got[mask], want), f"{req.rid} layer {layer_id} query position {j}: wrong KV"

    def check_host(self, reqs) -> None:
        for layer_id in range(LAYERS):
            host = self.coordinator.host_pool.layers[layer_id]  # uint8 [locations, row bytes]
            assert host.shape[1] == self.stack.row_bytes
            poisoned = torch.nonzero(row_uids(host) < 0).reshape(-1)
            assert poisoned.numel() == 0, (
                f"layer {layer_id}: host rows {poisoned[:8].tolist()} hold a rejected draft's KV"
            )
            for req in reqs:
                committed = torch.arange(self.device_len[req.rid])
                locs = self.stack.req_to_token_pool.req_to_token[compat.req_slot(req), committed].to(torch.int64)
                want = self.stack.token_rows(self.stack.uids[req.rid], committed, layer_id)
                assert torch.equal(host[locs], want), (
                    f"{req.rid} layer {layer_id}: a committed token is not on its host row"
                )

    def end(self, req, how: str) -> None:
        if how == "retract":
            self.coordinator.retract_req(req)
        else:  # finish, or abort (SGLang calls request_finished for both)
            self.coordinator.request_finished(req)
        self.stack.release(req)


def random_accepts(run: SpecRun, count: int) -> list[int]:
    return torch.randint(1, T + 1, (count,), generator=run.generator).tolist()


# ---------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("kv_dtype", sorted(KV_DTYPES))
@pytest.mark.parametrize("resident_first", [True, False], ids=["resident-first", "always-offload"])
@pytest.mark.parametrize("host_lag", [False, True], ids=["synchronous", "overlap"])
def test_verify_steps_serve_the_right_kv_and_commit_only_accepted_tokens(resident_first, host_lag, kv_dtype):
    run = SpecRun(host_lag=host_lag, resident_first=resident_first, kv_dtype=kv_dtype)
    reqs = [run.admit("long", 700), run.admit("short", 150), run.admit("pd", 520, pd=True)]
    modes = {req.rid: run.coordinator.core.requests[compat.req_slot(req)].mode for req in reqs}
    assert modes["pd"] == "offloaded" and modes["short"] == "resident"
    scripted = [[T, 1, T], [1, 1, 1], [T, T, T]]  # both ends: everything rejected, everything accepted
    for step in range(14):
        accept = scripted[step] if step < len(scripted) else random_accepts(run, len(reqs))
        run.step(reqs, accept, padded=step % 3 == 0)
    modes = {req.rid: run.coordinator.core.requests[compat.req_slot(req)].mode for req in reqs}
    assert modes["long"] == ("resident" if resident_first else "offloaded")
    assert run.coordinator.core.stats().swap_in_lookups > 0
    for req, how in zip(reqs, ("finish", "abort", "retract")):
        run.end(req, how)
    run.stack.assert_all_free()


@pytest.mark.parametrize("host_lag", [False, True], ids=["synchronous", "overlap"])
def test_a_request_demoted_between_verify_steps_keeps_being_served_right(host_lag):
    """Resident-first under pressure: a third long prompt takes device pages only a demotion of a
    verifying request can free (decided with the host's c, which may trail the device's s)."""
    run = SpecRun(host_lag=host_lag, device_tokens=PAGE * 36)
    reqs = [run.admit("a", 800), run.admit("b", 800)]
    for _ in range(3):
        run.step(reqs, random_accepts(run, len(reqs)))
    assert run.coordinator.core.stats().demotions == 0
    reqs.append(run.admit("c", 800))
    for _ in range(8):
        run.step(reqs, random_accepts(run, len(reqs)))
    stats = run.coordinator.core.stats()
    assert stats.demotions >= 1 and stats.offloaded_requests >= 1
    for req, how in zip(reqs, ("abort", "finish", "retract")):
        run.end(req, how)
    run.stack.assert_all_free()


def test_the_coordinator_gets_sglangs_slots_lengths_and_accept_lengths():
    """What the adapter hands the coordinator core, against this test's own model of SGLang's lengths:
    the slots of the batch, c = kv_committed_len (one verify behind under overlap), kv_allocated_len =
    c + 2T rounded up to a page (never shrinking), s from the batch and, in the swap-in, from
    dsa_seqlens_expanded; the accept lengths counted from accept_index."""
    run = SpecRun(host_lag=True)
    reqs = [run.admit("a", 130), run.admit("b", 61)]
    accepts = [[2, 1], [1, 2], [2, 2], [1, 1]]
    expected_prepare, expected_commit, expected_s = [], [], []
    for accept in accepts:
        slots = [compat.req_slot(req) for req in reqs]
        s = [run.device_len[req.rid] for req in reqs]
        c = [run.committed[req.rid] for req in reqs]
        allocated = [max(run.allocated[req.rid], round_up(run.committed[req.rid] + 2 * T, PAGE)) for req in reqs]
        expected_prepare.append([slots, c, allocated, slots, s, T])
        expected_commit.append([slots, s, accept])
        expected_s.append(s)
        run.step(reqs, accept)
    assert run.spies["prepare_verify"].calls == expected_prepare
    assert run.spies["commit_verify"].calls == expected_commit
    swap_ins = run.spies["swap_in_verify"].calls
    assert len(swap_ins) == len(accepts) * LAYERS
    for i, call in enumerate(swap_ins):
        slots, s_seen, top_k, layer = call[0], call[1], call[2], call[3]
        assert (slots, s_seen, layer) == (expected_prepare[i // LAYERS][0], expected_s[i // LAYERS], i % LAYERS)
        assert torch.tensor(top_k).shape == (len(reqs), T, run.stack.config.top_k)
    # the run lagged: c trailed s by the previous verify's accept length
    assert [run.committed[r.rid] for r in reqs] == [130 + 6 - 1, 61 + 6 - 1]
    for req in reqs:
        run.end(req, "finish")
    run.stack.assert_all_free()


@pytest.mark.parametrize("kv_dtype", sorted(KV_DTYPES))
def test_rejected_drafts_never_reach_the_host_even_when_every_draft_is_rejected(kv_dtype):
    run = SpecRun(host_lag=False, resident_first=False, kv_dtype=kv_dtype)
    req = run.admit("x", 700)
    for _ in range(5):
        run.step([req], [1])  # only the root: the draft position is rejected every time
        assert run.device_len["x"] == run.committed["x"]
    assert run.device_len["x"] == 705
    # the rejected position s of the last verify still holds the poisoned KV on the device, not on the host
    loc = int(run.stack.req_to_token_pool.req_to_token[compat.req_slot(req), 705])
    device_row = int(run.stack.pool.translate_loc_to_hisparse_device(torch.tensor([loc])))
    host_uids = [float(row_uids(run.coordinator.host_pool.layers[layer][[loc]])) for layer in range(LAYERS)]
    device_uids = [float(row_uids(run.stack.kv_rows(layer)[[device_row]])) for layer in range(LAYERS)]
    assert min(host_uids) >= 0 and max(device_uids) < 0, (host_uids, device_uids)
    run.end(req, "abort")
    run.stack.assert_all_free()


def test_an_idle_batch_commits_nothing():
    """DP attention: a rank with no requests runs an idle verify; eagle_sample gives 1-D empty accept_index."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    run = SpecRun(host_lag=False)
    req = run.admit("x", 100)
    run.step([req], [2])
    idle = run.batch([])
    idle.forward_mode = ForwardMode.IDLE
    run.coordinator.commit_spec_accept_tokens(batch=idle, accept_indices=torch.empty(0, dtype=torch.int32))
    assert run.spies["commit_verify"].calls[-1][2] == [2]  # nothing new reached the core
    run.step([req], [1])
    run.end(req, "finish")
    run.stack.assert_all_free()


def test_the_verify_graph_can_be_captured_before_any_request():
    """SGLang captures the TARGET_VERIFY graph (3-D swap-ins of padding rows) before any prepare: the
    coordinator fixes T when it starts, and every row comes back -1 (no real row)."""
    run = SpecRun(host_lag=False)
    top_k = torch.zeros((3, T, run.stack.config.top_k), dtype=torch.int32)
    seqlens = torch.ones(3 * T, dtype=torch.int32)
    run.coordinator.num_real_reqs.fill_(0)
    rows = run.coordinator.swap_in_selected_pages(torch.zeros(3, dtype=torch.int64), seqlens, top_k, 0)
    assert rows.shape == (3, T, run.stack.config.top_k) and bool((rows == -1).all())
    assert rows.view(3 * T, -1).data_ptr() == rows.data_ptr()


def test_check_decode_mem_retracts_when_a_resident_reserve_cannot_get_device_pages():
    """Under speculation the hook asks the coordinator whether the reserve SGLang will allocate next
    can be bound; a resident request that can neither get a page nor be demoted makes it say no."""
    run = SpecRun(host_lag=False, device_tokens=PAGE * 8, buffer_size=256, top_k=128)
    req = run.admit("x", 253)  # 4 pages, resident, shorter than the buffer: not demotable
    other = run.admit("y", 200)  # 4 pages: the device pool is full
    assert run.stack.allocator.rows.device_rows.free_pages == 0
    batch = run.batch([req, other])
    assert not run.fits(batch)  # x's reserve (253 + 2T -> 320) starts a page; nobody can free one
    assert run.fits(run.batch([other]))  # other's reserve stays in its last page
    run.end(req, "retract")
    run.step([other], [2])
    run.end(other, "finish")
    run.stack.assert_all_free()


def test_the_model_runner_hook_hands_the_coordinator_the_published_number_of_draft_tokens():
    """What our maybe_init_hisparse_coordinator passes as T: the resolved --speculative-num-draft-tokens,
    0 without --speculative-algorithm (the draft worker never starts a coordinator from 0.5.22)."""
    from sglang.srt import runtime_context

    from hisparse_sglang.integration.sglang.hooks_startup import _speculative_num_draft_tokens

    assert _speculative_num_draft_tokens() == T
    for algorithm in (None, "NONE"):
        runtime_context.reset_context()
        args = drive.unresolved_server_args(**dict(SPEC_ARGS, speculative_algorithm=algorithm))
        runtime_context.publish(args, role="scheduler")
        assert _speculative_num_draft_tokens() == 0


@pytest.mark.parametrize("host_lag", [False, True], ids=["synchronous", "overlap"])
def test_positions_a_buffer_cannot_hold_are_left_out_and_never_accepted(host_lag):
    """A buffer of top_k slots (less than T x top_k): where an offloaded request's second position misses more
    tokens than the slots its first position left, the swap-in leaves it out and hook H10 caps the acceptance,
    so SGLang commits and emits only served positions; the KV read and the host stay right throughout."""
    run_positions_left_out(SpecRun(host_lag=host_lag, resident_first=False, buffer_size=128, top_k=128))


@contextlib.contextmanager
def caplog_at_info():
    """The messages hisparse-sglang's logger writes at INFO within (the helpers here run without pytest's caplog)."""
    records: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("hisparse_sglang")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def run_positions_left_out(run: SpecRun) -> None:
    """Two offloaded requests verifying T positions of top_k 128 with buffers of 128 slots, every draft proposed
    as accepted: some steps must be capped (checked rows and host throughout), and everything is freed."""
    reqs = [run.admit("a", 700), run.admit("b", 400)]
    for _ in range(12):
        run.step(reqs, [T] * len(reqs))
    assert run.caps > 0, "no verify row was capped: the case does not exercise the left-out positions"
    # The caps reach the operator: the HiSparse log line and the metrics count them (delta and total).
    with caplog_at_info() as records:
        values = metrics.report(run.coordinator, log=True, prometheus_labels=None)
    assert (values["verify_rows_capped"], values["verify_drafts_dropped"]) == (run.caps, run.dropped)
    assert (values["verify_rows_capped_total"], values["verify_drafts_dropped_total"]) == (run.caps, run.dropped)
    assert f"verify caps {run.caps} ({run.dropped} drafts dropped)" in "\n".join(records)
    again = run.coordinator.report()
    assert (again["verify_rows_capped"], again["verify_rows_capped_total"]) == (0, run.caps)
    for req, how in zip(reqs, ("finish", "abort")):
        run.end(req, how)
    run.stack.assert_all_free()


def test_a_coordinator_started_without_speculation_refuses_the_verify_calls():
    from hisparse_sglang.errors import HiSparseMemoryError

    stack = Stack()
    req = stack.new_req("x", 100)
    stack.prefill(req, 100)
    stack.coordinator.collect_ready_reqs()
    batch = types.SimpleNamespace(
        reqs=[req], req_pool_indices=torch.tensor([compat.req_slot(req)]), seq_lens=torch.tensor([100])
    )
    with pytest.raises(HiSparseMemoryError, match="started without speculative decoding"):
        stack.coordinator.prepare_spec_verify(batch)
    stack.coordinator.request_finished(req)
    stack.release(req)
    stack.assert_all_free()


# ---------------------------------------------------------------------------------------------- SGLang's own reserve
def _steps_with_sglangs_reserve(conn) -> None:
    """A spawned child whose Triton runs in its interpreter (TRITON_INTERPRET=1 from the parent's
    environment, read when SGLang's kernels are defined): the reserve is SGLang's own
    eagle_prepare_for_decode (get_last_loc, alloc_for_spec_decode's HiSparse branch calling our
    allocator's alloc_logical_only, assign_req_to_token_pool)."""
    try:
        from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
        from sglang.srt.speculative.eagle_utils import eagle_prepare_for_decode

        publish_spec_server_args()

        def sglang_reserve(batch):
            batch.sampling_info = SamplingBatchInfo.from_schedule_batch(batch, 32000)
            eagle_prepare_for_decode(batch)

        run = SpecRun(host_lag=True, resident_first=False)
        reqs = [run.admit("long", 700), run.admit("short", 100)]
        for _ in range(6):
            run.step(reqs, random_accepts(run, len(reqs)), reserve=sglang_reserve)
        for req, how in zip(reqs, ("finish", "retract")):
            run.end(req, how)
        run.stack.assert_all_free()
        report = {"steps": 6}
    except BaseException:
        report = {"error": traceback.format_exc()}
    conn.send(report)
    conn.close()


def test_sglangs_own_reserve_composes_with_the_verify_step(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    report = drive.report_of_spawned(_steps_with_sglangs_reserve)
    assert "error" not in report, report.get("error")
    assert report == {"steps": 6}
