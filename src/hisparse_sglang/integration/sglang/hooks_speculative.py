"""The speculative verify step on SGLang 0.5.17 - 0.5.21 (docs/speculative.md 2.7, hooks H1 - H9), and the
acceptance cap on every release (H10).

From 0.5.22 SGLang's EAGLE worker calls the HiSparse coordinator's verify step itself and keeps the
draft (NextN) layer dense on the GPU; these releases do neither. The hooks below make the same calls
at the same points and give the draft runner the same dense pool over the logical space. Each body
only forwards: the verify step is the adapter's (``SGLangHiSparseCoordinator``: ``prepare_spec_verify``,
the 3-D ``swap_in_selected_pages``, ``commit_spec_accept_lens``), the hand-overs inside one SGLang call
are the runtime's (``HiSparseRuntime.logical_only_reserve``, ``verify_rows_for_translation``), and
what reads or builds SGLang objects is in ``compat`` / ``limits``. Every hook is a no-op unless the
object it receives belongs to hisparse-sglang (our allocator, or a coordinator started with ``T``).
Their specs (H1 - H9, H11 - H12: ``versions=compat.SPECULATIVE_HOOKED_SGLANG``; H10 every supported release: no
release calls the coordinator between sampling and the use of the accept lengths) are in ``hooks.HOOKS``.
"""

from __future__ import annotations

from hisparse_sglang.integration.sglang import compat
from hisparse_sglang.integration.sglang.hook_lookup import coordinator_of, runtime_of


def _verify_coordinator(coordinator):
    """``coordinator`` if it is hisparse-sglang's, started with speculative decoding; else None."""
    started = coordinator_of(coordinator)
    return coordinator if started is not None and started.num_draft_tokens else None


def _alloc_for_spec_decode(original, tree_cache, req_to_token_pool, **kwargs):
    """H1 AROUND alloc_for_spec_decode: the reserve gets logical locations only (0.5.22+ calls
    ``alloc_logical_only``); the coordinator's prepare binds device rows per request mode."""
    runtime = runtime_of(tree_cache.token_to_kv_pool_allocator)
    if runtime is None or _verify_coordinator(runtime.coordinator) is None:
        return original(tree_cache, req_to_token_pool, **kwargs)
    with runtime.logical_only_reserve():
        return original(tree_cache, req_to_token_pool, **kwargs)


def _eagle_prepare_for_verify_after(result, verify_input, req_to_token_pool, batch, target_worker):
    """H2 AFTER eagle_prepare_for_verify: ``batch.out_cache_loc`` holds the verify locations and
    ``batch.seq_lens`` is ``s``: bind them (0.5.22+ calls ``prepare_spec_verify(batch)`` there)."""
    coordinator = _verify_coordinator(batch.hisparse_coordinator)
    if coordinator is not None and not batch.forward_mode.is_idle():
        coordinator.prepare_spec_verify(batch)
    return result


def _run_eagle_verify_after(result, batch, **kwargs):
    """H3 AFTER run_eagle_verify: commit the accepted tokens (``result.accept_lens``, the root included;
    ``batch.seq_lens`` is still ``s``), before the draft extend (0.5.22+: ``commit_spec_accept_tokens``)."""
    coordinator = _verify_coordinator(batch.hisparse_coordinator)
    if coordinator is not None:
        coordinator.commit_spec_accept_lens(batch, result.accept_lens)
    return result


def _eagle_sample_after(result, verify_input, batch, *args, **kwargs):
    """H10 AFTER eagle_sample as run_eagle_verify calls it (every release): a verify position the swap-in
    left out (its request's positions named more distinct tokens than its buffer holds) is not accepted.
    ``result`` is ``(predict, accept_lens, accept_index)``; the last two are capped in place before
    run_eagle_verify derives the new lengths, the bonus tokens and the commit from them."""
    coordinator = _verify_coordinator(batch.hisparse_coordinator)
    if coordinator is not None:
        _, accept_lens, accept_index = result
        coordinator.cap_spec_accepts(batch, accept_lens, accept_index)
    return result


def _forward_extend(original, self, q, k, v, layer, forward_batch, *args, **kwargs):
    """H4 AROUND DeepseekSparseAttnBackend.forward_extend: in a TARGET_VERIFY forward, swap in the rows of
    the top-k (int32 ``[B, T, K]``: positions, or with H5's fused top-k a resident request's device rows) and
    hand them to the pool's one translation of the call's page table (0.5.22+ calls the 3-D
    ``swap_in_selected_pages`` in place of it)."""
    coordinator = _verify_coordinator(self.hisparse_coordinator)
    if coordinator is None or not forward_batch.forward_mode.is_target_verify():
        return original(self, q, k, v, layer, forward_batch, *args, **kwargs)
    topk_indices = compat.forward_extend_topk_indices(args, kwargs)
    batch = forward_batch.req_pool_indices.shape[0]
    positions = coordinator.num_draft_tokens
    rows = coordinator.swap_in_selected_pages(
        forward_batch.req_pool_indices, self.forward_metadata.dsa_seqlens_expanded,
        topk_indices.view(batch, positions, -1), layer.layer_id,
        resident_rows=coordinator.runtime.verify_top_k_fused,
    )
    with coordinator.runtime.verify_rows_for_translation(rows.view(batch * positions, -1)):
        return original(self, q, k, v, layer, forward_batch, *args, **kwargs)


def _get_indexer_metadata_after(result, self, layer_id, forward_batch):
    """H5 AFTER DeepseekSparseAttnBackend.get_indexer_metadata: the verify's top-k must give H4's swap-in
    positions of offloaded requests. Where SGLang would run its fused v2 top-k (it maps the positions through a
    page table in the same kernel), it maps them through the coordinator's verify page table, built once per
    forward: a resident request's entries come out as its device rows and the swap-in passes them through, an
    offloaded request's as positions. Elsewhere the top-k is the unfused one, positions for all (0.5.22+ forces
    that for TARGET_VERIFY)."""
    import dataclasses

    coordinator = _verify_coordinator(self.hisparse_coordinator)
    if coordinator is None or not forward_batch.forward_mode.is_target_verify():
        return result
    runtime = coordinator.runtime
    if not compat.verify_top_k_fusable(result, runtime.config.top_k):
        runtime.unfused_verify_top_k()
        return dataclasses.replace(result, force_unfused_topk=True)
    table = runtime.fused_verify_page_table(
        forward_batch.req_pool_indices, result.attn_metadata.real_page_table, layer_id
    )
    return compat.fused_verify_indexer_metadata(result, table)


def _all_resident_graph_coordinator(runner):
    """The coordinator of a target runner capturing TARGET_VERIFY graphs, if it is ours, started with speculative
    decoding, and puts requests resident first (only then can a step's requests all be resident); else None."""
    if not compat.target_verify_graph_runner(runner):
        return None
    coordinator = _verify_coordinator(runner.model_runner.hisparse_coordinator)
    return coordinator if coordinator is not None and coordinator.config.resident_first else None


def _capture_one_shape(original, self, size, forward, stream_idx=None, variant_label=None, *args, **kwargs):
    """H11 AROUND DecodeCudaGraphRunner.capture_one_shape: beside each TARGET_VERIFY graph SGLang captures, one of
    the same shape for steps whose requests are all resident, in which H4 runs no swap-in (a resident request's
    fused top-k entries are its device rows already): its ``T / G`` launches per layer are left out of such steps
    (docs/speculative.md 2.7). Both graphs read the same attention metadata: the DSA backend builds a shape's
    metadata at its first capture and refreshes it in place at the second, as for SGLang's LoRA variants."""
    original(self, size, forward, stream_idx, variant_label, *args, **kwargs)
    coordinator = _all_resident_graph_coordinator(self)
    if coordinator is None:
        return
    with coordinator.capturing_all_resident_verify():
        original(self, size, forward, stream_idx, compat.all_resident_verify_variant(variant_label), *args, **kwargs)


def _resolve_lora_variant_after(result, self, forward_batch):
    """H12 AFTER DecodeCudaGraphRunner._resolve_lora_variant (the label of the graph a batch replays): a verify
    step whose prepared requests are all resident replays H11's graph. The label is resolved again when the
    forward runs (``execute`` -> ``load_batch``), after H2 prepared the step; the earlier resolutions (can the
    batch run a graph, the plan stream's ``load_batch``) find both graphs captured for every size."""
    if not forward_batch.forward_mode.is_target_verify():
        return None
    coordinator = _all_resident_graph_coordinator(self)
    if coordinator is None or not coordinator.verify_all_resident():
        return None
    return compat.all_resident_verify_variant(result)


def _build_dsa_kv_pool(original, self, *, max_total_num_tokens):
    """H6 AROUND KVCacheConfigurator._build_dsa_kv_pool: the draft runner gets SGLang's plain DSA pool,
    not a HiSparse one (0.5.22+: ``not self.is_draft_worker``)."""
    if not (self.is_draft_worker and compat.hisparse_enabled()):
        return original(self, max_total_num_tokens=max_total_num_tokens)
    with compat.hisparse_disabled():
        return original(self, max_total_num_tokens=max_total_num_tokens)


def _derive_pool_sizes_after(result, self, *, config):
    """H7 AFTER KVCacheConfigurator._derive_pool_sizes: the draft pool is indexed by the target's
    logical locations, so it spans the allocator's logical space, page-rounded (0.5.22+: ``size_full``)."""
    from hisparse_sglang.integration.sglang import limits

    if not self.is_draft_worker:
        return result
    return limits.draft_pool_sizes(result, self.token_to_kv_pool_allocator, self.pool_page_size)


def _default_pool_configurator_init_after(result, self, kvc):
    """H8 AFTER DefaultPoolConfigurator.__init__: the memory budget counts the draft layers' KV at the
    logical size (``host_to_device_ratio`` per device token), not at the device size."""
    from hisparse_sglang.integration.sglang import limits

    limits.count_draft_kv_at_logical_size(self, kvc)


def _build_hisparse_decode_batch(original, self, reqs):
    """H9 AROUND Scheduler._build_hisparse_decode_batch: a request leaving staging enters decode with its
    draft state. The prefill published the request's draft outputs (top-k, hidden state) in the future map
    under its request slot; SGLang's staging then stashes a payload carrying only the bonus token, which
    these releases' ``FutureMap.stash`` cannot take under speculation (it writes every draft buffer from the
    payload: AttributeError on a None top-k, seen on an H200 with 0.5.17). Inside the call the stash
    refreshes the bonus token only, as 0.5.22's does; after it, the batch gets the draft input that reads
    the slots (0.5.22+: ``future_map.make_staged_spec_input``)."""
    if self.spec_algorithm.is_none() or _verify_coordinator(getattr(self, "hisparse_coordinator", None)) is None:
        return original(self, reqs)
    with compat.bonus_only_stash(self.future_map):
        batch = original(self, reqs)
    batch.spec_info = compat.staged_spec_input(self.future_map, self.spec_algorithm, batch.req_pool_indices)
    return batch
