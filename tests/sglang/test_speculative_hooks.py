"""The speculative verify step on SGLang 0.5.17 - 0.5.21 through hooks_speculative.py (docs/speculative.md 2.7),
on CPU with SGLang's real Req / ScheduleBatch / ReqToTokenPool / DSAIndexerMetadata / EagleDraftInput, our pool,
allocator and coordinator (reference ops).

The verify steps are those of tests/sglang/test_speculative_sglang.py (0.5.22+), with every coordinator call
made by the hook that makes it here: the reserve through H1 around SGLang's own ``alloc_paged_token_slots_extend``
(what ``alloc_for_spec_decode`` calls), the binding through H2, each layer's swap-in through H4 around a
``forward_extend`` stand-in that does what SGLang's does with the page table (one translation through the pool;
the attention kernels have no CPU path), the commit through H3 with ``run_eagle_verify``'s ``accept_lens``. The
same checks follow every step: each row holds the right KV, every committed token is on its host row, no host
row holds a rejected draft's KV.
"""

import contextlib
import logging
import types

import drive
import pytest
import torch
from test_coordinator_sglang import KV_DTYPES, LAYERS, PAGE
from test_speculative_sglang import SPEC_ARGS, SpecRun, T, random_accepts, run_positions_left_out

from hisparse_sglang.integration.sglang import compat
from hisparse_sglang.integration.sglang import hooks_speculative as hooks

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.skipif(
        not compat.speculative_verify_is_hooked(),
        reason=f"the verify-step hooks cover SGLang 0.5.17 - 0.5.21 (installed: {compat.sglang_version()})",
    ),
]


@pytest.fixture(autouse=True)
def spec_server_args():
    """The scheduler's published config: SGLang's sizing of the reserve reads it."""
    from sglang.srt import runtime_context

    drive.publish_single_rank_scheduler(drive.unresolved_server_args(enable_hisparse=True, **SPEC_ARGS))
    yield
    runtime_context.reset_context()


def unreachable(*args, **kwargs):
    raise AssertionError("the hook must not call SGLang's original here")


def fused_v2_top_k(logits, lengths, topk, attn_metadata):
    """Stand-in for SGLang's ``_topk_transform_v2_paged`` (its kernel has no CPU path), doing what its docstring
    states the kernel does with a row's selected positions ``p``: ``real_page_table[i, p // P] * P + p % P``. The
    test hands the selected positions (int32 ``[rows, K]``, -1 padding) as ``logits``."""
    positions = logits.to(torch.int64)
    table = attn_metadata.real_page_table.to(torch.int64)
    page = attn_metadata.page_size
    pages = table.gather(1, positions.clamp(min=0) // page)
    return torch.where(positions >= 0, pages * page + positions % page, -1).to(torch.int32)


class HookedRun(SpecRun):
    """SpecRun with every coordinator call made by the 0.5.17 - 0.5.21 hook that makes it.

    ``fused``: each layer's top-k goes through H5 as SGLang's indexer calls it, with SGLang's real
    ``DSAIndexerMetadata`` and top-k dispatch (sgl-kernel, PAGED, a v2 plan), whose fused v2 kernel is the
    :func:`fused_v2_top_k` stand-in (the test monkeypatches it in); else H4 gets the positions (the unfused top-k).
    """

    def __init__(self, *args, fused: bool = False, graphs: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.fused = fused
        self.graphs = graphs
        self.labels: list = []  # per step with ``graphs``: H12's label of the graph the step replays
        self.static_lengths: dict[int, torch.Tensor] = {}

    def top_k(self, graph_s: torch.Tensor, real: int) -> torch.Tensor:
        """SpecRun's, except that with ``graphs`` a padding row selects what SGLang's indexer selects for it: its
        length is the graph's fill value 1, so query position j picks among positions [0, j + 1]."""
        top_k = super().top_k(graph_s, real)
        if self.graphs:
            top_k[real:] = -1
            for j in range(T):
                top_k[real:, j, : j + 2] = torch.arange(j + 2, dtype=torch.int32)
        return top_k

    def check_rows(self, reqs, s, accept, top_k, rows, layer_id: int) -> None:
        """SpecRun's; in H11's graph a padding row is not cleared (no swap-in runs) but reads rows of the pool."""
        if self.labels and self.labels[-1]:
            padding = rows[len(reqs) :]
            assert bool(((padding >= -1) & (padding < self.stack.kv_rows(layer_id).shape[0])).all())
            rows = torch.cat([rows[: len(reqs)], torch.full_like(padding, -1)])
        super().check_rows(reqs, s, accept, top_k, rows, layer_id)

    def fused_top_k(self, backend, graph, layer_id: int, top_k: torch.Tensor) -> torch.Tensor:
        """The layer's top-k as the indexer gets it through H5: SGLang's metadata of the verify (its logical page
        table, one row per query), H5's replacement, its ``topk_transform`` with the selected positions."""
        from sglang.srt.layers.attention.dsa.dsa_indexer_metadata import DSAIndexerMetadata
        from sglang.srt.layers.attention.dsa.dsa_topk_backend import TopkTransformMethod

        rows = top_k.shape[0] * T
        req_to_token = self.stack.req_to_token_pool.req_to_token
        logical = req_to_token[graph.req_pool_indices][:, ::PAGE] // PAGE
        attn = types.SimpleNamespace(
            real_page_table=logical.repeat_interleave(T, dim=0).to(torch.int32),
            page_size=PAGE,
            topk_v2_plan=torch.zeros(rows + 1, dtype=torch.int32),
            dsa_seqlens_expanded=backend.forward_metadata.dsa_seqlens_expanded,
            cu_seqlens_q=None,
            topk_indices_offset=None,
        )
        metadata = DSAIndexerMetadata(attn_metadata=attn, topk_transform_method=TopkTransformMethod.PAGED)
        ours = hooks._get_indexer_metadata_after(metadata, backend, layer_id, graph)
        assert ours.get_page_table_64() is attn.real_page_table, "the indexer must read its keys' own pages"
        out = ours.topk_transform(top_k.view(rows, -1), top_k.shape[-1])
        assert self.coordinator.runtime.verify_top_k_fused
        return out

    def reserve(self, batch) -> None:
        """alloc_for_spec_decode through H1: SGLang's lengths, SGLang's alloc_paged_token_slots_extend (which
        calls the allocator's alloc_extend) for the locations; req_to_token written in torch (SGLang's
        assign_req_to_token_pool_func is Triton)."""
        from sglang.srt.mem_cache.allocation import alloc_paged_token_slots_extend

        stack = self.stack
        cur = [compat.req_kv_allocated_len(req) for req in batch.reqs]
        nxt = compat.next_spec_allocated_lens(batch.reqs, PAGE)
        needed = sum(nxt) - sum(cur)

        def alloc_for_spec_decode(tree_cache, req_to_token_pool, **kwargs):
            if needed:
                cur_t, nxt_t = torch.tensor(cur), torch.tensor(nxt)
                last_loc = req_to_token_pool.req_to_token[batch.req_pool_indices, cur_t - 1].to(torch.int64)
                locs = alloc_paged_token_slots_extend(tree_cache, cur_t, cur_t, nxt_t, nxt_t, last_loc, needed)
                offset = 0
                for slot, old, new in zip(batch.req_pool_indices.tolist(), cur, nxt):
                    req_to_token_pool.req_to_token[slot, old:new] = locs[offset : offset + new - old].to(torch.int32)
                    offset += new - old
            for req, new in zip(batch.reqs, nxt):
                req.kv.kv_allocated_len = max(req.kv.kv_allocated_len, new)

        before = stack.allocator.rows.device_rows.free_pages
        hooks._alloc_for_spec_decode(alloc_for_spec_decode, stack.cache, stack.req_to_token_pool, reqs=batch.reqs)
        assert stack.allocator.rows.device_rows.free_pages == before, "the reserve took device pages"

    def step(self, reqs, accept: list[int], padded: bool = False, reserve=None) -> None:
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        stack, coordinator = self.stack, self.coordinator
        batch = self.batch(reqs)
        batch.hisparse_coordinator = coordinator
        assert self.fits(batch)
        self.reserve(batch)
        s = batch.seq_lens
        positions = s[:, None] + torch.arange(T)
        batch.out_cache_loc = stack.req_to_token_pool.req_to_token[batch.req_pool_indices[:, None], positions]
        batch.out_cache_loc = batch.out_cache_loc.reshape(-1).to(torch.int64)
        batch.forward_mode = ForwardMode.TARGET_VERIFY  # eagle_prepare_for_verify sets it before H2 runs
        hooks._eagle_prepare_for_verify_after("result", None, stack.req_to_token_pool, batch, None)

        for b, req in enumerate(reqs):
            for j in range(T):
                self.write(req, int(s[b]) + j, rejected=j >= accept[b])

        rows_in_graph = len(reqs) + int(padded)
        graph = types.SimpleNamespace(
            forward_mode=ForwardMode.TARGET_VERIFY,
            req_pool_indices=torch.cat([batch.req_pool_indices, torch.zeros(int(padded), dtype=torch.int64)]),
        )
        graph_s = torch.cat([s, torch.zeros(int(padded), dtype=torch.int64)])
        # One length buffer per batch shape, written in place every step, as a CUDA graph's static input is.
        expanded = self.static_lengths.setdefault(rows_in_graph, torch.zeros(rows_in_graph * T, dtype=torch.int32))
        expanded.copy_((graph_s[:, None] + torch.arange(T) + 1).reshape(-1))
        backend = types.SimpleNamespace(
            hisparse_coordinator=coordinator,
            token_to_kv_pool=stack.pool,
            forward_metadata=types.SimpleNamespace(dsa_seqlens_expanded=expanded),
        )
        coordinator.num_real_reqs.fill_(len(reqs))
        # With ``graphs`` the forward is the graph H12 picks: H11's all-resident one runs the layers as they were
        # captured, in ``capturing_all_resident_verify`` (what a replay then does), the other as captured with
        # the swap-ins (eagerly here: the padded forward always swaps in).
        label = hooks._resolve_lora_variant_after(None, graph_runner(coordinator), graph) if self.graphs else None
        if self.graphs:
            self.labels.append(label)
        with coordinator.capturing_all_resident_verify() if label else contextlib.nullcontext():
            for layer in stack.layers:
                top_k = self.top_k(graph_s, len(reqs))
                if self.fused:
                    topk_indices = self.fused_top_k(backend, graph, layer.layer_id, top_k)
                else:
                    topk_indices = top_k.view(rows_in_graph * T, -1)

                def forward_extend(self_, q, k, v, layer_, forward_batch, **kwargs):
                    # What SGLang's does with its page table of the verify: translate it once through the pool.
                    page_table = kwargs["topk_indices"].view(rows_in_graph * T, -1)
                    return self_.token_to_kv_pool.translate_loc_to_hisparse_device(page_table)

                rows = hooks._forward_extend(
                    forward_extend, backend, None, None, None, layer, graph, topk_indices=topk_indices
                )
                self.check_rows(reqs, s, accept, top_k, rows.view(rows_in_graph, T, -1), layer.layer_id)

        accept, _ = self.sample(batch, accept)
        result = types.SimpleNamespace(accept_lens=torch.tensor(accept, dtype=torch.int32))
        assert hooks._run_eagle_verify_after(result, batch, target_worker=None) is result
        self.accepted(reqs, accept)


@pytest.mark.parametrize("kv_dtype", sorted(KV_DTYPES))
@pytest.mark.parametrize("host_lag", [False, True])
@pytest.mark.parametrize("resident_first", [True, False])
@pytest.mark.parametrize("fused,graphs", [(False, False), (True, False), (True, True)],
                         ids=["unfused-top-k", "fused-top-k", "fused-top-k-graphs"])
def test_verify_steps_through_the_hooks_serve_the_right_kv_and_commit_only_accepted_tokens(
    fused, graphs, resident_first, host_lag, kv_dtype, monkeypatch
):
    from sglang.srt.layers.attention.dsa import dsa_topk_backend

    monkeypatch.setattr(dsa_topk_backend, "_topk_transform_v2_paged", fused_v2_top_k)
    run = HookedRun(host_lag=host_lag, resident_first=resident_first, kv_dtype=kv_dtype, fused=fused, graphs=graphs)
    reqs = [run.admit("a", 3 * PAGE + 5), run.admit("b", 2 * PAGE - 1)]
    for step, accept in enumerate(random_accepts(run, 8)):
        run.step(reqs, [accept, max(1, T - accept)], padded=step % 2 == 1)
    # Resident first, both requests stay resident: every step replays H11's graph (no swap-in), padded or not.
    assert run.labels == ([compat.ALL_RESIDENT_VERIFY if resident_first else None] * 8 if graphs else [])
    for req, how in zip(reqs, ("finish", "retract")):
        run.end(req, how)
    assert run.stack.allocator.rows.stats().device_rows_used == 0


def graph_runner(coordinator, draft: bool = False, mode: str = "TARGET_VERIFY"):
    """SGLang's ``DecodeCudaGraphRunner`` with only what H11 / H12 read: its capture mode and its model runner."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner

    runner = object.__new__(DecodeCudaGraphRunner)
    runner.capture_forward_mode = getattr(ForwardMode, mode)
    runner.model_runner = types.SimpleNamespace(is_draft_worker=draft, hisparse_coordinator=coordinator)
    return runner


def test_beside_each_verify_graph_one_without_swap_ins_is_captured_for_all_resident_steps():
    """H11 around SGLang's capture of one shape: the target runner's TARGET_VERIFY shapes are captured twice, the
    second time under the coordinator's all-resident capture and with a label of its own (SGLang's LoRA label
    kept, the later releases' extra argument passed on); nothing else is captured twice. H12 gives that label
    to a verify batch whose prepared requests are all resident, and SGLang's key for it is another graph's."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner

    run = HookedRun(host_lag=False)
    coordinator = run.coordinator
    captured = []

    def capture_one_shape(self, size, forward, stream_idx=None, variant_label=None, *args):
        captured.append((size, variant_label, args, coordinator.core.speculative._capturing_all_resident))

    for label, extra in ((None, ()), ("nolora", ("sparse",))):
        captured.clear()
        hooks._capture_one_shape(capture_one_shape, graph_runner(coordinator), 4, None, None, label, *extra)
        ours = compat.all_resident_verify_variant(label)
        assert captured == [(4, label, extra, False), (4, ours, extra, True)]
        assert not coordinator.core.speculative._capturing_all_resident
    assert compat.all_resident_verify_variant("nolora") == f"nolora+{compat.ALL_RESIDENT_VERIFY}"
    # Captured once: the draft runner, a decode graph, a coordinator that never keeps requests resident, none.
    always_offload = HookedRun(host_lag=False, resident_first=False).coordinator
    for runner in (graph_runner(coordinator, draft=True), graph_runner(coordinator, mode="DECODE"),
                   graph_runner(always_offload), graph_runner(None)):
        captured.clear()
        hooks._capture_one_shape(capture_one_shape, runner, 2, None)
        assert [entry[1:] for entry in captured] == [(None, (), False)]

    runner = graph_runner(coordinator)
    verify = types.SimpleNamespace(forward_mode=ForwardMode.TARGET_VERIFY)
    assert hooks._resolve_lora_variant_after(None, runner, verify) is None  # nothing prepared
    req = run.admit("a", PAGE + 2)
    batch = run.batch([req])
    batch.hisparse_coordinator = coordinator
    run.reserve(batch)
    batch.forward_mode = ForwardMode.TARGET_VERIFY
    hooks._eagle_prepare_for_verify_after(None, None, run.stack.req_to_token_pool, batch, None)
    assert coordinator.verify_all_resident()
    label = hooks._resolve_lora_variant_after(None, runner, verify)
    assert label == compat.ALL_RESIDENT_VERIFY
    decode = types.SimpleNamespace(forward_mode=ForwardMode.DECODE)
    assert hooks._resolve_lora_variant_after("nolora", runner, decode) is None
    assert hooks._resolve_lora_variant_after(None, graph_runner(coordinator, draft=True), verify) is None
    keys = {DecodeCudaGraphRunner._make_graph_key(runner, 4, None, variant) for variant in (None, label)}
    assert len(keys) == 2


@pytest.mark.parametrize("host_lag", [False, True])
def test_through_the_hooks_positions_a_buffer_cannot_hold_are_left_out_and_never_accepted(host_lag):
    """A buffer of top_k slots with T = 2: an offloaded request's second position, when its misses do not fit
    the slots its first position left, is left out by H4's swap-in and H10 caps the acceptance (0.5.17 - 0.5.21;
    tests/sglang/test_speculative_sglang.py runs the same on 0.5.22+)."""
    run_positions_left_out(HookedRun(host_lag=host_lag, resident_first=False, buffer_size=128, top_k=128))


def test_the_hooks_hand_the_coordinator_sglangs_slots_lengths_and_accept_lengths():
    run = HookedRun(host_lag=True, resident_first=False)
    reqs = [run.admit("a", 2 * PAGE + 3), run.admit("b", PAGE + 1)]
    run.step(reqs, [T, 1])
    run.step(reqs, [1, T])
    slots = [compat.req_slot(req) for req in reqs]
    prepare = run.spies["prepare_verify"].calls
    assert [call[:3] for call in prepare] == [
        [slots, [2 * PAGE + 3, PAGE + 1], [3 * PAGE, 2 * PAGE]],
        [slots, [2 * PAGE + 3, PAGE + 1], [3 * PAGE, 2 * PAGE]],  # c lags one verify
    ]
    assert [call[4] for call in prepare] == [[2 * PAGE + 3, PAGE + 1], [2 * PAGE + 3 + T, PAGE + 2]]
    assert all(call[5] == T for call in prepare)
    assert [call[2] for call in run.spies["commit_verify"].calls] == [[T, 1], [1, T]]
    swaps = run.spies["swap_in_verify"].calls
    assert len(swaps) == 2 * LAYERS and [call[3] for call in swaps[:LAYERS]] == list(range(LAYERS))
    assert swaps[0][1] == [2 * PAGE + 3, PAGE + 1]  # s from dsa_seqlens_expanded


def test_outside_a_verify_with_our_coordinator_the_hooks_call_sglang_unchanged():
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    run = HookedRun(host_lag=False)
    req = run.admit("a", PAGE + 2)
    batch = run.batch([req])
    batch.hisparse_coordinator = run.coordinator
    batch.forward_mode = ForwardMode.IDLE
    hooks._eagle_prepare_for_verify_after(None, None, None, batch, None)
    hooks._run_eagle_verify_after(types.SimpleNamespace(accept_lens=torch.zeros(0, dtype=torch.int32)), batch)
    assert run.spies["prepare_verify"].calls == run.spies["commit_verify"].calls == []
    # An EXTEND forward (prefill) is SGLang's own; so is everything without our coordinator.
    backend = types.SimpleNamespace(hisparse_coordinator=run.coordinator)
    extend = types.SimpleNamespace(forward_mode=ForwardMode.EXTEND)
    assert (
        hooks._forward_extend(lambda *a, **k: "sglang", backend, 1, 2, 3, None, extend, topk_indices=None) == "sglang"
    )
    verify = types.SimpleNamespace(forward_mode=ForwardMode.TARGET_VERIFY)
    none = types.SimpleNamespace(hisparse_coordinator=None)
    assert hooks._forward_extend(lambda *a, **k: "sglang", none, 1, 2, 3, None, verify) == "sglang"
    without = run.stack.cache
    run.stack.allocator.runtime.coordinator.num_draft_tokens = 0  # a coordinator started without speculation
    hooks._alloc_for_spec_decode(lambda *a, **k: None, without, None)
    assert not run.stack.allocator.runtime.reserving_logical_only
    batch.forward_mode = ForwardMode.TARGET_VERIFY
    hooks._eagle_prepare_for_verify_after(None, None, None, batch, None)
    assert run.spies["prepare_verify"].calls == []


def test_the_verify_top_k_is_unfused_only_in_a_verify_with_our_coordinator():
    from sglang.srt.layers.attention.dsa.dsa_indexer_metadata import DSAIndexerMetadata
    from sglang.srt.layers.attention.dsa.dsa_topk_backend import TopkTransformMethod
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    run = HookedRun(host_lag=False)
    metadata = DSAIndexerMetadata(attn_metadata=None, topk_transform_method=TopkTransformMethod.PAGED)
    ours = types.SimpleNamespace(hisparse_coordinator=run.coordinator)
    verify = types.SimpleNamespace(forward_mode=ForwardMode.TARGET_VERIFY)
    assert hooks._get_indexer_metadata_after(metadata, ours, 0, verify).force_unfused_topk is True
    extend = types.SimpleNamespace(forward_mode=ForwardMode.EXTEND)
    assert hooks._get_indexer_metadata_after(metadata, ours, 0, extend) is metadata
    theirs = types.SimpleNamespace(hisparse_coordinator=None)
    assert hooks._get_indexer_metadata_after(metadata, theirs, 0, verify) is metadata


def test_the_verify_top_k_is_fused_only_where_sglang_would_run_its_v2_kernel(caplog):
    """H5 takes SGLang's fused top-k (through the verify page table) only where SGLang's dispatch would run its
    v2 paged kernel; the unfused top-k (positions) everywhere else, and the swap-ins are told which."""
    import dataclasses

    from sglang.srt.layers.attention.dsa.dsa_indexer_metadata import DSAIndexerMetadata
    from sglang.srt.layers.attention.dsa.dsa_topk_backend import DSATopKBackend, TopkTransformMethod
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from hisparse_sglang.errors import UnsupportedSetupError

    run = HookedRun(host_lag=False)
    runtime = run.coordinator.runtime
    attn = types.SimpleNamespace(
        real_page_table=torch.zeros(T, 4, dtype=torch.int32), topk_v2_plan=torch.zeros(T + 1, dtype=torch.int32),
        page_size=PAGE, dsa_seqlens_expanded=torch.full((T,), 8, dtype=torch.int32), cu_seqlens_q=None,
        topk_indices_offset=None, token_to_batch_idx=None,  # a DSAMetadata field; 0.5.21's top-k reads it first
    )
    fusable = DSAIndexerMetadata(attn_metadata=attn, topk_transform_method=TopkTransformMethod.PAGED)
    ours = types.SimpleNamespace(hisparse_coordinator=run.coordinator)
    verify = types.SimpleNamespace(forward_mode=ForwardMode.TARGET_VERIFY, req_pool_indices=torch.tensor([1]))
    with caplog.at_level(logging.INFO, logger="hisparse_sglang"):
        fused = hooks._get_indexer_metadata_after(fusable, ours, 0, verify)
        hooks._get_indexer_metadata_after(fusable, ours, 1, verify)
    assert fused.verify_page_table is not None and fused.force_unfused_topk is False and runtime.verify_top_k_fused
    said = [r.getMessage() for r in caplog.records if "verify's top-k" in r.getMessage()]
    assert len(said) == 1 and "fused v2 kernel through the verify page table" in said[0], said  # once, not per layer
    assert fused.get_page_table_64() is attn.real_page_table
    # A call SGLang would not route to its v2 kernel (row starts given) would map through the unfused transform's
    # table: refused by name instead of yielding locations the swap-in would misread.
    with pytest.raises(UnsupportedSetupError, match="left SGLang's fused v2 path"):
        fused.topk_transform(torch.zeros(T, 8), 4, ks=torch.zeros(T, dtype=torch.int32))
    for other in (
        dataclasses.replace(fusable, force_unfused_topk=True),  # SGLANG_DSA_FUSE_TOPK off / PD IndexShare
        dataclasses.replace(fusable, topk_transform_method=TopkTransformMethod.RAGGED),
        dataclasses.replace(fusable, topk_backend=DSATopKBackend.TORCH),
        dataclasses.replace(fusable, attn_metadata=types.SimpleNamespace(real_page_table=attn.real_page_table)),
    ):
        with caplog.at_level(logging.INFO, logger="hisparse_sglang"):
            unfused = hooks._get_indexer_metadata_after(other, ours, 0, verify)
        assert unfused.force_unfused_topk is True and not hasattr(unfused, "verify_page_table")
        assert not runtime.verify_top_k_fused
    said = [r.getMessage() for r in caplog.records if "verify's top-k" in r.getMessage()]
    assert len(said) == 2 and "unfused top-k (positions" in said[1], said  # the change is said once
    assert not compat.verify_top_k_fusable(fusable, 4096)  # beyond what the v2 kernel serves
    assert compat.verify_top_k_fusable(fusable, 2048)


def test_a_translation_of_another_shape_than_the_verify_rows_is_refused():
    run = HookedRun(host_lag=False)
    runtime = run.stack.allocator.runtime
    with runtime.verify_rows_for_translation(torch.zeros(2 * T, 4, dtype=torch.int32)):
        with pytest.raises(ValueError, match="does not match hooks_speculative.py"):
            run.stack.pool.translate_loc_to_hisparse_device(torch.zeros(2 * T, 5, dtype=torch.int64))
    assert runtime.take_verify_rows(torch.zeros(1)) is None


def _staged_future_map():
    """SGLang's own FutureMap of an EAGLE server (CPU), after a prefill published slots 3 and 5's draft state."""
    from sglang.srt.managers.overlap_utils import FutureMap, RelayPayload
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    algo = SpeculativeAlgorithm.from_string("EAGLE")
    pool = ReqToTokenPool(size=8, max_context_len=64, device="cpu", enable_memory_saver=False)
    future_map = FutureMap(torch.device("cpu"), algo, pool, needs_cpu_seq_lens=False)
    slots = torch.tensor([3, 5])
    future_map.stash(
        slots,
        RelayPayload(
            bonus_tokens=torch.tensor([11, 12]),
            topk_p=torch.tensor([[0.5], [0.25]]),
            topk_index=torch.tensor([[7], [9]]),
            hidden_states=torch.ones(2, 4),
        ),
    )
    return future_map, slots, algo


def _staging(slots, last_tokens):
    """What SGLang's _build_hisparse_decode_batch does with the future map (its bonus-only stash), as the
    original of the AROUND hook."""
    from sglang.srt.managers.overlap_utils import RelayPayload

    def original(scheduler, reqs):
        scheduler.future_map.stash(slots, RelayPayload(bonus_tokens=last_tokens))
        return types.SimpleNamespace(req_pool_indices=slots, spec_info=None)

    return original


def test_a_request_leaving_staging_keeps_the_draft_state_its_prefill_published():
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
    from sglang.srt.speculative.eagle_info import EagleDraftInput

    run = HookedRun(host_lag=False)
    future_map, slots, algo = _staged_future_map()
    scheduler = types.SimpleNamespace(spec_algorithm=algo, hisparse_coordinator=run.coordinator, future_map=future_map)
    original = _staging(slots, torch.tensor([21, 22]))
    with pytest.raises(AttributeError):  # SGLang's own stash, unhooked: a bonus-only payload under speculation
        original(scheduler, [])
    batch = hooks._build_hisparse_decode_batch(original, scheduler, [])
    assert future_map.output_tokens_buf[slots].tolist() == [21, 22]
    assert future_map.topk_p_buf[slots].flatten().tolist() == [0.5, 0.25]
    assert future_map.topk_index_buf[slots].flatten().tolist() == [7, 9]
    assert "stash" not in vars(future_map)  # SGLang's own stash again after the call
    assert isinstance(batch.spec_info, EagleDraftInput)
    assert batch.spec_info.future_indices.tolist() == [3, 5]
    assert batch.spec_info.capture_hidden_mode == CaptureHiddenMode.LAST


def test_staging_without_our_speculative_coordinator_is_sglangs_own():
    from sglang.srt.managers.overlap_utils import FutureMap
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    future_map, slots, algo = _staged_future_map()
    theirs = types.SimpleNamespace(spec_algorithm=algo, hisparse_coordinator=None, future_map=future_map)
    with pytest.raises(AttributeError):
        hooks._build_hisparse_decode_batch(_staging(slots, torch.tensor([21, 22])), theirs, [])
    run = HookedRun(host_lag=False)
    none = SpeculativeAlgorithm.from_string("NONE")
    pool = ReqToTokenPool(size=8, max_context_len=64, device="cpu", enable_memory_saver=False)
    plain = types.SimpleNamespace(
        spec_algorithm=none,
        hisparse_coordinator=run.coordinator,
        future_map=FutureMap(torch.device("cpu"), none, pool, needs_cpu_seq_lens=False),
    )
    batch = hooks._build_hisparse_decode_batch(_staging(slots, torch.tensor([1, 2])), plain, [])
    assert batch.spec_info is None
    assert plain.future_map.output_tokens_buf[slots].tolist() == [1, 2]


def test_the_draft_pool_is_sglangs_plain_pool_over_the_logical_space():
    import msgspec
    from sglang.srt.mem_cache.kv_cache_configurator import _PoolSizes

    run = HookedRun(host_lag=False)
    allocator = run.stack.allocator
    seen = []

    def build(self, *, max_total_num_tokens):
        seen.append(compat.hisparse_enabled())
        return "pool"

    draft = types.SimpleNamespace(is_draft_worker=True, token_to_kv_pool_allocator=allocator, pool_page_size=PAGE)
    target = types.SimpleNamespace(is_draft_worker=False, token_to_kv_pool_allocator=allocator, pool_page_size=PAGE)
    assert hooks._build_dsa_kv_pool(build, draft, max_total_num_tokens=10) == "pool"
    hooks._build_dsa_kv_pool(build, target, max_total_num_tokens=10)
    assert seen == [False, True] and compat.hisparse_enabled()

    fields = {name: None for name in _PoolSizes.__struct_fields__}
    sizes = _PoolSizes(**dict(fields, max_total_num_tokens=allocator.device_tokens, max_running_requests=8))
    logical = hooks._derive_pool_sizes_after(sizes, draft, config=None).max_total_num_tokens
    assert (
        logical == -(-allocator.size_full // PAGE) * PAGE and logical >= allocator.size_full > allocator.device_tokens
    )
    assert hooks._derive_pool_sizes_after(sizes, target, config=None) is sizes
    theirs = types.SimpleNamespace(is_draft_worker=True, token_to_kv_pool_allocator=object(), pool_page_size=PAGE)
    assert msgspec.structs.asdict(hooks._derive_pool_sizes_after(sizes, theirs, config=None)) == msgspec.structs.asdict(
        sizes
    )


def test_the_model_runner_hook_leaves_the_draft_runner_without_a_coordinator():
    from hisparse_sglang.integration.sglang.hooks import _maybe_init_hisparse_coordinator

    draft = types.SimpleNamespace(enable_hisparse=True, is_draft_worker=True, hisparse_coordinator=None)
    _maybe_init_hisparse_coordinator(draft)
    assert draft.hisparse_coordinator is None
