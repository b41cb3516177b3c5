"""The plugin's hook specs against the installed SGLang, and loading through SGLang's load_plugins()."""

import multiprocessing
import pkgutil

import pytest

pytestmark = pytest.mark.sglang


def test_every_declared_target_exists_in_installed_sglang():
    from hisparse_sglang.integration.sglang.hooks import HOOKS

    for spec in HOOKS:
        obj = pkgutil.resolve_name(spec.target)
        assert obj is not None, spec.target
        assert spec.hook_type in ("BEFORE", "AFTER", "AROUND", "REPLACE")
        assert spec.why and spec.upstream and spec.sglang_version == "0.5.17"


def test_entry_point_is_registered():
    from importlib.metadata import entry_points

    names = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert names.get("hisparse") == "hisparse_sglang.integration.sglang.plugin:register"


def _load_in_child(queue) -> None:
    """Runs in a spawned child, like an SGLang scheduler process."""
    import os

    os.environ["SGLANG_PLUGINS"] = "hisparse"
    from sglang.srt.plugins import load_plugins
    from sglang.srt.plugins.hook_registry import HookRegistry

    load_plugins()
    from sglang.srt.mem_cache import kv_cache_configurator
    from sglang.srt.model_executor.model_runner import ModelRunner

    from hisparse_sglang.integration.sglang.allocator import HiSparseTokenAllocator
    from hisparse_sglang.integration.sglang.pool import HiSparseDevicePool

    queue.put(
        {
            "patched": sorted(HookRegistry._patched),
            "pool": kv_cache_configurator.HiSparseDSATokenToKVPool is HiSparseDevicePool,
            "allocator": kv_cache_configurator.HiSparseTokenToKVPoolAllocator is HiSparseTokenAllocator,
            "coordinator_wrapped": hasattr(ModelRunner.maybe_init_hisparse_coordinator, "__wrapped__"),
        }
    )


def test_load_plugins_applies_every_hook_in_a_scheduler_like_process():
    from hisparse_sglang.integration.sglang.hooks import HOOKS

    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=_load_in_child, args=(queue,))
    child.start()
    report = queue.get(timeout=600)
    child.join(timeout=60)
    assert report["patched"] == sorted(spec.target for spec in HOOKS)
    assert report["pool"] and report["allocator"]
    assert report["coordinator_wrapped"]


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
