"""The coordinator with the CUDA kernels over many decode steps and layers, against the reference.

Two simulated servers run the same requests: one on the CPU with the reference ops, one on the
GPU with the CUDA ops. Every step, each swap-in output must be identical, and each server checks
that every returned row holds the right token's KV and that every invariant holds.
"""

import pytest
import torch

from hisparse_sglang.config import HiSparseConfig
from hisparse_sglang.ops import reference
from hisparse_sglang.testing.sim import SimulatedServer

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("resident_first", [True, False])
@pytest.mark.parametrize("item_bytes", [1152, 656])
def test_decode_loop_matches_reference(resident_first, item_bytes):
    from hisparse_sglang.ops.swap_in import CudaOps

    cuda_ops = CudaOps()

    config = HiSparseConfig(
        top_k=256,
        device_buffer_size=512,
        page_size=64,
        host_to_device_ratio=4,
        resident_first=resident_first,
        switch_cooldown_steps=4,
        promote_free_fraction=0.05,
    )
    common = dict(layer_num=3, item_bytes=item_bytes, device_pages=60, max_reqs=8, max_context=4096, seed=11)
    cpu = SimulatedServer(config, ops=reference, device="cpu", **common)
    gpu = SimulatedServer(config, ops=cuda_ops, device="cuda", **common)
    prompts = [(1500, 120), (2600, 90), (700, 150), (3000, 60), (400, 200)]
    for prompt_len, output_len in prompts:
        assert (cpu.add_request(prompt_len, output_len) is None) == (gpu.add_request(prompt_len, output_len) is None)
    switches = 0
    for step in range(140):
        gpu.settle_copies()  # copies complete at the same step as on the CPU
        cpu_report = cpu.step()
        gpu_report = gpu.step()
        assert cpu_report == gpu_report, f"step {step}: {cpu_report} != {gpu_report}"
        for layer_id, (expected, actual) in enumerate(zip(cpu.last_rows, gpu.last_rows)):
            assert torch.equal(expected, actual), f"step {step} layer {layer_id}: swap-in rows differ"
        gpu.check_invariants()
        if step % 25 == 10:
            for server in (cpu, gpu):
                server.add_request(1800, 80)
        cpu.readmit_retracted()
        gpu.readmit_retracted()
    stats = gpu.coordinator.stats()
    switches = stats.demotions + stats.promotions
    assert stats.swap_in_misses > 0, "the run never swapped anything in"
    assert switches > 0, "the run never switched modes"
    for server in (cpu, gpu):
        for uid in sorted(server.requests):
            server.finish(uid)
        server.retracted.clear()
        server.check_all_free()


@pytest.mark.parametrize("num_draft_tokens,top_k", [(2, 128), (4, 64)])
@pytest.mark.parametrize("item_bytes", [1152, 656])
def test_verify_loop_matches_reference(num_draft_tokens, top_k, item_bytes):
    """Speculative decoding (docs/speculative.md): the same verify steps (prepare with bind_verify_slots,
    swap_in_positions per layer, commit_accepted with random accept lengths 0..T, the host learning them one
    verify late) on the CPU with the reference ops and on the GPU with the CUDA ops. Every layer's swap-in
    output must be identical; each server checks every returned row's KV and every invariant (committed
    tokens on their host rows, no rejected token's KV on the host, slot D the newest committed token)."""
    from hisparse_sglang.ops.swap_in import CudaOps
    from hisparse_sglang.testing.sim import SpeculativeMode

    config = HiSparseConfig(
        top_k=top_k,
        device_buffer_size=256,  # >= T x top_k
        page_size=64,
        host_to_device_ratio=4,
        resident_first=True,
        switch_cooldown_steps=4,
        promote_free_fraction=0.05,
    )
    common = dict(layer_num=3, item_bytes=item_bytes, device_pages=40, max_reqs=8, max_context=4096, seed=12,
                  speculative=SpeculativeMode(num_draft_tokens))
    cpu = SimulatedServer(config, ops=reference, device="cpu", **common)
    gpu = SimulatedServer(config, ops=CudaOps(), device="cuda", **common)
    for prompt_len, output_len in [(1500, 120), (2600, 90), (700, 150), (300, 200), (2000, 60)]:
        assert (cpu.add_request(prompt_len, output_len) is None) == (gpu.add_request(prompt_len, output_len) is None)
    for step in range(100):
        gpu.settle_copies()
        cpu_report = cpu.step()
        gpu_report = gpu.step()
        assert cpu_report == gpu_report, f"step {step}: {cpu_report} != {gpu_report}"
        for layer_id, (expected, actual) in enumerate(zip(cpu.last_rows, gpu.last_rows)):
            assert torch.equal(expected, actual), f"step {step} layer {layer_id}: swap-in rows differ"
        gpu.check_invariants()
        if step % 30 == 10:
            for server in (cpu, gpu):
                server.add_request(1800, 80)
        cpu.readmit_retracted()
        gpu.readmit_retracted()
    stats = gpu.coordinator.stats()
    assert stats.swap_in_misses > 0, "the run never swapped anything in"
    assert stats.demotions > 0, "no request was ever offloaded: the verify ops of offloaded requests did not run"
    for server in (cpu, gpu):
        for uid in sorted(server.requests):
            server.finish(uid)
        server.retracted.clear()
        server.check_all_free()
