"""The plugin's hook specs against the installed SGLang, and loading through SGLang's load_plugins()
in the processes that load plugins: a scheduler, the main process, a light process (detokenizer,
DP controller) and the main process of an SGLang outside the supported range."""

import json
import os
import pathlib
import pkgutil
import subprocess
import sys
import textwrap
import traceback
import types

import drive
import pytest
from packaging.specifiers import SpecifierSet

pytestmark = pytest.mark.sglang


def test_every_target_resolves_in_the_installed_sglang_for_the_hooks_covering_it():
    from hisparse_sglang.integration.sglang import compat
    from hisparse_sglang.integration.sglang.hooks import HOOKS, UNSUPPORTED_SGLANG_GUARD

    installed = compat.sglang_version()
    covering = [spec for spec in HOOKS if spec.applies_to(installed)]
    assert covering, f"no hook covers sglang {installed}"
    for spec in covering + [UNSUPPORTED_SGLANG_GUARD]:
        assert pkgutil.resolve_name(spec.target) is not None, spec.target
    for spec in HOOKS:
        assert spec.hook_type in ("BEFORE", "AFTER", "AROUND", "REPLACE")
        assert spec.why and spec.upstream
        # The release it was written against is one it applies to, and so a supported one.
        assert spec.applies_to(spec.written_against), (spec.target, spec.written_against)
        # Every range lies inside the supported one: its releases are among those checked.
        releases = [f"0.5.{minor}" for minor in range(10, 30)]
        assert set(SpecifierSet(spec.versions).filter(releases)) <= set(
            SpecifierSet(compat.SUPPORTED_SGLANG).filter(releases)
        ), spec.target
    assert compat.is_supported(UNSUPPORTED_SGLANG_GUARD.written_against)


def test_hooks_registered_per_process_role_and_release():
    from hisparse_sglang.integration.sglang.hooks import HOOKS, UNSUPPORTED_SGLANG_GUARD, specs_for

    scheduler = specs_for("scheduler", "0.5.17")
    main = specs_for("main", "0.5.17")
    assert set(main) == {spec for spec in HOOKS if not spec.scheduler_only}
    assert set(main) < set(scheduler) <= set(HOOKS)
    prealloc_init = "sglang.srt.disaggregation.decode.DecodePreallocQueue.__init__"
    assert prealloc_init in {spec.target for spec in scheduler}
    assert prealloc_init not in {spec.target for spec in specs_for("scheduler", "0.5.23")}
    assert specs_for("light", "0.5.23") == []
    for unsupported in ("0.5.16", "0.5.24", "0.5.24rc1", "0.6.0"):
        assert specs_for("main", unsupported) == [UNSUPPORTED_SGLANG_GUARD]
        assert specs_for("scheduler", unsupported) == []


def test_process_roles():
    from hisparse_sglang.integration.sglang.compat import process_role

    assert process_role("sglang::detokenizer", has_parent=True) == "light"
    assert process_role("sglang::data_parallel_controller", has_parent=True) == "light"
    assert process_role("python -m sglang.launch_server", has_parent=False) == "main"
    assert process_role("python -c from multiprocessing.spawn import spawn_main", has_parent=True) == "scheduler"


def test_entry_point_is_registered():
    from importlib.metadata import entry_points

    names = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert names.get("hisparse") == "hisparse_sglang.integration.sglang.plugin:register"


def _load_in_child(conn, title) -> None:
    """Runs in a spawned child, like an SGLang scheduler process (or, with a title, a light one)."""
    os.environ["SGLANG_PLUGINS"] = "hisparse"
    if title:
        import setproctitle

        setproctitle.setproctitle(title)
    import torch
    from sglang.srt.plugins import load_plugins
    from sglang.srt.plugins.hook_registry import HookRegistry

    load_plugins()
    report = {
        "patched": sorted(HookRegistry._patched),
        "model_runner_imported": "sglang.srt.model_executor.model_runner" in sys.modules,
        "cuda_initialized": torch.cuda.is_initialized(),
    }
    if not title:
        from sglang.srt.mem_cache import kv_cache_configurator
        from sglang.srt.model_executor.model_runner import ModelRunner

        from hisparse_sglang.integration.sglang.allocator import HiSparseTokenAllocator
        from hisparse_sglang.integration.sglang.pool import HiSparseDevicePool

        report.update(
            pool=kv_cache_configurator.HiSparseDSATokenToKVPool is HiSparseDevicePool,
            allocator=kv_cache_configurator.HiSparseTokenToKVPoolAllocator is HiSparseTokenAllocator,
            coordinator_wrapped=hasattr(ModelRunner.maybe_init_hisparse_coordinator, "__wrapped__"),
        )
    conn.send(report)
    conn.close()


def _run_child(title=None) -> dict:
    return drive.report_of_spawned(_load_in_child, title, name="the scheduler-like process")


def test_load_plugins_applies_every_hook_covering_the_release_in_a_scheduler_like_process():
    from hisparse_sglang.integration.sglang import compat
    from hisparse_sglang.integration.sglang.hooks import specs_for

    report = _run_child()
    assert report["patched"] == sorted(spec.target for spec in specs_for("scheduler", compat.sglang_version()))
    assert report["pool"] and report["allocator"]
    assert report["coordinator_wrapped"]
    assert not report["cuda_initialized"]


def test_a_failed_mooncake_registration_of_the_host_pool_raises_a_typed_error():
    from hisparse_sglang.errors import MooncakeRegistrationError
    from hisparse_sglang.integration.sglang.hooks import _batch_register_after
    from hisparse_sglang.integration.sglang.mooncake import HostRegions

    regions, lengths = HostRegions([1 << 40, 2 << 40]), [3 << 30, 3 << 30]
    with pytest.raises(MooncakeRegistrationError) as failure:
        _batch_register_after(-202, None, regions, lengths)
    message = str(failure.value)
    assert "2 regions, 6.00 GiB" in message and "return code -202 (ERR_CONTEXT" in message
    assert "ulimit -l unlimited" in message and "host_to_device_ratio" in message
    with pytest.raises(MooncakeRegistrationError, match=r"return code -9 \(unknown code"):
        _batch_register_after(-9, None, regions, lengths)
    # registered: the code passes through; other regions (SGLang's own buffers) are not ours to judge
    assert _batch_register_after(0, None, regions, lengths) == 0
    assert _batch_register_after(-7, None, [1 << 40], [4096]) == -7
    # from 0.5.18 one call registers SGLang's aux and state buffers too, in a list it builds anew from
    # (address, length) pairs: the message counts our regions only
    sglang_pairs = [*zip(regions, lengths), (5 << 40, 1 << 20)]
    with pytest.raises(MooncakeRegistrationError, match=r"\(2 regions, 6\.00 GiB .*return code -7 \(ERR_ADDRESS_OVERLAPPED"):
        _batch_register_after(-7, None, *map(list, zip(*sglang_pairs)))
    assert _batch_register_after(0, None, *map(list, zip(*sglang_pairs))) == 0


def test_a_light_process_registers_nothing_and_imports_no_model_code():
    """SGLang 0.5.22+ loads plugins in the detokenizer and the DP controller too."""
    report = _run_child("sglang::detokenizer")
    assert report == {"patched": [], "model_runner_imported": False, "cuda_initialized": False}


MAIN_PROCESS = textwrap.dedent(
    """
    import json, logging, os, sys, types
    os.environ["SGLANG_PLUGINS"] = "hisparse"
    from hisparse_sglang.integration.sglang import compat
    if sys.argv[1] != "installed":
        compat.sglang_version = lambda: sys.argv[1]  # the release this process pretends is installed
    errors = []
    handler = logging.Handler()
    handler.emit = lambda record: errors.append(record.getMessage()) if record.levelno >= logging.ERROR else None
    logging.getLogger("hisparse_sglang").addHandler(handler)
    from sglang.srt.arg_groups import overrides
    from sglang.srt.plugins import load_plugins
    from sglang.srt.plugins.hook_registry import HookRegistry
    load_plugins()
    hf_config = types.SimpleNamespace(architectures=["DeepseekV32ForCausalLM"], index_topk=2048)
    model_config = types.SimpleNamespace(hf_config=hf_config, hf_text_config=hf_config)
    view = types.SimpleNamespace(
        enable_hisparse=True, disable_radix_cache=True, kv_cache_dtype="bfloat16", hisparse_config='{"top_k": 1}',
        get_model_config=lambda: model_config, _model_config=model_config,
    )
    try:
        overrides._hisparse_validation(view)  # SGLang's own validation pass
        raised = None
    except Exception as exc:
        raised = [type(exc).__name__, str(exc)]
    print(json.dumps({"patched": sorted(HookRegistry._patched), "raised": raised, "errors": errors,
                      "model_runner_imported": "sglang.srt.model_executor.model_runner" in sys.modules}))
    """
)


def _run_main_process(release: str) -> dict:
    """A fresh interpreter (no parent process: the main-process role) that loads the plugin."""
    result = subprocess.run(
        [sys.executable, "-c", MAIN_PROCESS, release], capture_output=True, text=True, timeout=600, env=os.environ
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_an_unsupported_sglang_refuses_enable_hisparse_at_startup_with_the_versions():
    report = _run_main_process("0.5.24")
    assert report["patched"] == ["sglang.srt.arg_groups.hisparse_hook.validate_hisparse"]
    name, message = report["raised"]
    assert name == "UnsupportedSGLangError"
    assert "sglang 0.5.24 is installed" in message and ">=0.5.17,<0.5.24" in message
    assert any("sglang 0.5.24 is installed" in line for line in report["errors"])
    assert not report["model_runner_imported"]


def test_the_main_process_registers_validation_hooks_only():
    from hisparse_sglang.integration.sglang import compat
    from hisparse_sglang.integration.sglang.hooks import specs_for

    report = _run_main_process("installed")
    assert report["patched"] == sorted(spec.target for spec in specs_for("main", compat.sglang_version()))
    assert report["raised"][0] == "HiSparseConfigError"  # our validation ran (top_k 1 < page size)
    assert report["errors"] == []
    assert not report["model_runner_imported"]


# ---------------------------------------------------------------------------------------------------
# One --hisparse-config for every reader, with the model's index_topk

TINY_DSV32 = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "models" / "tiny-dsv32" / "config.json"
# No top_k: it is the model's index_topk (512). A buffer of 1024 is valid only with that top_k (the default
# 2048 would need at least 2048 slots), and its default would be 1024 rather than 2048's 4096.
CONFIG_WITHOUT_TOP_K = '{"device_buffer_size": 1024, "host_to_device_ratio": 4}'


def tiny_model_with_index_topk(directory: pathlib.Path, index_topk: int) -> str:
    """The tiny DeepSeek-V3.2 of benchmarks/models with another index_topk."""
    config = json.loads(TINY_DSV32.read_text())
    config["index_topk"] = index_topk
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return str(directory)


def _readers_in_a_scheduler_like_process(conn, model_path: str, text: str) -> None:
    """A spawned child, like an SGLang scheduler: SGLang's process setup (published server args, gloo
    parallel state of one rank), the plugin loaded by load_plugins(), then the readers of
    --hisparse-config in SGLang's order: parse_hisparse_config as the installed release calls it (its
    KV-pool sizing), the pool and allocator built with its host_to_device_ratio, and the model runner's
    maybe_init_hisparse_coordinator."""
    try:
        import inspect

        import torch
        from pd_decode_harness import init_single_rank_scheduler
        from sglang.srt.configs.model_config import ModelConfig
        from sglang.srt.distributed import parallel_state
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
        from sglang.srt.server_args import ServerArgs

        server_args = ServerArgs(model_path="dummy", device="cpu", host="127.0.0.1", page_size=64, hisparse_config=text)
        init_single_rank_scheduler(server_args)
        # The model: SGLang memoizes its ModelConfig on the server-args record (model_config_of from 0.5.19,
        # get_model_config() before). Resolving the record against a DSA model would query a GPU.
        model_config = ModelConfig(model_path)
        setattr(server_args, "_model_config" if hasattr(ServerArgs, "resolve_once") else "model_config", model_config)
        os.environ["SGLANG_PLUGINS"] = "hisparse"
        from sglang.srt.mem_cache.sparsity import factory
        from sglang.srt.model_executor.model_runner import ModelRunner
        from sglang.srt.plugins import load_plugins

        load_plugins()
        takes_server_args = bool(inspect.signature(factory.parse_hisparse_config).parameters)  # up to 0.5.18
        sparse = [factory.parse_hisparse_config(server_args) if takes_server_args else factory.parse_hisparse_config()
                  for _ in range(2)]
        from hisparse_sglang.integration.sglang.allocator import HiSparseTokenAllocator
        from hisparse_sglang.integration.sglang.pool import HiSparseDevicePool

        ratio = sparse[0].host_to_device_ratio
        pool = HiSparseDevicePool(
            size=64 * 40, page_size=64, kv_lora_rank=512, dtype=torch.bfloat16, qk_rope_head_dim=64, layer_num=2,
            device="cpu", index_head_dim=128, enable_memory_saver=False, kv_cache_dim=576, host_to_device_ratio=ratio,
        )
        allocator = HiSparseTokenAllocator(
            64 * 40, page_size=64, dtype=torch.bfloat16, device="cpu", kvcache=pool, need_sort=False,
            host_to_device_ratio=ratio,
        )
        tp_group = parallel_state.get_tp_group()
        model_runner = types.SimpleNamespace(
            enable_hisparse=True, server_args=server_args, model_config=model_config, device="cpu",
            token_to_kv_pool_allocator=allocator, tp_group=tp_group, attention_tp_group=tp_group,
            req_to_token_pool=ReqToTokenPool(size=4, max_context_len=4096, device="cpu", enable_memory_saver=False),
        )
        ModelRunner.maybe_init_hisparse_coordinator(model_runner)
        started = pool.runtime.config
        from hisparse_sglang.integration.sglang.validation import hisparse_config

        fields = ("top_k", "device_buffer_size", "host_to_device_ratio", "swap_in_block_size", "page_size")
        report = {
            "sparse_configs": [{name: getattr(config, name) for name in fields} for config in sparse],
            "coordinator": {name: getattr(started, name) for name in fields},
            "coordinator_top_k": model_runner.hisparse_coordinator.top_k,
            "one_object": hisparse_config(server_args if takes_server_args else None) is started,
        }
    except BaseException:
        report = {"error": traceback.format_exc()}
    conn.send(report)
    conn.close()
    os._exit(0)


def test_sglang_and_the_coordinator_read_one_config_with_the_models_index_topk(tmp_path):
    """With a model whose index_topk is not 2048 and no top_k set, SGLang's SparseConfig (its KV-pool
    sizing) and the coordinator get the same values, from one object: once, SGLang's parsed without the
    model (top_k 2048, which this buffer cannot hold: the scheduler failed after validation passed)."""
    model_path = tiny_model_with_index_topk(tmp_path / "tiny-dsv32-topk512", 512)
    report = drive.report_of_spawned(_readers_in_a_scheduler_like_process, model_path, CONFIG_WITHOUT_TOP_K,
                                     name="the scheduler-like process", join_s=30)
    assert "error" not in report, report.get("error")
    expected = {"top_k": 512, "device_buffer_size": 1024, "host_to_device_ratio": 4, "swap_in_block_size": None,
                "page_size": 64}
    assert report["coordinator"] == expected and report["coordinator_top_k"] == 512
    # SparseConfig's swap_in_block_size is never null: SGLang's field is an int (the op's default, 1024)
    assert report["sparse_configs"] == [{**expected, "swap_in_block_size": 1024}] * 2
    assert report["one_object"]
