"""Scheduler-facing calls on the SGLang adapter, built from SGLang's real pool classes on CPU tensors.

The script mirrors what SGLang 0.5.17's scheduler does: prefill (alloc_extend, KV written through
the pool), staging, collect, decode steps (alloc_decode, map_last_loc_to_buffer, KV write,
per-layer swap-in), finish / abort during staging / retract, then the KV release. Every row the
swap-in returns must hold the right token's KV, and nothing may leak.
"""

import array
import types

import pytest
import torch

pytestmark = pytest.mark.sglang

LAYERS = 2
PAGE = 64


def token_values(uid: int, positions: torch.Tensor, layer: int):
    """KV of a token, as small integers (exact in bf16): [pos % 128, pos // 128, uid, layer, ...]."""
    n = positions.numel()
    nope = torch.zeros((n, 1, 512), dtype=torch.bfloat16)
    rope = torch.zeros((n, 1, 64), dtype=torch.bfloat16)
    nope[:, 0, 0] = (positions % 128).to(torch.bfloat16)
    nope[:, 0, 1] = (positions // 128).to(torch.bfloat16)
    nope[:, 0, 2] = float(uid)
    nope[:, 0, 3] = float(layer)
    rope[:, 0, 5] = float(uid + layer)
    return nope, rope


class Stack:
    def __init__(self, resident_first=True, device_tokens=PAGE * 40, ratio=4, buffer_size=256, top_k=128):
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

        from hisparse_sglang.config import HiSparseConfig
        from hisparse_sglang.integration.sglang.allocator import HiSparseTokenAllocator
        from hisparse_sglang.integration.sglang.coordinator import SGLangHiSparseCoordinator
        from hisparse_sglang.integration.sglang.pool import HiSparseDevicePool

        self.config = HiSparseConfig(
            top_k=top_k, device_buffer_size=buffer_size, host_to_device_ratio=ratio,
            resident_first=resident_first, switch_cooldown_steps=2, promote_free_fraction=0.0,
        )
        self.pool = HiSparseDevicePool(
            size=device_tokens, page_size=PAGE, kv_lora_rank=512, dtype=torch.bfloat16, qk_rope_head_dim=64,
            layer_num=LAYERS, device="cpu", index_head_dim=128, enable_memory_saver=False, kv_cache_dim=576,
            host_to_device_ratio=ratio,
        )
        self.allocator = HiSparseTokenAllocator(
            device_tokens, page_size=PAGE, dtype=torch.bfloat16, device="cpu", kvcache=self.pool,
            need_sort=False, host_to_device_ratio=ratio,
        )
        self.req_to_token_pool = ReqToTokenPool(size=8, max_context_len=4096, device="cpu", enable_memory_saver=False)
        self.coordinator = SGLangHiSparseCoordinator(
            self.config, self.req_to_token_pool, self.allocator, self.pool, "cpu"
        )
        self.layers = [types.SimpleNamespace(layer_id=i) for i in range(LAYERS)]
        self.lens: dict[str, int] = {}
        self.uids: dict[str, int] = {}
        self.generator = torch.Generator().manual_seed(0)

    def new_req(self, rid: str, prompt_len: int):
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        req = Req(rid, "", array.array("i", range(prompt_len)), SamplingParams(max_new_tokens=64))
        self.uids[rid] = len(self.uids) + 1
        return req

    def write_kv(self, req, positions: torch.Tensor) -> None:
        """The model's KV write: SGLang's set_mla_kv_buffer translates the location the same way
        (its Triton writer has no CPU path, so the bytes are stored directly here)."""
        locs = self.req_to_token_pool.req_to_token[req.req_pool_idx, positions].to(torch.int64)
        rows = self.pool.translate_loc_to_hisparse_device(locs).to(torch.int64)
        assert bool((rows > 0).all()), "a token is written to an unmapped location"
        for layer in self.layers:
            nope, rope = token_values(self.uids[req.rid], positions, layer.layer_id)
            self.pool.kv_buffer[layer.layer_id][rows] = torch.cat([nope, rope], dim=-1)

    def prefill(self, req, prompt_len: int) -> None:
        from sglang.srt.managers.schedule_batch import ReqKvInfo

        self.req_to_token_pool.alloc([req])
        locs = self.allocator.alloc_extend(
            torch.tensor([0]), torch.tensor([0]), torch.tensor([prompt_len]), torch.tensor([prompt_len]),
            torch.tensor([-1]), prompt_len,
        )
        assert locs is not None
        self.req_to_token_pool.req_to_token[req.req_pool_idx, :prompt_len] = locs.to(torch.int32)
        req.kv = ReqKvInfo(kv_allocated_len=prompt_len, swa_evicted_seqlen=0)
        req.set_extend_range(0, prompt_len)
        self.write_kv(req, torch.arange(prompt_len))
        self.lens[req.rid] = prompt_len
        self.coordinator.admit_request_into_staging(req)
        assert req.hisparse_staging

    def decode(self, reqs) -> None:
        slots = torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64)
        lens = torch.tensor([self.lens[r.rid] for r in reqs], dtype=torch.int64)
        last_loc = self.req_to_token_pool.req_to_token[slots, lens - 1].to(torch.int64)
        out_cache_loc = self.allocator.alloc_decode(lens + 1, lens + 1, last_loc)
        self.req_to_token_pool.req_to_token[slots, lens] = out_cache_loc.to(torch.int32)
        lens = lens + 1
        self.coordinator.map_last_loc_to_buffer(lens, out_cache_loc, slots, lens.clone(), slots.clone())
        self.coordinator.wait_for_pending_backup()
        for r in reqs:
            self.lens[r.rid] += 1
            r.kv.kv_allocated_len += 1
            self.write_kv(r, torch.tensor([self.lens[r.rid] - 1]))
        self.coordinator.num_real_reqs.fill_(len(reqs))
        for layer in self.layers:
            top_k = torch.full((len(reqs), self.config.top_k), -1, dtype=torch.int32)
            for b, r in enumerate(reqs):
                chosen = torch.randperm(self.lens[r.rid], generator=self.generator)[: self.config.top_k - 1]
                top_k[b, : chosen.numel()] = chosen.to(torch.int32)
                top_k[b, -1] = self.lens[r.rid] - 1
            rows = self.coordinator.swap_in_selected_pages(slots, lens, top_k, layer.layer_id)
            for b, r in enumerate(reqs):
                valid = top_k[b] >= 0
                positions = top_k[b][valid].to(torch.int64)
                got = self.pool.kv_buffer[layer.layer_id][rows[b][valid].to(torch.int64)]
                nope, rope = token_values(self.uids[r.rid], positions, layer.layer_id)
                assert torch.equal(got[:, :, :512], nope), f"{r.rid} layer {layer.layer_id}: wrong KV rows"
                assert torch.equal(got[:, :, 512:], rope)

    def release(self, req) -> None:
        """What release_kv_cache does for a ChunkCache: free the request's locations and its slot."""
        self.allocator.free(self.req_to_token_pool.req_to_token[req.req_pool_idx, : req.kv.kv_allocated_len])
        self.req_to_token_pool.free(req)
        req.kv = None

    def assert_all_free(self) -> None:
        rows = self.allocator.rows
        assert rows.logical.free_pages == rows.logical.capacity_pages, "host rows leaked"
        assert rows.device_rows.free_pages == rows.device_rows.capacity_pages, "device rows leaked"
        assert self.coordinator.buffers.used_buffers == 0, "buffers leaked"
        assert not self.coordinator.core.requests and not self.coordinator.has_ongoing_staging()
        assert int((rows.device_row_of_loc[:-1] != 0).sum()) == 0


@pytest.mark.parametrize("resident_first", [True, False])
def test_scripted_scheduler_run_leaks_nothing(resident_first):
    stack = Stack(resident_first=resident_first)
    a, b, c = stack.new_req("a", 900), stack.new_req("b", 300), stack.new_req("c", 700)
    for req, n in ((a, 900), (b, 300), (c, 700)):
        stack.prefill(req, n)
    # c is aborted while staging (before the scheduler collects it)
    stack.coordinator.request_finished(c)
    stack.release(c)
    running = stack.coordinator.collect_ready_reqs()
    assert {r.rid for r in running} == {"a", "b"}
    assert not any(r.hisparse_staging for r in running)
    for _ in range(12):
        stack.decode(running)
    # b is retracted (it will come back through a new prefill), a finishes
    stack.coordinator.retract_req(b)
    stack.release(b)
    for _ in range(3):
        stack.decode([a])
    stack.coordinator.request_finished(a)
    stack.release(a)
    stack.assert_all_free()


def test_long_requests_are_demoted_under_pressure_and_swap_in_stays_correct():
    stack = Stack(resident_first=True, device_tokens=PAGE * 36)
    reqs = [stack.new_req(f"r{i}", 800) for i in range(3)]
    for req in reqs[:2]:
        stack.prefill(req, 800)
    running = stack.coordinator.collect_ready_reqs()
    stack.decode(running)
    # a third long prefill needs device pages only demotions can free
    stack.prefill(reqs[2], 800)
    running += stack.coordinator.collect_ready_reqs()
    for _ in range(10):
        stack.decode(running)
    stats = stack.coordinator.core.stats()
    assert stats.demotions >= 1 and stats.offloaded_requests >= 1
    assert stats.swap_in_lookups > 0
    token_stats = stack.coordinator.get_token_stats()
    assert 0 < token_stats.device_token_usage <= 1 and 0 < token_stats.host_token_usage <= 1
    assert stack.allocator.available_size() <= stack.allocator.device_tokens
    for req in running:
        stack.coordinator.request_finished(req)
        stack.release(req)
    stack.assert_all_free()


def test_release_hook_frees_state_when_request_finished_is_skipped():
    """SGLang 0.5.17 releases a PD waiting-queue abort without request_finished; our hook covers it."""
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.chunk_cache import ChunkCache

    from hisparse_sglang.integration.sglang.hooks import _release_kv_cache_before

    stack = Stack(resident_first=False)
    req = stack.new_req("x", 700)
    stack.prefill(req, 700)
    running = stack.coordinator.collect_ready_reqs()
    stack.decode(running)
    assert stack.coordinator.buffers.used_buffers == 1  # demoted to its buffer (always-offload)
    cache = ChunkCache(CacheInitParams(disable=True, req_to_token_pool=stack.req_to_token_pool,
                                       token_to_kv_pool_allocator=stack.allocator, page_size=PAGE))
    _release_kv_cache_before(req, cache)
    stack.release(req)
    stack.assert_all_free()


def test_pd_host_pool_exposes_layer_regions_and_preallocated_rows():
    stack = Stack()
    host = stack.coordinator.mem_pool_host
    pointers, lengths, item_lens = host.get_contiguous_buf_infos()
    assert len(pointers) == LAYERS and item_lens == [1152 * PAGE] * LAYERS
    assert lengths[0] == stack.allocator.rows.num_locs * 1152
    locs = stack.allocator.alloc_logical_only(
        prefix_lens=torch.tensor([0]), prefix_lens_cpu=torch.tensor([0]), seq_lens=torch.tensor([130]),
        seq_lens_cpu=torch.tensor([130]), last_loc=torch.tensor([-1]), extend_num_tokens=130,
    )
    host.preallocated[3] = locs
    rows = host.alloc_paged_token_slots(None, None, 3, 0, 130)
    assert torch.equal(rows, locs) and bool((rows[::PAGE] % PAGE == 0).all())
    assert bool((stack.allocator.rows.translate(locs) == 0).all()), "logical-only locations must not map to device rows"
