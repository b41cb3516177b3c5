"""Build SGLang's own HiSparse swap-in kernel as a prebuilt tvm-ffi module.

Run this on a machine that has ``sglang`` (0.5.17) and ``apache-tvm-ffi``
installed plus ``nvcc``; a GPU is *not* needed.  The kernel source is never
copied: it is compiled straight from the installed ``sglang`` package by
SGLang's own JIT entry point
(``sglang.kernels.ops.kvcache.hisparse._jit_sparse_module`` ->
``sglang.kernels.jit.utils.load_jit`` -> ``tvm_ffi.cpp.load_inline``), with the
target architecture forced through SGLang's ``override_jit_cuda_arch`` (the
same thing SGLang's JIT would pick on a compute-capability 9.0 GPU: ``9.0a``).

Output (default ``<repo>/.baseline/``)::

    sglang_hisparse_swapin_i{ITEM}_k{TOPK}_h{HOT}_b{BLOCK}_mla_sm{ARCH}.so
    manifest.json   # config -> file, versions, flags, source hashes

Usage (``bench_swap_in.py build-baseline``; only this module and the command line are imported, so
the environment needs sglang and apache-tvm-ffi, not hisparse-sglang)::

    /work/sgl-venv/bin/python benchmarks/bench_swap_in.py build-baseline
    /work/sgl-venv/bin/python benchmarks/bench_swap_in.py build-baseline \
        --config 1152,2048,4096,960 --config 656,2048,4096,960

``--config`` is ``ITEM_BYTES,TOP_K,HOT_BUFFER,BLOCK_SIZE``; BLOCK_SIZE may be
omitted (or ``default``) to use the in-tree default ``swap_in_block_size``.
"""

from __future__ import annotations

import argparse
import ast
import datetime as _dt
import hashlib
import importlib.metadata
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO_ROOT / ".baseline"
DEFAULT_CACHE = pathlib.Path("~/.cache/hisparse-sglang-baseline").expanduser()
EXPORT_NAME = "load_cache_to_device_buffer"
EXPECTED_SGLANG = "0.5.17"
DEFAULT_ITEM_BYTES = (1152, 656)  # bf16 MLA (576 x 2) and fp8 DSA layout
DEFAULT_TOP_K = 2048
DEFAULT_HOT = 4096


def lib_filename(item: int, top_k: int, hot: int, block: int, arch_tag: str) -> str:
    """Shared-library name for one config (what ``baseline.load`` looks for without a manifest)."""
    return f"sglang_hisparse_swapin_i{item}_k{top_k}_h{hot}_b{block}_mla_sm{arch_tag}.so"


def _sha256(path: pathlib.Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _source_closure(entry: pathlib.Path, include_dir: pathlib.Path) -> dict[str, str]:
    """sha256 of the kernel source and every in-package header it reaches."""
    quoted = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)
    angled = re.compile(r"^\s*#\s*include\s*<(sgl_kernel/[^>]+)>", re.MULTILINE)
    root = include_dir.parent
    out: dict[str, str] = {}
    stack = [entry.resolve()]
    seen: set[pathlib.Path] = set()
    while stack:
        p = stack.pop()
        if p in seen or not p.is_file():
            continue
        seen.add(p)
        try:
            key = str(p.relative_to(root))
        except ValueError:
            key = p.name
        out[key] = _sha256(p)
        text = p.read_text(errors="ignore")
        stack += [(p.parent / inc).resolve() for inc in quoted.findall(text)]
        stack += [(include_dir / inc).resolve() for inc in angled.findall(text)]
    return dict(sorted(out.items()))


def _default_from_signature(src: pathlib.Path, cls: str, func: str, arg: str):
    """Default value of ``arg`` in ``cls.func`` read (not imported) from ``src``."""
    tree = ast.parse(src.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for fn in node.body:
                if isinstance(fn, ast.FunctionDef) and fn.name == func:
                    a = fn.args
                    pos = a.posonlyargs + a.args
                    defaults = [None] * (len(pos) - len(a.defaults)) + list(a.defaults)
                    pairs = list(zip(pos, defaults)) + list(zip(a.kwonlyargs, a.kw_defaults))
                    for name, default in pairs:
                        if name.arg == arg and default is not None:
                            return ast.literal_eval(default)
    return None


def _default_from_pop(src: pathlib.Path, key: str):
    """Default of ``<x>.pop("key", DEFAULT)`` read from ``src``."""
    tree = ast.parse(src.read_text())
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "pop"
            and len(node.args) == 2
            and isinstance(node.args[0], ast.Constant)
            and node.args[0].value == key
        ):
            return ast.literal_eval(node.args[1])
    return None


def in_tree_default_block_size(sglang_dir: pathlib.Path) -> tuple[int, dict]:
    """The ``swap_in_block_size`` the in-tree coordinator uses by default."""
    found = {
        "srt/managers/hisparse_coordinator.py:HiSparseCoordinator.__init__": _default_from_signature(
            sglang_dir / "srt/managers/hisparse_coordinator.py",
            "HiSparseCoordinator", "__init__", "swap_in_block_size"),
        "srt/mem_cache/sparsity/factory.py:extra_config.pop": _default_from_pop(
            sglang_dir / "srt/mem_cache/sparsity/factory.py", "swap_in_block_size"),
    }
    values = {v for v in found.values() if v is not None}
    if len(values) != 1:
        raise SystemExit(f"cannot determine in-tree swap_in_block_size default: {found}")
    return values.pop(), found


def _parse_config(text: str, default_block: int) -> tuple[int, int, int, int]:
    parts = [p.strip() for p in text.split(",")]
    if len(parts) == 3:
        parts.append("default")
    if len(parts) != 4:
        raise argparse.ArgumentTypeError(
            f"--config expects ITEM_BYTES,TOP_K,HOT_BUFFER[,BLOCK_SIZE], got {text!r}")
    block = default_block if parts[3] in ("", "default") else int(parts[3])
    item, top_k, hot = (int(p) for p in parts[:3])
    if hot < top_k:
        raise argparse.ArgumentTypeError(f"hot buffer {hot} < top_k {top_k} (SGLang asserts this)")
    if not (1 <= block <= 1024):
        raise argparse.ArgumentTypeError(f"block size {block} outside [1, 1024]")
    return item, top_k, hot, block


def _ninja_vars(build_dir: pathlib.Path) -> dict[str, str]:
    out = {}
    ninja = build_dir / "build.ninja"
    if ninja.is_file():
        for line in ninja.read_text().splitlines():
            m = re.match(r"^(cxx|nvcc|cxxflags|cuda_cflags|ldflags) = (.*)$", line)
            if m:
                out[m.group(1)] = m.group(2)
    return out


def _exported_symbols(so: pathlib.Path) -> list[str]:
    try:
        res = subprocess.run(["nm", "-D", "--defined-only", str(so)],
                             capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return []
    return sorted(l.split()[-1] for l in res.stdout.splitlines() if "__tvm_ffi_" in l)


def _needed(so: pathlib.Path) -> list[str]:
    try:
        res = subprocess.run(["readelf", "-d", str(so)], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return []
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", res.stdout)


def run(args) -> int:
    """``build-baseline``: ``args`` from ``cli`` (config, out_dir, cache_dir, arch, clean)."""

    # Both SGLang's nvcc probe and tvm-ffi's CUDA-home probe resolve nvcc's
    # grandparent; a wrapper at /usr/local/bin/nvcc would give /usr/local and
    # -L/usr/local/lib64 (no libcudart).  Point them at the real toolkit.
    if not (os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")):
        for cand in ("/usr/local/cuda", "/usr/local/cuda-13.0"):
            if pathlib.Path(cand, "bin", "nvcc").is_file():
                os.environ["CUDA_HOME"] = cand
                break
    os.environ.setdefault("TVM_FFI_GPU_BACKEND", "cuda")
    cache_dir = pathlib.Path(args.cache_dir).expanduser().resolve()
    if args.clean and cache_dir.exists():
        shutil.rmtree(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    os.environ["TVM_FFI_CACHE_DIR"] = str(cache_dir)  # read by load_jit at call time

    import sglang  # noqa: F401
    import tvm_ffi
    from sglang.kernels.jit.utils import arch as sgl_arch
    from sglang.kernels.jit.utils import compile as sgl_compile
    from sglang.kernels.jit.utils import make_cpp_args, override_jit_cuda_arch
    from sglang.kernels.ops.kvcache import hisparse as sgl_hisparse

    sglang_dir = pathlib.Path(sglang.__file__).resolve().parent
    sglang_version = importlib.metadata.version("sglang")
    if sglang_version != EXPECTED_SGLANG:
        # The baseline is 0.5.17's kernel: 0.5.18 added three miss-plan arguments to
        # load_cache_to_device_buffer (sglang_kernel.py calls the 0.5.17 signature) and 0.5.19
        # moved the source to csrc/kvcacheio/hisparse.cuh (docs/sglang-versions.md).
        raise SystemExit(f"sglang {sglang_version} is installed; this builds SGLang {EXPECTED_SGLANG}'s kernel: "
                         f"run it with sglang=={EXPECTED_SGLANG}")
    tvm_ffi_version = importlib.metadata.version("apache-tvm-ffi")
    default_block, block_sources = in_tree_default_block_size(sglang_dir)

    try:
        configs = [_parse_config(c, default_block) for c in args.config]
    except (argparse.ArgumentTypeError, ValueError) as exc:
        raise SystemExit(f"build-baseline: {exc}") from exc
    configs = configs or [
        (item, DEFAULT_TOP_K, DEFAULT_HOT, default_block) for item in DEFAULT_ITEM_BYTES
    ]

    major, minor = (int(x) for x in args.arch.split("."))
    kernel_src = (sgl_compile.KERNEL_PATH / "csrc" / "hisparse.cuh").resolve()
    include_dir = sgl_compile.KERNEL_PATH / "include"
    sources = _source_closure(kernel_src, include_dir)
    closure_digest = hashlib.sha256(
        "".join(f"{k}\0{v}\0" for k, v in sources.items()).encode()).hexdigest()
    nvcc_version = subprocess.run(
        [str(pathlib.Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")),
         "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]

    out_dir = pathlib.Path(args.out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest_path = out_dir / "manifest.json"
    manifest = {"entries": {}}
    if manifest_path.is_file():
        try:
            manifest = json.loads(manifest_path.read_text())
        except json.JSONDecodeError:
            pass
    manifest.setdefault("entries", {})

    for item, top_k, hot, block in configs:
        t0 = time.time()
        with override_jit_cuda_arch(major, minor):
            arch = sgl_arch.get_jit_cuda_arch()
            # Exactly SGLang's call path (the in-tree wrapper uses is_mla=True,
            # is_dsv4_layout=False for load_cache_to_device_buffer_mla).
            sgl_hisparse._jit_sparse_module.cache_clear()
            module = sgl_hisparse._jit_sparse_module(
                item, block, top_k, hot, is_mla=True, is_dsv4_layout=False)
            # Recompute where load_jit put it, with SGLang's own helpers.
            cache_args = make_cpp_args(item, block, top_k, hot, True, False)
            module_name = ("sgl_kernel_jit_" + "_".join(["sparse_cache", *cache_args])
                           + "_" + sgl_compile._local_jit_source_hash([str(kernel_src)]))
            build_dir = cache_dir / sgl_compile._jit_build_dir_name(module_name)
            default_flags = sgl_arch.get_default_target_flags()
            target_name = arch.target_name
        built = build_dir / f"{module_name}.so"
        if not built.is_file():
            raise SystemExit(f"expected JIT output {built} not found")
        if not hasattr(module, EXPORT_NAME):
            raise SystemExit(f"{built} does not export {EXPORT_NAME}")
        arch_tag = target_name.replace(".", "")
        dest = out_dir / lib_filename(item, top_k, hot, block, arch_tag)
        tmp = dest.with_suffix(".so.tmp")
        shutil.copy2(built, tmp)
        os.replace(tmp, dest)
        # sanity: the copy loads with tvm_ffi (no GPU needed to load)
        loaded = tvm_ffi.load_module(str(dest))
        getattr(loaded, EXPORT_NAME)
        key = f"{item},{top_k},{hot},{block}"
        manifest["entries"][key] = {
            "file": dest.name,
            "item_size_bytes": item, "num_top_k": top_k, "hot_buffer_size": hot,
            "block_size": block, "is_mla": True, "is_dsv4_layout": False,
            "template": f"load_cache_to_device_buffer<{block}, {top_k}, {hot}, true, false>",
            "export": EXPORT_NAME,
            "exported_symbols": _exported_symbols(dest),
            "needed": _needed(dest),
            "arch": target_name,
            "sglang_module_name": module_name,
            "jit_build_dir": str(build_dir),
            "sglang_default_cuda_cflags": default_flags,
            "ninja": _ninja_vars(build_dir),
            "so_sha256": _sha256(dest),
            "so_bytes": dest.stat().st_size,
            "build_seconds": round(time.time() - t0, 1),
        }
        print(f"[built] {key} -> {dest} ({dest.stat().st_size} bytes, {time.time() - t0:.1f}s)")

    manifest.update({
        "sglang_version": sglang_version,
        "sglang_location": str(sglang_dir),
        "apache_tvm_ffi_version": tvm_ffi_version,
        "nvcc": nvcc_version,
        "cuda_home": os.environ.get("CUDA_HOME"),
        "python_build": sys.version.split()[0],
        "in_tree_default_swap_in_block_size": default_block,
        "swap_in_block_size_sources": block_sources,
        "kernel_source": str(kernel_src),
        "kernel_source_sha256": _sha256(kernel_src),
        "kernel_source_closure_sha256": closure_digest,
        "kernel_source_closure": sources,
        "built_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    })
    manifest_path.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    print(f"[manifest] {manifest_path}")
    return 0
