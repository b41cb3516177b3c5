"""Ops built on a variant module (``CudaOps(module=...)``) run the same kernels as the default build (GPU only).

The benchmarks time and trace variants this way (``bench_swap_in.py --define``, ``--against``, ``trace``):
the module reaches only the ops built on it, and a define the sources do not read changes nothing.
"""

import pytest
import torch

from hisparse_sglang.testing.cases import make_case

pytestmark = pytest.mark.gpu

UNREAD_DEFINE = ("HISPARSE_TEST_VARIANT=1",)  # no source reads it: the variant's kernels are the default's


def run(case, module, splits=None):
    from hisparse_sglang.ops.swap_in import CudaOps

    gpu = case.clone(device="cuda", pin_host=True)
    out = torch.full(tuple(case.top_k.shape), 777, dtype=torch.int32, device="cuda")
    counters = torch.zeros(2, dtype=torch.int64, device="cuda")
    CudaOps(module=module).swap_in(*gpu.args(), out=out, counters=counters, splits=splits)
    torch.cuda.synchronize()
    return [t.cpu() for t in (out, counters, gpu.slot_tokens, gpu.slot_stamps, gpu.token_slot, gpu.device_kv)]


@pytest.mark.parametrize("batch,miss_rate,splits", [(1, 0.2, None), (8, 0.5, 3), (33, 0.05, 1)])
def test_variant_module_matches_the_default_build(batch, miss_rate, splits):
    from hisparse_sglang.ops.jit import load_module
    from hisparse_sglang.ops.swap_in import CudaOps

    variant = load_module(UNREAD_DEFINE)
    assert variant is not load_module()
    case = make_case(batch, 2048, 4096, 1152, miss_rate=miss_rate, duplicate_fraction=0.02, seed=60 + batch)
    for name, expected, actual in zip(("out", "counters", "slot_tokens", "slot_stamps", "token_slot", "device_kv"),
                                      run(case, None, splits), run(case, variant, splits)):
        assert torch.equal(expected, actual), name
    assert CudaOps(module=variant).choose_splits(batch, 2048, 4096, 1024) == CudaOps().choose_splits(
        batch, 2048, 4096, 1024)


def test_copy_rows_through_a_variant_module():
    from hisparse_sglang.ops.jit import load_module
    from hisparse_sglang.ops.swap_in import CudaOps

    # Row r holds (7 r + column) mod 256: every row differs from every other in every byte.
    host = ((torch.arange(64).reshape(-1, 1) * 7 + torch.arange(1152)) % 256).to(torch.uint8).pin_memory()
    device = torch.full((32, 1152), 0xCD, dtype=torch.uint8, device="cuda")
    src = torch.tensor([5, 63, 0, 17], device="cuda")
    dst = torch.tensor([31, 0, 7, 8], device="cuda")
    CudaOps(module=load_module(UNREAD_DEFINE)).copy_rows([host], [device], src, dst)
    torch.cuda.synchronize()
    assert torch.equal(device[dst].cpu(), host[src.cpu()])
    untouched = torch.ones(32, dtype=torch.bool)
    untouched[dst.cpu()] = False
    assert bool((device.cpu()[untouched] == 0xCD).all())


def test_sources_of_another_tree_build_a_module_of_their_own(tmp_path):
    """``load_module(sources=DIR)`` (``bench_swap_in.py table --against DIR``): a copy of the sources
    with one more comment builds another library that runs the same kernels."""
    import shutil

    from hisparse_sglang.ops import jit

    other = tmp_path / "csrc"
    shutil.copytree(jit.source_dir(), other)
    (other / "swap_in_config.h").write_text((other / "swap_in_config.h").read_text() + "\n// another tree\n")
    module = jit.load_module(sources=str(other))
    assert module is not jit.load_module()
    case = make_case(4, 2048, 4096, 1152, miss_rate=0.3, seed=71)
    for name, expected, actual in zip(("out", "counters", "slot_tokens", "slot_stamps", "token_slot", "device_kv"),
                                      run(case, None), run(case, module)):
        assert torch.equal(expected, actual), name
