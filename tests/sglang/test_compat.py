"""compat's accessors against the installed SGLang's own objects: request fields, KV write locations,
the published --hisparse-config, and the coordinator calls newer releases make."""

import array
import pathlib
import types

import drive
import pytest
import torch

from hisparse_sglang.errors import UnsupportedSGLangError
from hisparse_sglang.integration.sglang import compat

pytestmark = pytest.mark.sglang


@pytest.fixture
def published():
    from sglang.srt import runtime_context

    def publish(**values):
        args = drive.unresolved_server_args(**values)
        runtime_context.publish(args, role="scheduler")
        return args

    yield publish
    runtime_context.reset_context()


def test_installed_release_is_in_the_supported_range():
    assert compat.is_supported(compat.sglang_version())
    assert compat.is_supported("0.5.17") and compat.is_supported("0.5.23.post1")
    assert not compat.is_supported("0.5.16") and not compat.is_supported("0.5.24rc1") and not compat.is_supported(None)
    with pytest.raises(UnsupportedSGLangError, match=r"sglang 0\.6\.0 is installed.*pip install 'sglang>=0\.5\.17,<0\.5\.24'"):
        compat.check_version("0.6.0")


def test_request_slot_and_prefill_fields_of_sglang_requests():
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.sampling.sampling_params import SamplingParams

    pool = ReqToTokenPool(size=4, max_context_len=256, device="cpu", enable_memory_saver=False)
    req = Req("r", "", array.array("i", range(100)), SamplingParams(max_new_tokens=8))
    assert compat.req_slot_or_none(req) is None
    with pytest.raises(ValueError, match="request r has no request-pool slot"):
        compat.req_slot(req)
    pool.alloc([req])
    slot = compat.req_slot(req)
    assert 0 <= slot < pool.req_to_token.shape[0] and pool.req_to_token[slot].shape == (256,)
    drive.begin_prefill(req, 100)
    assert compat.req_prefill_len(req) == 100
    assert compat.req_kv_allocated_len(req) == 100 and compat.kv_committed_len(req) == 100
    drive.set_extend_range(req, 64, 96)  # a later chunk
    assert compat.req_prefill_len(req) == 96


def test_write_locations_unwraps_sglang_write_targets():
    locations = torch.arange(5)
    assert compat.write_locations(locations) is locations
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    assert compat.write_locations(KVWriteLoc(loc=locations)) is locations


def test_hisparse_config_is_read_where_the_release_keeps_it(published):
    from hisparse_sglang.integration.sglang.hooks import _parse_hisparse_config

    text = '{"top_k": 2048, "device_buffer_size": 4096, "host_to_device_ratio": 6}'
    args = published(hisparse_config=text)
    # The model (its index_topk is top_k's default and check), where SGLang memoizes its ModelConfig on the
    # record: model_config_of from 0.5.19, get_model_config() before.
    from sglang.srt.configs.model_config import ModelConfig

    tiny_dsv32 = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "models" / "tiny-dsv32"
    model_config = ModelConfig(str(tiny_dsv32))
    setattr(args, "_model_config" if hasattr(type(args), "resolve_once") else "model_config", model_config)
    assert compat.model_config() is model_config and compat.model_config(args) is model_config
    assert compat.hisparse_config_json(args) == text
    assert compat.hisparse_config_json() == text  # parse_hisparse_config() without arguments (0.5.19+)
    for config in (_parse_hisparse_config(args), _parse_hisparse_config()):
        assert (config.top_k, config.device_buffer_size, config.host_to_device_ratio) == (2048, 4096, 6)


def test_coordinator_answers_the_calls_of_newer_releases():
    """The scratch calls of 0.5.22+ (the verify calls are the adapter's: tests/sglang/test_speculative_sglang.py)."""
    calls = compat.CoordinatorCalls()
    assert calls.spec_swap.scratch_capacity == 0  # PD decode admission's per-request device rows (0.5.22+)
    assert calls.allocate_spec_scratch([0, 1]) is None  # every prefill batch (0.5.22+)


def test_host_pool_regions_are_found_in_what_the_release_registers_with_mooncake():
    """SGLang's own register_buffer_to_engine (its KV manager without the engine): 0.5.17 registers our
    list in a call of its own, 0.5.18+ one list of every region; compat finds ours in either."""
    from sglang.srt.disaggregation.base.conn import KVArgs
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager

    from hisparse_sglang.integration.sglang.mooncake import HostRegions

    calls = []
    manager = object.__new__(MooncakeKVManager)  # its constructor starts the engine and threads
    manager.engine = types.SimpleNamespace(batch_register=lambda pointers, lengths: calls.append((pointers, lengths)) or 0)
    manager.kv_args = KVArgs()
    host = HostRegions([1 << 40, 2 << 40, 3 << 40])
    manager.kv_args.kv_data_ptrs, manager.kv_args.kv_data_lens = host, [1 << 30] * 3
    manager.kv_args.aux_data_ptrs, manager.kv_args.aux_data_lens = [7 << 40, 8 << 40], [4096, 8192]
    manager.kv_args.state_data_ptrs, manager.kv_args.state_data_lens = [[9 << 40]], [[1 << 20]]
    manager.register_buffer_to_engine()
    registered = {(int(pointer), int(length)) for pointers, lengths in calls for pointer, length in zip(pointers, lengths)}
    assert registered == {(1 << 40, 1 << 30), (2 << 40, 1 << 30), (3 << 40, 1 << 30), (7 << 40, 4096),
                          (8 << 40, 8192), (9 << 40, 1 << 20)}
    found = [compat.host_pool_regions(pointers, lengths) for pointers, lengths in calls]
    assert [regions for regions in found if regions[0]] == [(list(host), [1 << 30] * 3)]
