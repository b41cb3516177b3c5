"""The end-to-end top-k fixture (benchmarks/e2e/topk_workload_fixture.py) on the CPU: its index
generation is the workload model's, in both layouts an arm's indexer returns; its slot table; its
configuration from the environment; the copy of workload.py a server without the package imports;
and, with SGLang installed, the hook targets and the BEFORE hook on SGLang's own Req and pool.

The CUDA side (rows equal to these under CUDA-graph replay, time per layer) is checked on a GPU by
``python benchmarks/e2e/topk_workload_fixture.py --bench`` (docs/workload.md).
"""

from __future__ import annotations

import array
import inspect
import json
import pathlib
import pkgutil
import subprocess
import sys
import types

import pytest
import torch

from hisparse_sglang.testing import workload as workload_module
from hisparse_sglang.testing.workload import PROFILES, TopKWorkload, profile, request_key_from_tokens

REPO = pathlib.Path(__file__).resolve().parents[1]
E2E = REPO / "benchmarks" / "e2e"


@pytest.fixture(scope="module")
def fixture():
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(E2E))
        import topk_workload_fixture

        yield topk_workload_fixture


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_profile_names_are_the_workloads(fixture):
    assert fixture.PROFILE_NAMES == tuple(PROFILES)


# ------------------------------------------------------------------------------------ environment
def test_off_unless_a_profile_is_named(fixture):
    assert fixture.params_from_env({}) == (None, False)
    assert fixture.params_from_env({fixture.ENV_PROFILE: "off"}) == (None, False)
    assert fixture.workload_env("off", '{"persistence": 0.6}') == {}


def test_profile_and_overrides_from_the_environment(fixture):
    env = fixture.workload_env("calibrated", json.dumps({"persistence": 0.6, "context_len": 16384}))
    assert env == {fixture.ENV_PROFILE: "calibrated", fixture.ENV_PARAMS: '{"persistence": 0.6, "context_len": 16384}'}
    params, top_k_given = fixture.params_from_env(env)
    assert params == profile("calibrated", persistence=0.6, context_len=16384) and not top_k_given
    params, top_k_given = fixture.params_from_env({fixture.ENV_PROFILE: "random", fixture.ENV_PARAMS: '{"top_k": 512}'})
    assert params.top_k == 512 and top_k_given


@pytest.mark.parametrize(
    "env, message",
    [
        ({"HISPARSE_E2E_TOPK_PROFILE": "realistic"}, "choose one of random, calibrated"),
        ({"HISPARSE_E2E_TOPK_PROFILE": "random", "HISPARSE_E2E_TOPK_PARAMS": "[1]"}, "must be a JSON object"),
        (
            {"HISPARSE_E2E_TOPK_PROFILE": "random", "HISPARSE_E2E_TOPK_PARAMS": '{"persistance": 1}'},
            "unknown parameter",
        ),
        (
            {"HISPARSE_E2E_TOPK_PROFILE": "random", "HISPARSE_E2E_TOPK_PARAMS": '{"persistence": 2}'},
            "persistence must be in",
        ),
    ],
)
def test_bad_environment_is_named(fixture, env, message):
    with pytest.raises(ValueError, match=message):
        fixture.params_from_env(env)


# ------------------------------------------------------------------------------------ generation
def keyed_batch(fixture, generator: torch.Generator, slots: int = 16, batch: int = 6):
    keys = fixture.SlotKeys(slots, "cpu")
    chosen = torch.randperm(slots - 1, generator=generator)[:batch] + 1  # slot 0: CUDA-graph padding
    request_keys = torch.randint(0, 2**32, (batch,), generator=generator)
    prompts = torch.randint(100, 40000, (batch,), generator=generator)
    seq_lens = prompts + torch.randint(1, 300, (batch,), generator=generator)
    seq_lens[0] = 700  # one request shorter than top_k: padding
    prompts[0] = 650
    assert keys.update(zip(chosen.tolist(), request_keys.tolist(), prompts.tolist())) == batch
    return keys, chosen, request_keys, prompts, seq_lens


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_positions_are_the_workload_rows(fixture, name):
    workload = TopKWorkload(PROFILES[name])
    generator = torch.Generator().manual_seed(3)
    keys, slots, request_keys, prompts, seq_lens = keyed_batch(fixture, generator)
    rows = fixture.replacement_topk(workload, keys.table, slots, seq_lens, 7, slots.numel())
    assert rows.dtype == torch.int32
    assert torch.equal(rows.to(torch.int64), workload.topk(request_keys, prompts, seq_lens, 7))


def test_rows_past_the_batch_are_padding(fixture):
    """The indexer's output may have more rows than requests (hidden-state padding): those stay -1."""
    workload = TopKWorkload(PROFILES["calibrated"])
    keys, slots, request_keys, prompts, seq_lens = keyed_batch(fixture, torch.Generator().manual_seed(4))
    rows = fixture.replacement_topk(workload, keys.table, slots, seq_lens, 0, slots.numel() + 3)
    assert torch.equal(rows[: slots.numel()].to(torch.int64), workload.topk(request_keys, prompts, seq_lens, 0))
    assert bool((rows[slots.numel() :] == -1).all())


def test_locations_layout_translates_through_req_to_token(fixture):
    """Without HiSparse SGLang fuses the page-table transform into the top-k: KV locations."""
    workload = TopKWorkload(PROFILES["calibrated"])
    keys, slots, request_keys, prompts, seq_lens = keyed_batch(fixture, torch.Generator().manual_seed(5))
    context = int(seq_lens.max()) + 1
    req_to_token = (torch.arange(16 * context, dtype=torch.int32).reshape(16, context) * 7 + 5) % 1_000_003
    positions = workload.topk(request_keys, prompts, seq_lens, 2)
    rows = fixture.replacement_topk(workload, keys.table, slots, seq_lens, 2, slots.numel(), req_to_token)
    for b in range(slots.numel()):
        valid = positions[b] >= 0
        assert torch.equal(rows[b][valid].to(torch.int64), req_to_token[slots[b], positions[b][valid]].to(torch.int64))
        assert bool((rows[b][~valid] == -1).all())
    assert bool((rows[0] == -1).any()), "the short request must keep its padding"


def test_verify_page_table_layout_maps_each_row_through_its_pages(fixture):
    """The plugin's verify runs SGLang's fused top-k through its own page table, one row per query: each
    position p of row i becomes table[i, p // P] * P + p % P (device rows or, with the identity, positions)."""
    workload = TopKWorkload(PROFILES["calibrated"])
    keys, slots, request_keys, prompts, seq_lens = keyed_batch(fixture, torch.Generator().manual_seed(6))
    page = 64
    width = int(seq_lens.max()) // page + 1
    table = torch.randint(1, 9000, (slots.numel(), width), generator=torch.Generator().manual_seed(8), dtype=torch.int32)
    table[1] = torch.arange(width, dtype=torch.int32)  # an offloaded request's identity
    positions = workload.topk(request_keys, prompts, seq_lens, 2)
    rows = fixture.replacement_topk(workload, keys.table, slots, seq_lens, 2, slots.numel(), None, table, page)
    for b in range(slots.numel()):
        valid = positions[b] >= 0
        want = table[b, positions[b][valid] // page].to(torch.int64) * page + positions[b][valid] % page
        assert torch.equal(rows[b][valid].to(torch.int64), want)
        assert bool((rows[b][~valid] == -1).all())
    assert torch.equal(rows[1][positions[1] >= 0].to(torch.int64), positions[1][positions[1] >= 0])
    assert not torch.equal(rows[0].to(torch.int64), positions[0])


FUSED_CHECK = """
import sys, torch
torch.set_num_threads(1)
sys.path.insert(0, {e2e!r})
import topk_workload_fixture as f
from hisparse_sglang.testing.workload import PROFILES, TopKWorkload
generator = torch.Generator().manual_seed(7)
req_to_token = (torch.arange(16 * 41000, dtype=torch.int32).reshape(16, 41000) * 7 + 5) % 1000003
pages = torch.randint(0, 5000, (3, 41000 // 64 + 1), generator=generator, dtype=torch.int32)
# positions with one profile, KV locations with another, a verify page table; a short request, a long one,
# a padding row
for name, translate, page_table, layer in (
    ("calibrated", None, None, 1), ("random", req_to_token, None, 0), ("calibrated", None, pages, 3)
):
    page_size = 64 if page_table is not None else 0
    workload = TopKWorkload(PROFILES[name])
    keys = f.SlotKeys(16, "cpu")
    slots = torch.randperm(15, generator=generator)[:2] + 1
    prompts = torch.tensor([650, int(torch.randint(20000, 40000, (1,), generator=generator))])
    seq_lens = prompts + torch.tensor([50, 123])
    keys.update(zip(slots.tolist(), torch.randint(0, 2**32, (2,), generator=generator).tolist(), prompts.tolist()))
    want = f.replacement_topk(workload, keys.table, slots, seq_lens, layer, 3, translate, page_table, page_size)
    got = f.fused_replacement_topk(workload, keys.table, slots, seq_lens, layer, 3, translate, page_table, page_size)
    assert torch.equal(want, got), (name, (want != got).nonzero()[:4].tolist())
print("fused == torch")
"""


def test_fused_kernel_is_the_torch_generator_in_the_triton_interpreter():
    """The Triton kernel the servers run, executed by Triton's CPU interpreter, gives the torch
    generator's rows bit for bit in all three layouts (on a GPU: ``topk_workload_fixture.py --bench``)."""
    pytest.importorskip("triton")
    env = {"PYTHONPATH": str(REPO / "src"), "TRITON_INTERPRET": "1", "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, "-c", FUSED_CHECK.format(e2e=str(E2E))], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "fused == torch" in done.stdout


def test_slot_table_writes_only_changed_occupants(fixture):
    keys = fixture.SlotKeys(8, "cpu")
    assert keys.update([(1, 11, 100), (2, 22, 200)]) == 2
    assert keys.update([(1, 11, 100), (2, 22, 200)]) == 0
    assert keys.update([(2, 33, 300), (5, 11, 100)]) == 2  # a new request in slot 2; request 11 moved to 5
    assert keys.table.tolist() == [[0, 0], [11, 100], [33, 300], [0, 0], [0, 0], [11, 100], [0, 0], [0, 0]]
    assert keys.writes == 4


def test_a_request_keeps_its_rows_in_another_slot(fixture):
    """Retraction puts a request in another slot: the key, not the slot, picks its rows."""
    workload = TopKWorkload(PROFILES["calibrated"])
    keys = fixture.SlotKeys(8, "cpu")
    keys.update([(3, 12345, 30000)])
    before = fixture.replacement_topk(workload, keys.table, torch.tensor([3]), torch.tensor([30100]), 1, 1)
    keys.update([(6, 12345, 30000)])
    after = fixture.replacement_topk(workload, keys.table, torch.tensor([6]), torch.tensor([30100]), 1, 1)
    assert torch.equal(before, after)


def test_every_server_gets_the_fixture_and_a_standalone_model(tmp_path):
    """arms.prepare_pyext puts the fixture, its entry point and a copy of workload.py on every server's
    path (arms a and b have no package): the copy imports with torch and the standard library only."""
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(E2E))
        import arms
        import options

        args = options.parse_args(["--state-dir", str(tmp_path), "--topk-profile", "calibrated"])
        common, _, _ = arms.prepare_pyext(tmp_path, args)
        env = arms.arm_spec("a", args, {}, common, tmp_path, 30000)[1]
    assert env["HISPARSE_E2E_TOPK_PROFILE"] == "calibrated"
    entry_points = (common / "hisparse_e2e_fixture-0.0.0.dist-info" / "entry_points.txt").read_text()
    assert "hisparse_e2e_topk_workload = topk_workload_fixture:register" in entry_points
    code = (
        "import sys, topk_workload_fixture as f; m = f.load_workload_module(); "
        "assert m.__name__ == f.WORKLOAD_COPY, m.__name__; "
        "assert 'hisparse_sglang' not in sys.modules; print(m.request_key_from_tokens([5, 6]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env={"PYTHONPATH": str(common), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) == request_key_from_tokens([5, 6])


def test_every_server_of_every_arm_gets_the_same_workload(tmp_path):
    """Both instances of a PD arm and every speculative arm's server get the profile and its parameters
    (the fixture serves the PD decode and the verify forwards too; an arm without it would attend to
    the tiny model's own top-k and its figures would not compare)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(E2E))
        import arms
        import options

        params = '{"context_len": 32768}'
        args = options.parse_args(
            ["--state-dir", str(tmp_path), "--topk-profile", "high-locality", "--topk-params", params]
        )
        common, plugin_dir, _ = arms.prepare_pyext(tmp_path, args)
        servers = [
            server for arm in arms.ALL_ARMS for server in arms.arm_servers(arm, args, {}, {}, common, plugin_dir)
        ]
    assert len(servers) == len(arms.ALL_ARMS) + len(arms.PD_ARMS)
    for server in servers:
        assert server.env["HISPARSE_E2E_TOPK_PROFILE"] == "high-locality", server
        assert server.env["HISPARSE_E2E_TOPK_PARAMS"] == params, server


def test_the_copy_is_the_package_module():
    """The copy is made from the package's file at run time, so there is one source of the model."""
    assert (
        pathlib.Path(workload_module.__file__).resolve() == (REPO / "src/hisparse_sglang/testing/workload.py").resolve()
    )


# ------------------------------------------------------------------------------------ SGLang
@pytest.mark.sglang
def test_hook_targets_are_what_the_fixture_expects(fixture):
    forward_cuda = pkgutil.resolve_name(fixture.INDEXER_TARGET)
    names = list(inspect.signature(forward_cuda).parameters)
    assert names[1 + fixture._FORWARD_BATCH_INDEX] == "forward_batch"
    assert names[1 + fixture._LAYER_ID_INDEX] == "layer_id"
    for target in (fixture.WORKER_TARGET, fixture.SPEC_WORKER_TARGET):
        assert list(inspect.signature(pkgutil.resolve_name(target)).parameters)[:2] == ["self", "batch"], target
    assert callable(pkgutil.resolve_name(fixture.ATTN_BACKEND_GETTER))
    from sglang.srt.layers.attention.dsa.dsa_indexer_metadata import DSAIndexerMetadata

    assert "force_unfused_topk" in DSAIndexerMetadata.__dataclass_fields__
    assert callable(DSAIndexerMetadata.get_seqlens_expanded)
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    assert callable(ForwardMode.is_target_verify) and callable(ForwardMode.is_draft_extend_v2)


@pytest.mark.sglang
def test_before_hook_keys_slots_by_prompt(fixture):
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.sampling.sampling_params import SamplingParams

    pool = ReqToTokenPool(size=6, max_context_len=64, device="cpu", enable_memory_saver=False)
    worker = types.SimpleNamespace(model_runner=types.SimpleNamespace(req_to_token_pool=pool))
    prompts = [array.array("i", range(10, 40)), array.array("i", range(7, 19))]
    reqs = [Req(f"rid-{i}", "", ids, SamplingParams()) for i, ids in enumerate(prompts)]
    reqs[0].req_pool_idx, reqs[1].req_pool_idx = 2, 5
    replacement = fixture.TopKReplacement(PROFILES["calibrated"])

    extend = types.SimpleNamespace(forward_mode=ForwardMode.EXTEND, reqs=reqs)
    assert replacement.before_forward(worker, extend) is None and replacement.keys is None
    decode = types.SimpleNamespace(forward_mode=ForwardMode.DECODE, reqs=reqs)
    assert replacement.before_forward(worker, decode) is None
    table = replacement.keys.table
    assert table.shape == (pool.req_to_token.shape[0], 2)
    assert table[2].tolist() == [request_key_from_tokens(prompts[0]), 30]
    assert table[5].tolist() == [request_key_from_tokens(prompts[1]), 12]
    # The same prompt under another rid (another arm, a repeat) has the same key.
    twin = Req("other-rid", "", array.array("i", range(10, 40)), SamplingParams())
    assert fixture.request_key(twin) == fixture.request_key(reqs[0])


@pytest.mark.sglang
@pytest.mark.parametrize("fused", [False, True], ids=["positions", "locations"])
def test_around_indexer_reads_the_backends_pool(fixture, monkeypatch, fused):
    """The AROUND hook on a decode batch carrying only the fields of SGLang's own ForwardBatch (0.5.17's
    has no pool: the table comes from the attention backend, whose __init__ keeps model_runner's):
    the rows are the workload's, as positions or translated through the backend's req_to_token."""
    from sglang.srt.layers.attention.dsa_backend import DeepseekSparseAttnBackend
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.model_executor import forward_context
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    assert "self.req_to_token_pool = model_runner.req_to_token_pool" in inspect.getsource(
        DeepseekSparseAttnBackend.__init__
    )
    pool = ReqToTokenPool(size=6, max_context_len=4096, device="cpu", enable_memory_saver=False)
    pool.req_to_token.copy_((torch.arange(pool.req_to_token.numel()) * 3 % 100_003).view_as(pool.req_to_token))
    metadata = types.SimpleNamespace(force_unfused_topk=not fused)
    backend = types.SimpleNamespace(req_to_token_pool=pool, get_indexer_metadata=lambda layer, batch: metadata)
    monkeypatch.setattr(forward_context, "get_attn_backend", lambda: backend)

    slots, prompts = torch.tensor([2, 5]), torch.tensor([3000, 2500])
    seq_lens = prompts + torch.tensor([40, 7])
    replacement = fixture.TopKReplacement(PROFILES["calibrated"])
    keys = replacement._ensure_keys(pool.req_to_token.shape[0], "cpu")
    keys.update([(2, 11, 3000), (5, 12, 2500)])
    fields = {"forward_mode": ForwardMode.DECODE, "req_pool_indices": slots, "seq_lens": seq_lens}
    assert set(fields) <= set(ForwardBatch.__dataclass_fields__)
    batch = types.SimpleNamespace(**fields)
    indexer = types.SimpleNamespace(index_topk=2048)
    real = torch.zeros(2, 2048, dtype=torch.int32)
    rows = replacement.around_indexer(lambda *a, **k: real, indexer, None, forward_batch=batch, layer_id=1)

    positions = TopKWorkload(PROFILES["calibrated"]).topk(torch.tensor([11, 12]), prompts, seq_lens, 1)
    want = positions.clone()
    if fused:
        valid = positions >= 0
        want[valid] = pool.req_to_token[slots[:, None].expand_as(positions)[valid], positions[valid]].to(torch.int64)
    assert rows.dtype == torch.int32 and torch.equal(rows.to(torch.int64), want)

    del backend.req_to_token_pool
    with pytest.raises(RuntimeError, match="no req_to_token_pool"):
        replacement.around_indexer(lambda *a, **k: real, indexer, None, forward_batch=batch, layer_id=1)


@pytest.mark.sglang
def test_before_hook_on_the_speculative_worker(fixture):
    """Under EAGLE the scheduler hands its decode batch to EAGLEWorkerV2 (no ``model_runner`` of its
    own: the target worker's pool is the table's size); the target's verify forward gets no batch."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.sampling.sampling_params import SamplingParams

    pool = ReqToTokenPool(size=4, max_context_len=64, device="cpu", enable_memory_saver=False)
    spec_worker = types.SimpleNamespace(
        target_worker=types.SimpleNamespace(model_runner=types.SimpleNamespace(req_to_token_pool=pool))
    )
    req = Req("rid", "", array.array("i", range(3, 20)), SamplingParams())
    req.req_pool_idx = 3
    replacement = fixture.TopKReplacement(PROFILES["calibrated"])
    assert replacement.before_forward(spec_worker, None) is None and replacement.keys is None
    replacement.before_forward(spec_worker, types.SimpleNamespace(forward_mode=ForwardMode.DECODE, reqs=[req]))
    assert replacement.keys.table[3].tolist() == [request_key_from_tokens(range(3, 20)), 17]


def speculative_setup(fixture, monkeypatch, fused: bool, per: int, verify_page_table=None):
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.model_executor import forward_context

    pool = ReqToTokenPool(size=6, max_context_len=4096, device="cpu", enable_memory_saver=False)
    pool.req_to_token.copy_((torch.arange(pool.req_to_token.numel()) * 3 % 100_003).view_as(pool.req_to_token))
    slots, prompts = torch.tensor([2, 5]), torch.tensor([3000, 2500])
    seq_lens = prompts + torch.tensor([40, 7])  # committed lengths (the verify's draft tokens come after)
    # the indexer's own row lengths (DSA backend: seqlens_expand over the committed lengths + per)
    expanded = (seq_lens[:, None] + torch.arange(1, per + 1)).reshape(-1).to(torch.int32)
    metadata = types.SimpleNamespace(force_unfused_topk=not fused, get_seqlens_expanded=lambda: expanded,
                                     verify_page_table=verify_page_table,
                                     attn_metadata=types.SimpleNamespace(page_size=64))
    backend = types.SimpleNamespace(
        req_to_token_pool=pool, get_indexer_metadata=lambda layer, batch: metadata, speculative_num_draft_tokens=per
    )
    monkeypatch.setattr(forward_context, "get_attn_backend", lambda: backend)
    replacement = fixture.TopKReplacement(PROFILES["calibrated"])
    replacement._ensure_keys(pool.req_to_token.shape[0], "cpu").update([(2, 11, 3000), (5, 12, 2500)])
    return pool, slots, prompts, seq_lens, expanded, replacement


@pytest.mark.sglang
@pytest.mark.parametrize("mode", ["TARGET_VERIFY", "DRAFT_EXTEND_V2"])
@pytest.mark.parametrize("fused", [False, True], ids=["positions", "locations"])
def test_speculative_rows_are_the_workloads_at_each_position(fixture, monkeypatch, mode, fused):
    """A verify (or V2 draft extend) batch has T rows per request, request-major: row i of a request
    gets the rows a decode at its length (committed + i + 1) would get, in the layout the backend asks."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    per = 3
    pool, slots, prompts, seq_lens, expanded, replacement = speculative_setup(fixture, monkeypatch, fused, per)
    batch = types.SimpleNamespace(forward_mode=getattr(ForwardMode, mode), req_pool_indices=slots, seq_lens=seq_lens)
    real = torch.zeros(2 * per, 2048, dtype=torch.int32)
    rows = replacement.around_indexer(
        lambda *a, **k: real, types.SimpleNamespace(index_topk=2048), None, forward_batch=batch, layer_id=4
    )
    keys = torch.tensor([11, 12]).repeat_interleave(per)
    row_slots = slots.repeat_interleave(per)
    want = TopKWorkload(PROFILES["calibrated"]).topk(keys, prompts.repeat_interleave(per), expanded.to(torch.int64), 4)
    if fused:
        valid = want >= 0
        want[valid] = pool.req_to_token[row_slots[:, None].expand_as(want)[valid], want[valid]].to(torch.int64)
    assert rows.shape == real.shape and torch.equal(rows.to(torch.int64), want)
    # the positions a decode of each length would attend: the first row's newest token is its own
    assert not torch.equal(rows[0], rows[1])


@pytest.mark.sglang
def test_plugin_verify_rows_go_through_its_verify_page_table(fixture, monkeypatch):
    """With the plugin's fused verify top-k (the metadata carries ``verify_page_table``, force_unfused_topk
    False) each row's positions go through that table's pages, not through req_to_token."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    per = 3
    table = torch.randint(1, 9000, (2 * per, 4096 // 64), generator=torch.Generator().manual_seed(2), dtype=torch.int32)
    table[per:] = torch.arange(4096 // 64, dtype=torch.int32)  # the second request offloaded: the identity
    pool, slots, prompts, seq_lens, expanded, replacement = speculative_setup(fixture, monkeypatch, True, per, table)
    batch = types.SimpleNamespace(forward_mode=ForwardMode.TARGET_VERIFY, req_pool_indices=slots, seq_lens=seq_lens)
    real = torch.zeros(2 * per, 2048, dtype=torch.int32)
    rows = replacement.around_indexer(
        lambda *a, **k: real, types.SimpleNamespace(index_topk=2048), None, forward_batch=batch, layer_id=4
    )
    keys = torch.tensor([11, 12]).repeat_interleave(per)
    positions = TopKWorkload(PROFILES["calibrated"]).topk(keys, prompts.repeat_interleave(per), expanded.to(torch.int64), 4)
    valid = positions >= 0
    want = torch.full_like(positions, -1)
    row_of = torch.arange(2 * per)[:, None].expand_as(positions)
    want[valid] = table[row_of[valid], positions[valid] // 64].to(torch.int64) * 64 + positions[valid] % 64
    assert torch.equal(rows.to(torch.int64), want)
    assert torch.equal(rows[per:].to(torch.int64), positions[per:])


@pytest.mark.sglang
def test_speculative_batch_that_is_not_t_rows_per_request_is_named(fixture, monkeypatch):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    _, slots, _, seq_lens, _, replacement = speculative_setup(fixture, monkeypatch, False, 3)
    batch = types.SimpleNamespace(forward_mode=ForwardMode.TARGET_VERIFY, req_pool_indices=slots, seq_lens=seq_lens)
    padded = torch.zeros(7, 2048, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="7 indexer rows for 2 requests, with speculative_num_draft_tokens 3"):
        replacement.around_indexer(
            lambda *a, **k: padded, types.SimpleNamespace(index_topk=2048), None, forward_batch=batch, layer_id=0
        )


@pytest.mark.sglang
def test_prefill_keeps_the_real_indexer(fixture, monkeypatch):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    _, slots, _, seq_lens, _, replacement = speculative_setup(fixture, monkeypatch, False, 3)
    real = torch.arange(4 * 2048, dtype=torch.int32).reshape(4, 2048)
    for mode in (ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.IDLE):
        batch = types.SimpleNamespace(forward_mode=mode, req_pool_indices=slots, seq_lens=seq_lens)
        out = replacement.around_indexer(
            lambda *a, **k: real, types.SimpleNamespace(index_topk=2048), None, forward_batch=batch, layer_id=0
        )
        assert out is real, mode
