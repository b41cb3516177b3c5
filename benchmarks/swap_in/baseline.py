"""Load the prebuilt SGLang HiSparse swap-in kernel (no ``sglang`` import).

The shared libraries are produced by ``bench_swap_in.py build-baseline`` (``build_baseline.py``,
on a machine with sglang installed) into ``<repo>/.baseline/``; this module needs only
``torch`` and ``tvm_ffi`` (apache-tvm-ffi, same version as the build: 0.1.11).
``bench_swap_in.py check-baseline [--smoke]`` loads every library of the manifest (and runs the
GPU smoke test).

    from swap_in import baseline   # the package beside benchmarks/bench_swap_in.py
    swap_in = baseline.load(item_bytes=1152, top_k=2048, hot_buffer_size=4096,
                            block_size=960)
    empty = torch.empty(0)
    swap_in(top_k_tokens, device_buffer_tokens, host_cache_locs, device_buffer_locs,
            host_cache, empty, device_buffer, empty, top_k_device_locs,
            req_pool_indices, seq_lens, lru_slots, num_real_reqs,
            1, item_size_bytes)

Argument list and order are exactly the in-tree call
``module.load_cache_to_device_buffer(...)`` in
``sglang/kernels/ops/kvcache/hisparse.py::_load_cache_to_device_buffer_mla``,
fed by ``HiSparseCoordinator.swap_in_selected_pages`` (sglang 0.5.17) as:

  S = max request-pool slots, R = batch rows, K = top_k, D = hot buffer size,
  P = device page size (1), C = max (compressed) context length,
  N_host / N_dev = host / device KV pool tokens, B = item_size_bytes.

  top_k_tokens          int32 [R, K]  CUDA  sequence positions picked by top-k
                                            (-1 allowed as padding); row stride read
  device_buffer_tokens  int32 [S, D+P] CUDA coordinator.req_device_buffer_tokens[layer]
                                            (token held by each hot slot, -1 = empty);
                                            updated in place
  host_cache_locs       int64 [S, C+P] CUDA coordinator.req_to_host_pool (shared by
                                            all layers); shape[1] is the row stride
  device_buffer_locs    int32 [S, D+P] CUDA coordinator.req_device_buffer_token_locs[layer]
                                            (device KV index of each hot slot; slot D is
                                            the newest token's slot)
  host_cache            one layer of the host KV pool, mem_pool_host.kv_buffer[layer]:
                        [N_host, 1, kv_dim] (uint8 for fp8 / 656 B, bf16 for 1152 B),
                        a *CPU* tensor that is page-locked (SGLang: plain allocation +
                        cudaHostRegister(ptr, bytes, 0); torch pin_memory=True works too).
                        The kernel dereferences host_cache.data_ptr() on the GPU
                        (unified addressing: pinned host pointer == device pointer);
                        passing the pinned CPU torch tensor through tvm_ffi is exactly
                        what SGLang does; no device-pointer wrapper is needed.
  empty                 torch.empty(0) (CPU float32), host V slot, unused for MLA
  device_buffer         one layer of the device KV pool, mem_pool_device.kv_buffer[layer]:
                        [N_dev(+page), 1, kv_dim], CUDA, row stride = B bytes
  empty                 torch.empty(0), device V slot, unused for MLA
  top_k_device_locs     int32 [R, K]  CUDA  output: device KV index per top-k entry
                                            (coordinator.top_k_device_locs_buffer[:R])
  req_pool_indices      int64 (or int32) [R] CUDA  forward_batch.req_pool_indices
  seq_lens              int64 (or int32) [R] CUDA  forward_batch.seq_lens (compressed)
  lru_slots             int16 [S, D]  CUDA  coordinator.lru_slots[layer]; in place
  num_real_reqs         int32 [1]     CUDA  rows >= this get top_k_device_locs = -1
  page_size             int  (1 in-tree)
  item_size_bytes       int  (1152 bf16 MLA, 656 fp8 DSA)

The kernel launches on torch's *current* CUDA stream of top_k_tokens' device
(tvm_ffi queries it through torch's DLPack exchange API).  The cubin is
sm_90a only (no PTX): it runs on H100/H200 (compute capability 9.0) only.
"""

from __future__ import annotations

import ctypes
import json
import os
import pathlib
from typing import Any

import torch  # imported first: it loads libcudart.so.13 that the .so NEEDs

from swap_in.build_baseline import DEFAULT_OUT, EXPORT_NAME, lib_filename

DEFAULT_LIB_DIR = pathlib.Path(os.environ.get("HISPARSE_BASELINE_DIR", DEFAULT_OUT))
DEFAULT_ARCH_TAG = "90a"
ARG_NAMES = (
    "top_k_tokens", "device_buffer_tokens", "host_cache_locs", "device_buffer_locs",
    "host_cache", "host_cache_v", "device_buffer", "device_buffer_v",
    "top_k_device_locs", "req_pool_indices", "seq_lens", "lru_slots",
    "num_real_reqs", "page_size", "item_size_bytes",
)


def _ensure_cudart() -> None:
    """Make sure a libcudart.so.13 is in the process before dlopen of the kernel."""
    try:
        ctypes.CDLL("libcudart.so.13", mode=ctypes.RTLD_GLOBAL)
        return
    except OSError:
        pass
    roots = [pathlib.Path(torch.__file__).resolve().parents[1] / "nvidia" / sub / "lib"
             for sub in ("cu13", "cuda_runtime")]
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            roots += [pathlib.Path(home) / "lib64", pathlib.Path(home) / "targets/x86_64-linux/lib"]
    for root in roots:
        cand = root / "libcudart.so.13"
        if cand.is_file():
            ctypes.CDLL(str(cand), mode=ctypes.RTLD_GLOBAL)
            return
    raise OSError("libcudart.so.13 not found (needed by the SGLang baseline kernel)")


def manifest(lib_dir: str | os.PathLike | None = None) -> dict:
    path = pathlib.Path(lib_dir or DEFAULT_LIB_DIR) / "manifest.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def library_path(item_bytes: int, top_k: int, hot_buffer_size: int, block_size: int,
                 lib_dir: str | os.PathLike | None = None) -> pathlib.Path:
    lib_dir = pathlib.Path(lib_dir or DEFAULT_LIB_DIR)
    entry = manifest(lib_dir).get("entries", {}).get(
        f"{item_bytes},{top_k},{hot_buffer_size},{block_size}")
    path = lib_dir / (entry["file"] if entry else
                      lib_filename(item_bytes, top_k, hot_buffer_size, block_size, DEFAULT_ARCH_TAG))
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} missing: run python benchmarks/bench_swap_in.py build-baseline "
            f"--config {item_bytes},{top_k},{hot_buffer_size},{block_size} "
            "with sglang installed, then carry .baseline/ here")
    return path


class SGLangSwapIn:
    """Callable with the in-tree ``module.load_cache_to_device_buffer`` signature."""

    def __init__(self, path: pathlib.Path, item_bytes: int, top_k: int,
                 hot_buffer_size: int, block_size: int, check_first_call: bool = True):
        _ensure_cudart()
        import tvm_ffi

        self.path = path
        self.item_bytes, self.top_k = item_bytes, top_k
        self.hot_buffer_size, self.block_size = hot_buffer_size, block_size
        self.module = tvm_ffi.load_module(str(path))
        self.raw = getattr(self.module, EXPORT_NAME)  # tvm_ffi.Function, no checks
        self._pending_check = check_first_call

    def check_args(self, *args: Any) -> None:
        """Validate dtypes/devices/shapes as the in-tree coordinator passes them."""
        if len(args) != len(ARG_NAMES):
            raise TypeError(f"expected {len(ARG_NAMES)} args {ARG_NAMES}, got {len(args)}")
        a = dict(zip(ARG_NAMES, args))
        want = {
            "top_k_tokens": (torch.int32,), "device_buffer_tokens": (torch.int32,),
            "host_cache_locs": (torch.int64,), "device_buffer_locs": (torch.int32,),
            "top_k_device_locs": (torch.int32,), "req_pool_indices": (torch.int32, torch.int64),
            "seq_lens": (torch.int32, torch.int64), "lru_slots": (torch.int16,),
            "num_real_reqs": (torch.int32,),
        }
        for name, dtypes in want.items():
            t = a[name]
            if not isinstance(t, torch.Tensor) or t.dtype not in dtypes or not t.is_cuda:
                raise TypeError(f"{name}: need CUDA tensor of {dtypes}, got "
                                f"{getattr(t, 'dtype', type(t))} on {getattr(t, 'device', '?')}")
        hc, db = a["host_cache"], a["device_buffer"]
        if hc.is_cuda or not hc.is_pinned():
            raise ValueError("host_cache must be a page-locked CPU tensor "
                             "(pin_memory=True or cudaHostRegister'ed)")
        if not db.is_cuda:
            raise ValueError("device_buffer must be a CUDA tensor")
        B = a["item_size_bytes"]
        if B != self.item_bytes:
            raise ValueError(f"item_size_bytes {B} != library config {self.item_bytes}")
        for name, t in (("host_cache", hc), ("device_buffer", db)):
            if not t.is_contiguous() or (t.numel() * t.element_size()) % B or (
                    t.stride(0) * t.element_size() != B):
                raise ValueError(f"{name}: need contiguous rows of exactly {B} bytes")
        K, D = self.top_k, self.hot_buffer_size
        if a["top_k_tokens"].shape[1] != K or a["top_k_device_locs"].shape[1] != K:
            raise ValueError(f"top_k_tokens/top_k_device_locs need {K} columns")
        if a["lru_slots"].shape[-1] != D or a["device_buffer_tokens"].shape[-1] < D + 1:
            raise ValueError(f"lru_slots needs {D} columns, device_buffer_tokens >= {D + 1}")
        dev = a["top_k_tokens"].device
        cap = torch.cuda.get_device_capability(dev)
        if cap != (9, 0):
            raise RuntimeError(f"library is sm_90a only; {dev} has capability {cap}")

    def __call__(self, *args: Any) -> None:
        if self._pending_check:
            self.check_args(*args)
            self._pending_check = False
        self.raw(*args)


def load(item_bytes: int, top_k: int = 2048, hot_buffer_size: int = 4096,
         block_size: int = 960, lib_dir: str | os.PathLike | None = None,
         check_first_call: bool = True) -> SGLangSwapIn:
    """Return a callable running SGLang 0.5.17's in-tree swap-in kernel.

    ``block_size`` 960 is the in-tree default ``swap_in_block_size``.
    ``obj.raw`` is the bare tvm_ffi function (no Python-side checks at all).
    """
    path = library_path(item_bytes, top_k, hot_buffer_size, block_size, lib_dir)
    return SGLangSwapIn(path, item_bytes, top_k, hot_buffer_size, block_size, check_first_call)


def smoke_test(item_bytes: int = 1152, top_k: int = 2048, hot_buffer_size: int = 4096,
               block_size: int = 960, lib_dir=None, host_register: bool = False,
               reqs: int = 2, seq_len: int = 20000) -> None:
    """Cold-miss sanity run on a GPU: every returned device row equals its host row."""
    dev = torch.device("cuda")
    swap_in = load(item_bytes, top_k, hot_buffer_size, block_size, lib_dir)
    S, D, P, C = reqs + 1, hot_buffer_size, 1, seq_len
    g = torch.Generator(device="cpu").manual_seed(0)
    n_host = S * C
    if host_register:  # SGLang's way: plain allocation + cudaHostRegister(flags=0)
        host = torch.empty((n_host, 1, item_bytes), dtype=torch.uint8)
        rc = torch.cuda.cudart().cudaHostRegister(host.data_ptr(), host.numel(), 0)
        assert int(rc) == 0, f"cudaHostRegister rc={int(rc)}"
    else:
        host = torch.empty((n_host, 1, item_bytes), dtype=torch.uint8, pin_memory=True)
    host.copy_(torch.randint(0, 256, host.shape, dtype=torch.uint8, generator=g))
    n_dev = S * (D + P)
    device_buffer = torch.zeros((n_dev, 1, item_bytes), dtype=torch.uint8, device=dev)
    host_cache_locs = torch.randperm(n_host, generator=g).view(S, C).to(dev)
    host_cache_locs = torch.cat([host_cache_locs, torch.full((S, P), -1, device=dev)], 1)
    device_buffer_locs = torch.arange(n_dev, dtype=torch.int32, device=dev).view(S, D + P)
    device_buffer_tokens = torch.full((S, D + P), -1, dtype=torch.int32, device=dev)
    lru_slots = torch.arange(D, dtype=torch.int16, device=dev).repeat(S, 1).contiguous()
    rpi = torch.arange(1, reqs + 1, dtype=torch.int64, device=dev)
    seq_lens = torch.full((reqs,), C, dtype=torch.int64, device=dev)
    top_k_tokens = torch.stack([torch.randperm(C - 1, generator=g)[:top_k]
                                for _ in range(reqs)]).to(torch.int32).to(dev)
    out = torch.full((reqs, top_k), -7, dtype=torch.int32, device=dev)
    nrr = torch.tensor([reqs], dtype=torch.int32, device=dev)
    empty = torch.empty(0)
    swap_in(top_k_tokens, device_buffer_tokens, host_cache_locs, device_buffer_locs, host,
            empty, device_buffer, empty, out, rpi, seq_lens, lru_slots, nrr, 1, item_bytes)
    torch.cuda.synchronize()
    for r in range(reqs):
        rid = int(rpi[r])
        src = host_cache_locs[rid, top_k_tokens[r].long()].cpu()
        got = device_buffer[out[r].long()].cpu()
        assert (out[r] >= 0).all(), "unfilled top_k_device_locs"
        assert torch.equal(got, host[src]), f"row mismatch for request {r}"
    if host_register:
        torch.cuda.cudart().cudaHostUnregister(host.data_ptr())
    print(f"smoke ok: {swap_in.path.name} host_register={host_register}")


def run(ns) -> int:
    """``check-baseline``: load every library of the manifest (``--smoke``: and run it on the GPU)."""
    m = manifest(ns.lib_dir)
    print(f"sglang {m.get('sglang_version')} tvm-ffi {m.get('apache_tvm_ffi_version')}")
    for key in sorted(m.get("entries", {})):
        item, k, hot, blk = (int(x) for x in key.split(","))
        fn = load(item, k, hot, blk, ns.lib_dir)
        print(f"loaded {key}: {fn.path.name} -> {fn.raw}")
        if ns.smoke:
            smoke_test(item, k, hot, blk, ns.lib_dir, host_register=False)
            smoke_test(item, k, hot, blk, ns.lib_dir, host_register=True)
    return 0
