#!/usr/bin/env python3
"""Host time of the calls the plugin makes per verify step outside CUDA graphs, on one GPU: the commit's launch
through tvm-ffi (torch tensors, or tvm-ffi tensors converted once), a device tensor's ``fill_``, the current
stream by ``torch.cuda.current_stream(device)`` and by torch's raw accessor, ``torch.empty``; each with the
stream idle (best of 3 x 4,000 calls) and, the launches, with a ~1 ms kernel still running ahead of them (median
and p90 of 200): whether a launch waits for the GPU. Also the logical reserve of a speculative step
(``PagedAllocator.alloc_extend`` of 4 x 3 tokens inside the last pages, and of whole new pages as SGLang
0.5.17 - 0.5.21 round it) with each of its two layouts, the verify prepare's reads of page starts, and one
upload of a few integers (``memory.paged.upload_ints``).

    PYTHONPATH=src python3 benchmarks/host_launch_cost.py

The commit runs on a batch whose ``num_real_reqs`` is 0 (the kernel launches and returns).
"""

from __future__ import annotations

import time

import torch


def idle(fn, n: int = 4000) -> str:
    """Host time per call, the stream idle: best of three runs of ``n`` calls."""
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    runs = []
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter() - start) / n * 1e6)
        torch.cuda.synchronize()
    return f"{min(runs):.2f} us (runs {', '.join(f'{r:.2f}' for r in runs)})"


def busy(fn, n: int = 200, sleep_cycles: int = 2_000_000) -> str:
    """Host time of one call issued while the stream still runs a ~1 ms kernel (``torch.cuda._sleep``)."""
    times = []
    for _ in range(n):
        torch.cuda._sleep(sleep_cycles)
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
        torch.cuda.synchronize()
    times.sort()
    return f"median {times[len(times) // 2]:.2f} us, p90 {times[int(len(times) * 0.9)]:.2f} us"


def main() -> None:
    import tvm_ffi

    from hisparse_sglang.memory import paged
    from hisparse_sglang.ops.jit import load_module

    module = load_module()
    print("torch", torch.__version__, "DLPack exchange API on torch.Tensor:",
          hasattr(torch.Tensor, "__dlpack_c_exchange_api__"))
    dev = "cuda"
    batch, positions, layers, slots, context, buffer = 1, 4, 4, 8, 1024, 64
    req_pool_indices = torch.zeros(batch, dtype=torch.int64, device=dev)
    seq_lens = torch.full((batch,), 100, dtype=torch.int64, device=dev)
    accept_lens = torch.ones(batch, dtype=torch.int64, device=dev)
    num_real_reqs = torch.zeros(1, dtype=torch.int32, device=dev)
    req_to_token = torch.zeros(slots, context, dtype=torch.int32, device=dev)
    device_row_of_loc = torch.zeros(context * slots + 1, dtype=torch.int32, device=dev)
    buffer_of_req = torch.full((slots,), -1, dtype=torch.int32, device=dev)
    slot_rows = torch.zeros(slots, buffer + 64, dtype=torch.int32, device=dev)
    device_kv = [torch.zeros(100, 576, dtype=torch.bfloat16, device=dev) for _ in range(layers)]
    host_kv = [torch.zeros(100, 576, dtype=torch.bfloat16).pin_memory() for _ in range(layers)]
    device_layers = torch.tensor([t.data_ptr() for t in device_kv], dtype=torch.uint64).to(dev)
    host_layers = torch.tensor([t.data_ptr() for t in host_kv], dtype=torch.uint64).to(dev)
    stream = torch.cuda.current_stream().cuda_stream
    args = (req_pool_indices, seq_lens, accept_lens, num_real_reqs, positions, req_to_token, device_row_of_loc,
            buffer_of_req, slot_rows, buffer, device_layers, host_layers, 1152, stream)
    converted = tuple(tvm_ffi.from_dlpack(a) if isinstance(a, torch.Tensor) else a for a in args)
    device = torch.device("cuda", 0)
    print("commit_accepted, torch tensors:        ", idle(lambda: module.commit_accepted(*args)))
    print("commit_accepted, tvm-ffi tensors:      ", idle(lambda: module.commit_accepted(*converted)))
    print("tensor.fill_(0):                       ", idle(lambda: num_real_reqs.fill_(0)))
    print("current_stream(device).cuda_stream:    ", idle(lambda: torch.cuda.current_stream(device).cuda_stream))
    print("torch._C._cuda_getCurrentRawStream(0): ", idle(lambda: torch._C._cuda_getCurrentRawStream(0)))
    print("tvm_ffi.from_dlpack(tensor):           ", idle(lambda: tvm_ffi.from_dlpack(req_pool_indices)))
    print("torch.empty(4, device='cuda'):         ", idle(lambda: torch.empty(4, device=dev)))
    # A speculative step's logical reserve (hook H1): 4 requests x 3 tokens inside their last pages.
    allocator = paged.PagedAllocator("logical", 4096, 64, device=dev)
    prefix = torch.tensor([1000, 2000, 3000, 4000])
    last_loc = (torch.tensor([100, 200, 300, 400]) * 64 + (prefix - 1) % 64).to(dev)
    layouts = (("Python-integer layout", paged.SMALL_EXTEND_TOKENS), ("tensor layout (extend_layout)", -1))
    for name, limit in layouts:
        paged.SMALL_EXTEND_TOKENS = limit
        print(f"alloc_extend 4 x 3 tokens, {name}: ", idle(lambda: allocator.alloc_extend(prefix, prefix + 3, last_loc)))
    # The same reserve as SGLang 0.5.17 - 0.5.21 lay it out: lengths rounded up to whole pages, so a request whose
    # reserve grows takes a whole new page. 4 x 64 tokens: the rows of the new pages (nothing uploaded); 64, 64,
    # 64, 63 tokens: unequal counts, laid out through an upload.
    starts = torch.tensor([1024, 2048, 3072, 4096])
    page_ends = (torch.tensor([100, 200, 300, 400]) * 64 + 63).to(dev)
    shapes = (("4 x 64 tokens starting pages (no upload)", starts + 64),
              ("64/64/64/63 tokens starting pages (upload)", starts + torch.tensor([64, 64, 64, 63])))
    whole_pages = paged.PagedAllocator("logical", 1 << 15, 64, device=dev)

    def whole_page_reserve(seq, limit, n=1000, ahead=False):
        paged.SMALL_EXTEND_TOKENS = limit
        times = []
        for _ in range(3 if not ahead else n):
            whole_pages.clear()
            torch.cuda.synchronize()
            if ahead:
                torch.cuda._sleep(2_000_000)
            start = time.perf_counter()
            for _ in range(1 if ahead else n):
                whole_pages.alloc_extend(starts, seq, page_ends)
            times.append((time.perf_counter() - start) / (1 if ahead else n) * 1e6)
        torch.cuda.synchronize()
        times.sort()
        if ahead:
            return f"median {times[len(times) // 2]:.2f} us, p90 {times[int(len(times) * 0.9)]:.2f} us"
        return f"{times[0]:.2f} us (runs {', '.join(f'{t:.2f}' for t in times)})"

    for name, seq in shapes:
        for layout, limit in layouts:
            print(f"alloc_extend {name}, {layout}: ", whole_page_reserve(seq, limit))
    # The verify prepare's page starts of resident requests (req_to_token entries): one-element views, or an
    # uploaded gather.
    from hisparse_sglang.coordinator import speculative

    print("page starts of 1 request, views:             ", idle(lambda: speculative._entries(req_to_token, [1], [64])))
    print("page starts of 4 requests, views + cat:      ",
          idle(lambda: speculative._entries(req_to_token, [0, 1, 2, 3], [64] * 4)))
    print("page starts of 4 requests, upload + gather:  ",
          idle(lambda: req_to_token[tuple(paged.upload_ints([[0, 1, 2, 3], [64] * 4], device))]))
    print("upload_ints of 2 x 4 integers:               ", idle(lambda: paged.upload_ints([[0, 1, 2, 3]] * 2, device)))
    print("--- with the stream busy (a sleeping kernel ahead)")
    print("commit_accepted, torch tensors:        ", busy(lambda: module.commit_accepted(*args)))
    print("commit_accepted, tvm-ffi tensors:      ", busy(lambda: module.commit_accepted(*converted)))
    print("tensor.fill_(0):                       ", busy(lambda: num_real_reqs.fill_(0)))
    print("torch.empty(4, device='cuda'):         ", busy(lambda: torch.empty(4, device=dev)))
    for name, limit in layouts:
        paged.SMALL_EXTEND_TOKENS = limit
        print(f"alloc_extend 4 x 3 tokens, {name}: ", busy(lambda: allocator.alloc_extend(prefix, prefix + 3, last_loc)))
    for name, seq in shapes:
        for layout, limit in layouts:
            print(f"alloc_extend {name}, {layout}: ", whole_page_reserve(seq, limit, n=200, ahead=True))
    print("page starts of 4 requests, views + cat:      ",
          busy(lambda: speculative._entries(req_to_token, [0, 1, 2, 3], [64] * 4)))
    print("page starts of 4 requests, upload + gather:  ",
          busy(lambda: req_to_token[tuple(paged.upload_ints([[0, 1, 2, 3], [64] * 4], device))]))
    print("upload_ints of 2 x 4 integers:               ", busy(lambda: paged.upload_ints([[0, 1, 2, 3]] * 2, device)))


if __name__ == "__main__":
    main()
