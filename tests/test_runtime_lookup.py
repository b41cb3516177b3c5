"""runtime_of: the one way every hook finds the process's HiSparseRuntime from the SGLang object it
receives, and the state the runtime keeps to itself (the pool-set prompt limit)."""

import types

import pytest

from hisparse_sglang.integration.sglang.runtime import HiSparseRuntime, runtime_of


@pytest.fixture
def runtime():
    return HiSparseRuntime(host_to_device_ratio=8)


def ours(runtime):
    """Stands for a pool, allocator or coordinator this package built: it holds the runtime."""
    return types.SimpleNamespace(runtime=runtime)


def test_our_components_give_their_runtime(runtime):
    assert runtime_of(ours(runtime)) is runtime


def test_holders_of_the_coordinator_give_its_runtime(runtime):
    scheduler = types.SimpleNamespace(hisparse_coordinator=ours(runtime), token_to_kv_pool_allocator=ours(runtime))
    assert runtime_of(scheduler) is runtime
    # a batch SGLang built without the coordinator: none, whatever its allocator (the first holder decides)
    batch = types.SimpleNamespace(hisparse_coordinator=None, token_to_kv_pool_allocator=ours(runtime))
    assert runtime_of(batch) is None


def test_a_tree_cache_gives_the_runtime_of_its_allocator(runtime):
    assert runtime_of(types.SimpleNamespace(token_to_kv_pool_allocator=ours(runtime))) is runtime


@pytest.mark.parametrize(
    "sglang_object",
    [
        None,
        types.SimpleNamespace(runtime=object()),  # something else's "runtime"
        types.SimpleNamespace(hisparse_coordinator=types.SimpleNamespace()),  # SGLang's in-tree coordinator
        types.SimpleNamespace(token_to_kv_pool_allocator=types.SimpleNamespace(runtime=None)),
        types.SimpleNamespace(),
    ],
)
def test_sglangs_own_objects_have_none(sglang_object):
    assert runtime_of(sglang_object) is None


def test_the_prompt_limit_is_set_and_read_through_the_runtime(runtime):
    message = "Input length (9000 tokens) exceeds the maximum allowed length (8191 tokens)."
    assert runtime.explain_rejection(message, 8_191) == message  # nothing recorded yet
    runtime.set_request_limit(8_191, "raise host_to_device_ratio.")
    assert runtime.explain_rejection(message, 8_191) == f"{message} raise host_to_device_ratio."
    assert runtime.explain_rejection(message, 4_095) == message  # another limit: not the pool's
    runtime.set_request_limit(8_191, None)  # the context length sets it now
    assert runtime.explain_rejection(message, 8_191) == message
