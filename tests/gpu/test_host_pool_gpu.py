"""The host pool pinned the new way (memory/pinning.py) on a GPU: page-locked, read by the kernels
through the same pointers, released on close; a refused registration leaves no CUDA error behind."""

import pytest
import torch

from hisparse_sglang.memory import HostKVPool
from hisparse_sglang.memory.pinning import CudaRegistrar

pytestmark = pytest.mark.gpu


def test_pinned_pool_is_page_locked_and_read_by_the_copy_kernel():
    from hisparse_sglang.ops.swap_in import CudaOps

    ops = CudaOps()

    pool = HostKVPool(5, 3000, 656, pin=True, threads=4)
    assert pool.pinned and all(layer.is_pinned() for layer in pool.layers)
    for layer_id, layer in enumerate(pool.layers):
        layer.copy_(torch.arange(3000 * 656, dtype=torch.int64).add(layer_id * 7).remainder(251).to(torch.uint8)
                    .reshape(3000, 656))
    device = [torch.zeros((100, 656), dtype=torch.uint8, device="cuda") for _ in range(5)]
    rows = torch.randperm(3000)[:100].cuda()
    ops.copy_rows(pool.layers, device, rows, torch.arange(100, device="cuda"))  # zero-copy reads of host rows
    torch.cuda.synchronize()
    for layer_id in range(5):
        assert torch.equal(device[layer_id].cpu(), pool.layers[layer_id][rows.cpu()])
    pool.region.close()
    assert not pool.region.pinned and not pool.layers[0].is_pinned()


def test_a_refused_registration_is_reported_and_leaves_no_error_in_the_callers_thread():
    """Registrations run in worker threads (as HostRegion runs them): CUDA's last error of a refused
    one stays there, so the scheduler thread's next launch check does not report it."""
    import threading

    pool = HostKVPool(1, 4096, 656, pin=True, threads=2)
    registrar = CudaRegistrar(torch.device("cuda"))
    errors = []

    def register_again():
        registrar.enter_thread()
        errors.append(registrar.register(pool.region.address, pool.region.nbytes))  # already registered

    worker = threading.Thread(target=register_again)
    worker.start()
    worker.join()
    assert errors[0] is not None and "cudaError" in errors[0]
    torch.ones(4, device="cuda").add_(1)  # torch checks this launch with cudaGetLastError
    torch.cuda.synchronize()
