"""Scheduler-facing calls on the SGLang adapter, built from SGLang's real pool classes on CPU tensors.

The script mirrors what SGLang 0.5.17's scheduler does: prefill (alloc_extend, KV written through
the pool), staging, collect, decode steps (alloc_decode, map_last_loc_to_buffer, KV write,
per-layer swap-in), finish / abort during staging / retract, then the KV release. Every row the
swap-in returns must hold the right token's KV, and nothing may leak.
"""

import array
import logging
import types

import drive
import pytest
import torch

from hisparse_sglang.integration.sglang import compat

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


# --kv-cache-dtype of the pool: the MLA pool's torch dtype and its row (kv_cache_dim elements, bytes)
KV_DTYPES = {
    "bf16": (torch.bfloat16, 576, 1152),
    # FlashMLA's fp8 layout: 512 fp8 nope + 4 fp32 scales + 64 bf16 rope (SGLang stores it as uint8)
    "fp8": (torch.float8_e4m3fn, 656, 656),
}


def token_rows(uid: int, positions: torch.Tensor, layer: int, row_bytes: int) -> torch.Tensor:
    """uint8 ``[n, row_bytes]``: a token's row as the pool stores it. A bf16 row is the bytes of
    :func:`token_values`; an fp8 row starts with their first 8 bytes (position, uid and layer as bf16,
    so a rejected draft's negative uid is recognisable, :func:`row_uids`) and every later byte comes
    from the same three values, so a copy that moves part of a row is caught."""
    n = positions.numel()
    nope, rope = token_values(uid, positions, layer)
    rows = torch.cat([nope, rope], dim=-1).reshape(n, 576).view(torch.uint8)
    if row_bytes == rows.shape[1]:
        return rows
    words = -(-(row_bytes - 8) // 4)
    fill = positions.to(torch.int64).reshape(n, 1) * 1_000_003 + uid * 7_919 + layer * 104_729 + torch.arange(words)
    fill = (fill & 0x7FFFFFFF).to(torch.int32).view(torch.uint8).reshape(n, 4 * words)
    return torch.cat([rows[:, :8], fill[:, : row_bytes - 8]], dim=1)


def row_uids(rows: torch.Tensor) -> torch.Tensor:
    """The uid field of byte rows ``[n, row_bytes]`` (see :func:`token_rows`)."""
    return rows[:, 4:6].contiguous().view(torch.bfloat16).reshape(-1)


class Stack:
    """SGLang's pools and our adapter on CPU tensors. ``tp_group``/``dp_attention``/``share_host_pool`` make it
    one TP rank (tests/sglang/tp_share_peer.py); ``collective`` runs where a TP forward has its all-reduces."""

    def __init__(
        self, resident_first=True, device_tokens=PAGE * 40, ratio=4, buffer_size=256, top_k=128, req_to_token_pool=None,
        tp_group=None, dp_attention=False, share_host_pool=False, collective=None, num_draft_tokens=0,
        kv_dtype="bf16",
    ):
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

        from hisparse_sglang.config import HiSparseConfig
        from hisparse_sglang.integration.sglang.allocator import HiSparseTokenAllocator
        from hisparse_sglang.integration.sglang.coordinator import SGLangHiSparseCoordinator
        from hisparse_sglang.integration.sglang.pool import HiSparseDevicePool

        self.config = HiSparseConfig(
            top_k=top_k, device_buffer_size=buffer_size, host_to_device_ratio=ratio,
            resident_first=resident_first, switch_cooldown_steps=2, promote_free_fraction=0.0,
            share_host_pool_across_tp=share_host_pool,
        )
        dtype, kv_cache_dim, self.row_bytes = KV_DTYPES[kv_dtype]
        self.pool = HiSparseDevicePool(
            size=device_tokens, page_size=PAGE, kv_lora_rank=512, dtype=dtype, qk_rope_head_dim=64,
            layer_num=LAYERS, device="cpu", index_head_dim=128, enable_memory_saver=False, kv_cache_dim=kv_cache_dim,
            host_to_device_ratio=ratio,
        )
        assert self.pool.kv_buffer[0].view(torch.uint8).shape[1:] == (1, self.row_bytes)
        self.allocator = HiSparseTokenAllocator(
            device_tokens, page_size=PAGE, dtype=dtype, device="cpu", kvcache=self.pool,
            need_sort=False, host_to_device_ratio=ratio,
        )
        # A PD decode test passes SGLang's DecodeReqToTokenPool.
        self.req_to_token_pool = req_to_token_pool or ReqToTokenPool(
            size=8, max_context_len=4096, device="cpu", enable_memory_saver=False
        )
        self.coordinator = self.pool.runtime.start(
            self.config, self.req_to_token_pool, "cpu", tp_group=tp_group, dp_attention=dp_attention,
            num_draft_tokens=num_draft_tokens,
        )
        assert isinstance(self.coordinator, SGLangHiSparseCoordinator)
        self.collective = collective or (lambda: None)
        self.cache = drive.disabled_prefix_cache(self.req_to_token_pool, self.allocator, PAGE)
        self.layers = [types.SimpleNamespace(layer_id=i) for i in range(LAYERS)]
        self.lens: dict[str, int] = {}
        self.uids: dict[str, int] = {}
        self.generator = torch.Generator().manual_seed(0)

    def kv_rows(self, layer_id: int) -> torch.Tensor:
        """The device pool's layer as byte rows ``[rows, row_bytes]`` (a view)."""
        return self.pool.kv_buffer[layer_id].view(torch.uint8).reshape(-1, self.row_bytes)

    def token_rows(self, uid: int, positions: torch.Tensor, layer_id: int) -> torch.Tensor:
        return token_rows(uid, positions, layer_id, self.row_bytes)

    def new_req(self, rid: str, prompt_len: int):
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        req = Req(rid, "", array.array("i", range(prompt_len)), SamplingParams(max_new_tokens=64))
        self.uids[rid] = len(self.uids) + 1
        return req

    def write_kv(self, req, positions: torch.Tensor) -> None:
        """The model's KV write: SGLang's set_mla_kv_buffer translates the location the same way
        (its Triton writer has no CPU path, so the bytes are stored directly here)."""
        locs = self.req_to_token_pool.req_to_token[compat.req_slot(req), positions].to(torch.int64)
        rows = self.pool.translate_loc_to_hisparse_device(locs).to(torch.int64)
        assert bool((rows > 0).all()), "a token is written to an unmapped location"
        for layer in self.layers:
            self.kv_rows(layer.layer_id)[rows] = self.token_rows(self.uids[req.rid], positions, layer.layer_id)

    def prefill(self, req, prompt_len: int) -> None:
        self.req_to_token_pool.alloc([req])
        locs = self.allocator.alloc_extend(
            torch.tensor([0]), torch.tensor([0]), torch.tensor([prompt_len]), torch.tensor([prompt_len]),
            torch.tensor([-1]), prompt_len,
        )
        assert locs is not None
        self.req_to_token_pool.req_to_token[compat.req_slot(req), :prompt_len] = locs.to(torch.int32)
        drive.begin_prefill(req, prompt_len)
        self.write_kv(req, torch.arange(prompt_len))
        self.lens[req.rid] = prompt_len
        self.collective()  # the prefill forward's last all-reduce
        self.coordinator.admit_request_into_staging(req)
        assert req.hisparse_staging

    def decode(self, reqs) -> None:
        slots = torch.tensor([compat.req_slot(r) for r in reqs], dtype=torch.int64)
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
            drive.set_kv_committed_len(r, r.kv.kv_allocated_len)
            self.write_kv(r, torch.tensor([self.lens[r.rid] - 1]))
        self.coordinator.num_real_reqs.fill_(len(reqs))
        for layer in self.layers:
            top_k = torch.full((len(reqs), self.config.top_k), -1, dtype=torch.int32)
            for b, r in enumerate(reqs):
                chosen = torch.randperm(self.lens[r.rid], generator=self.generator)[: self.config.top_k - 1]
                top_k[b, : chosen.numel()] = chosen.to(torch.int32)
                top_k[b, -1] = self.lens[r.rid] - 1
            rows = self.coordinator.swap_in_selected_pages(slots, lens, top_k, layer.layer_id)
            self.collective()  # the layer's all-reduce, after its attention
            for b, r in enumerate(reqs):
                valid = top_k[b] >= 0
                positions = top_k[b][valid].to(torch.int64)
                got = self.kv_rows(layer.layer_id)[rows[b][valid].to(torch.int64)]
                want = self.token_rows(self.uids[r.rid], positions, layer.layer_id)
                assert torch.equal(got, want), f"{r.rid} layer {layer.layer_id}: wrong KV rows"

    def pd_prealloc(self, req, fill_len: int) -> torch.Tensor:
        """DecodePreallocQueue._pre_alloc under HiSparse (with our hook): logical locations only,
        written to req_to_token after the host pool was asked for them. Returns the host rows."""
        from sglang.srt.disaggregation.decode import alloc_for_decode_prealloc_hisparse

        from hisparse_sglang.integration.sglang.hooks import _alloc_for_decode_prealloc_after

        self.req_to_token_pool.alloc([req])
        drive.set_kv_committed_len(req, fill_len)
        prealloc = dict(req=req, fill_len=fill_len, uses_swa_tail=False, swa_tail_len=0)
        locs = alloc_for_decode_prealloc_hisparse(self.allocator, **prealloc)
        _alloc_for_decode_prealloc_after(locs, self.allocator, **prealloc)
        host_rows = self.coordinator.mem_pool_host.alloc_paged_token_slots(
            self.coordinator.req_to_host_pool, self.coordinator.req_to_host_pool_allocated_len, compat.req_slot(req), 0,
            fill_len,
        )
        self.req_to_token_pool.write((compat.req_slot(req), slice(0, fill_len)), locs.to(torch.int32))
        self.lens[req.rid] = fill_len
        return host_rows

    def pd_admit(self, req, prompt_len: int) -> None:
        """PD decode: preallocation, the prefill instance's write into the host rows it was given,
        then direct admission."""
        host_rows = self.pd_prealloc(req, prompt_len)
        for layer in self.layers:
            rows = self.token_rows(self.uids[req.rid], torch.arange(prompt_len), layer.layer_id)
            self.coordinator.host_pool.layers[layer.layer_id][host_rows] = rows
        self.coordinator.admit_request_direct(req)

    def release(self, req) -> None:
        """SGLang's release_kv_cache with the prefix cache --disable-radix-cache builds."""
        drive.release_kv_cache(req, self.cache)

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


def test_long_requests_are_demoted_under_pressure_and_swap_in_stays_correct(caplog):
    stack = Stack(resident_first=True, device_tokens=PAGE * 36)
    # Every switching step counts as slow here, so its log line (with the time of each part) is checked.
    stack.coordinator.core.telemetry.slow_switch_seconds = 0.0
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
    # The decode log line reports the demotions and the longest step spent switching, then resets.
    from hisparse_sglang.integration.sglang import metrics

    with caplog.at_level(logging.INFO, logger="hisparse_sglang"):
        values = metrics.report(stack.coordinator, log=True, prometheus_labels=None)
    assert values["demotions_total"] == stats.demotions
    assert values["switch_ms_max"] > 0
    assert 0 < values["step_host_ms"] <= values["step_host_ms_max"]
    assert "switch work max" in caplog.text and "demotions" in caplog.text and "step host work" in caplog.text
    slow = [r.getMessage() for r in caplog.records if "switching modes" in r.getMessage()]
    assert slow, "a demotion step must be reported when it exceeds slow_switch_seconds"
    assert any("1 demotions" in m and "unmap" in m and "buffer" in m for m in slow), slow
    again = stack.coordinator.report()
    assert again["switch_ms_max"] == 0 and again["step_host_ms"] == 0 == again["step_host_ms_max"]
    token_stats = stack.coordinator.get_token_stats()
    assert 0 < token_stats.device_token_usage <= 1 and 0 < token_stats.host_token_usage <= 1
    assert stack.allocator.available_size() <= stack.allocator.device_tokens
    for req in running:
        stack.coordinator.request_finished(req)
        stack.release(req)
    stack.assert_all_free()


def test_release_hook_frees_state_when_request_finished_is_skipped():
    """SGLang 0.5.17 releases a PD waiting-queue abort without request_finished; our hook covers it."""
    from hisparse_sglang.integration.sglang.hooks import _release_kv_cache_before

    stack = Stack(resident_first=False)
    req = stack.new_req("x", 700)
    stack.prefill(req, 700)
    running = stack.coordinator.collect_ready_reqs()
    stack.decode(running)
    assert stack.coordinator.buffers.used_buffers == 1  # demoted to its buffer (always-offload)
    _release_kv_cache_before(req, stack.cache)
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
    from hisparse_sglang.errors import HiSparseMemoryError

    with pytest.raises(HiSparseMemoryError, match="PD hook did not run"):
        host.alloc_paged_token_slots(None, None, 5, 0, 10)
    host.preallocated[5] = None  # the logical pool was exhausted
    with pytest.raises(HiSparseMemoryError, match="logical .host. pool had no room for 10 tokens"):
        host.alloc_paged_token_slots(None, None, 5, 0, 10)
    with pytest.raises(HiSparseMemoryError, match="exceed the 130 preallocated"):
        host.alloc_paged_token_slots(None, None, 3, 100, 64)


def publish_server_args(**values):
    """SGLang's release path reads the process config SGLang publishes at launch: publish ServerArgs'
    declared defaults (not resolved against a model) with ``values``."""
    from sglang.srt import runtime_context

    args = drive.unresolved_server_args(**values)
    runtime_context.publish(args, role="scheduler")
    return args


@pytest.fixture(autouse=True)
def published_server_args():
    from sglang.srt import runtime_context

    yield publish_server_args()
    runtime_context.reset_context()


@pytest.fixture
def pd_decode_server_args():
    """A PD decode instance's config (retracted KV kept in CPU tensors, as resolved at launch from 0.5.18)."""
    values = dict(disaggregation_mode="decode")
    if drive.retraction_backup_is_configurable():
        values["disaggregation_decode_retraction_backup"] = "cpu_tensor"
    return publish_server_args(**values)


@pytest.mark.parametrize("prompt_len, resident_first", [(200, True), (700, True), (700, False)])
def test_pd_decode_retraction_round_trip_restores_kv_and_indexer_keys(
    prompt_len, resident_first, pd_decode_server_args
):
    """SGLang's PD-decode retraction (release_req with offload_kv) and resume (load_kv_cache):
    the resumed request decodes on from exactly the KV it had (short ones resident, long ones
    offloaded), though its old locations were reused in between. The in-tree HiSparse raises."""
    from hisparse_sglang.integration.sglang.hooks import _load_kv_cache_after

    stack = Stack(resident_first=resident_first)
    req = stack.new_req("p", prompt_len)
    stack.pd_admit(req, prompt_len)
    offloaded = stack.coordinator.core.requests[compat.req_slot(req)].mode == "offloaded"
    assert offloaded == (prompt_len > stack.config.device_buffer_size), "long requests start offloaded"
    req.output_ids = [7]  # the prefill instance's first token
    index_k = stack.pool.index_k_with_scale_buffer
    pages = stack.pool.index_k_pages(stack.req_to_token_pool.req_to_token[compat.req_slot(req), :prompt_len])
    for layer, buffer in enumerate(index_k):
        pattern = torch.arange(buffer.shape[1], dtype=torch.int64) + 31 * layer
        buffer[pages] = ((pattern[None, :] + 7 * pages[:, None]) % 251).to(torch.uint8)
    for _ in range(5):
        stack.decode([req])
        req.output_ids.append(7)
    assert req.seqlen - 1 == stack.lens["p"]
    if not resident_first:
        assert stack.coordinator.core.requests[compat.req_slot(req)].mode == "offloaded"

    kept_pages = stack.pool.index_k_pages(stack.req_to_token_pool.req_to_token[compat.req_slot(req), : req.seqlen - 1])
    expected_index_k = [buffer[kept_pages].clone() for buffer in index_k]
    drive.release_req(
        req=req, remaing_req_count=1, server_args=pd_decode_server_args, req_to_token_pool=stack.req_to_token_pool,
        token_to_kv_pool_allocator=stack.allocator, tree_cache=stack.cache, hisparse_coordinator=stack.coordinator,
    )
    assert compat.req_slot_or_none(req) is None and drive.retraction_backup(req) is not None
    stack.assert_all_free()

    # another request takes the freed locations and overwrites their host rows and indexer keys
    other = stack.new_req("q", prompt_len + 64)
    stack.pd_admit(other, prompt_len + 64)
    for buffer in index_k:
        buffer.fill_(0xEE)

    # resume, as DecodePreallocQueue.resume_retracted_reqs does: preallocate, load, admit (our hook)
    stack.pd_prealloc(req, req.seqlen - 1)
    req.load_kv_cache(stack.req_to_token_pool, stack.allocator)
    _load_kv_cache_after(None, req, stack.req_to_token_pool, stack.allocator)
    assert compat.req_slot(req) in stack.coordinator.core.requests

    new_pages = stack.pool.index_k_pages(stack.req_to_token_pool.req_to_token[compat.req_slot(req), : req.seqlen - 1])
    for buffer, expected in zip(index_k, expected_index_k):
        assert torch.equal(buffer[new_pages], expected), "indexer keys were not restored"
    for _ in range(5):
        stack.decode([req, other])  # checks every top-k row's KV against the original values
    for r in (req, other):
        stack.coordinator.request_finished(r)
        stack.release(r)
    stack.assert_all_free()


def test_pd_request_ending_before_its_transfer_holds_its_host_rows_for_the_quarantine():
    """A PD request released before its KV transfer completed (failed, timed out, aborted): its
    host rows are not reused until pd_quarantine_s has passed, then they are freed."""
    stack = Stack()
    now = [100.0]
    stack.allocator.quarantine.clock = lambda: now[0]
    assert stack.allocator.quarantine.seconds == stack.config.pd_quarantine_s > 0
    free_before = stack.allocator.rows.logical.free_rows

    failed = stack.new_req("failed", 300)
    failed_rows = stack.pd_prealloc(failed, 300)
    # SGLang's failure path: request_finished, then release_kv_cache
    stack.coordinator.request_finished(failed)
    stack.release(failed)
    held = stack.allocator.rows.logical.free_rows
    assert held == free_before - 5 * PAGE, "the failed request's pages were freed at once"
    assert (stack.allocator.quarantine.rows_held, stack.allocator.quarantine.pages_held) == (300, 5)
    assert stack.coordinator.report()["host_rows_quarantined"] == 5 * PAGE

    # a new request (and the admission budget) cannot get those rows during the quarantine
    other = stack.new_req("other", 1000)
    other_rows = stack.pd_prealloc(other, 1000)
    assert not bool(torch.isin(other_rows, failed_rows).any())
    assert stack.allocator.logical_attn_allocator.available_size() == free_before - 5 * PAGE - 16 * PAGE
    stack.coordinator.admit_request_direct(other)
    stack.coordinator.request_finished(other)
    stack.release(other)  # admitted: freed at once

    now[0] += stack.config.pd_quarantine_s
    assert stack.allocator.logical_attn_allocator.available_size() == free_before
    assert (stack.allocator.quarantine.rows_held, stack.allocator.quarantine.pages_held) == (0, 0)
    stack.assert_all_free()


def test_buffer_tables_that_do_not_fit_the_gpu_are_refused_before_allocation(monkeypatch, caplog):
    from hisparse_sglang.errors import HiSparseMemoryError
    from hisparse_sglang.integration.sglang import build as adapter
    from hisparse_sglang.memory.device_buffers import DeviceBufferPool

    shape = (61, 256, 150, 4096, 64, 163840)  # layers, request slots, buffers, D, page, context
    needed = DeviceBufferPool.table_bytes(*shape)
    assert needed > 61 * 150 * 163840 * 2  # the token -> slot maps dominate
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (needed, 80 << 30))
    with caplog.at_level(logging.INFO), pytest.raises(HiSparseMemoryError, match="--context-length"):
        adapter._check_device_memory(needed, torch.device("cuda", 0), shape)
    assert "device buffer tables take" in caplog.text
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (3 * needed, 80 << 30))
    adapter._check_device_memory(needed, torch.device("cuda", 0), shape)  # fits: no error


def test_gpu_pool_smaller_than_one_buffer_stops_startup_before_the_host_pool(monkeypatch):
    """Issue #18: a GPU KV pool that cannot hold one offloaded request's buffer started and failed
    later in the scheduler. Now the coordinator refuses it before pinning anything."""
    from hisparse_sglang.errors import HiSparseMemoryError
    from hisparse_sglang.integration.sglang import build as adapter

    pinned = []
    monkeypatch.setattr(adapter, "HostKVPool", lambda *args, **kwargs: pinned.append(args))
    with pytest.raises(HiSparseMemoryError, match=r"holds 256 tokens \(4 pages of 64\).*256 \+ one page = 320 rows"):
        Stack(device_tokens=PAGE * 4, buffer_size=256, top_k=128)
    assert pinned == []


def test_a_second_release_of_the_same_locations_is_refused():
    """Issue #18: the production allocator accepted a second free of the same locations, after which
    two requests shared pages. SGLang's allocator adapter now refuses it, naming the page."""
    from hisparse_sglang.errors import HiSparseMemoryError

    stack = Stack()
    req = stack.new_req("a", 300)
    stack.prefill(req, 300)
    stack.coordinator.collect_ready_reqs()
    stack.decode([req])
    locs = stack.req_to_token_pool.req_to_token[compat.req_slot(req), : compat.req_kv_allocated_len(req)].clone()
    stack.coordinator.request_finished(req)
    stack.release(req)
    with pytest.raises(HiSparseMemoryError, match=r"host pool: double free of page \d+ \(it is not allocated\)"):
        stack.allocator.free(locs)
    stack.assert_all_free()
    other, third = stack.new_req("b", 300), stack.new_req("c", 300)
    stack.prefill(other, 300)
    stack.prefill(third, 300)
    rows = stack.req_to_token_pool.req_to_token
    assert not set(rows[compat.req_slot(other), :300].tolist()) & set(rows[compat.req_slot(third), :300].tolist())


def test_sglangs_num_real_reqs_is_the_count_the_swap_in_kernels_read():
    """SGLang sets ``coordinator.num_real_reqs`` with ``fill_(n)``; the kernels read the core's tensor."""
    stack = Stack()
    stack.coordinator.num_real_reqs.fill_(3)
    assert stack.coordinator.num_real_reqs.tensor is stack.coordinator.core.num_real_reqs
    assert int(stack.coordinator.core.num_real_reqs.item()) == 3


def test_kv_write_rows_are_gathered_once_per_forward():
    """Every layer of a forward writes its KV at the same ``out_cache_loc``: the pool's first layer gathers the
    device rows and the later layers reuse them (one gather per forward, not per layer); the next forward's
    first layer gathers anew, as does a write of another tensor, so rows rebound between forwards are seen."""
    stack = Stack()
    pool = stack.pool
    table = pool.runtime.device_row_of_loc
    layers = [types.SimpleNamespace(layer_id=i) for i in range(4)]
    loc = torch.tensor([PAGE * 3 + 1, PAGE * 5], dtype=torch.int64)
    table[loc] = torch.tensor([7, 9], dtype=table.dtype)
    gathers = []
    gather = pool._rows_of
    pool._rows_of = lambda locations: gathers.append(locations) or gather(locations)
    first = pool._write_rows(layers[0], loc)
    assert first.tolist() == [7, 9] and first.dtype == torch.int64
    assert all(pool._write_rows(layer, loc) is first for layer in layers[1:])
    assert len(gathers) == 1
    table[loc] = torch.tensor([11, 13], dtype=table.dtype)  # rebound before the next forward
    assert pool._write_rows(layers[0], loc).tolist() == [11, 13]
    other = loc.clone()
    table[other] = torch.tensor([17, 19], dtype=table.dtype)
    assert pool._write_rows(layers[2], other).tolist() == [17, 19]
    assert len(gathers) == 3
