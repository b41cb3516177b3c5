"""Compile-on-first-use of the CUDA sources in ``csrc/``, loaded through apache-tvm-ffi.

The shared library is cached outside the package directory (``$HISPARSE_CACHE_DIR``, default
``~/.cache/hisparse_sglang``) under a key made of the source contents, the compiler flags, the
target architecture, the package version and the tvm-ffi version. It is built in a temporary
directory and renamed into place atomically while holding a file lock, so concurrent processes
(one SGLang scheduler per GPU) build it once.

Variants: ``load_module(defines=("NAME=VALUE", ...))`` builds the same sources with extra ``-D``
macros (e.g. ``HISPARSE_TRACE``, the phase timeline of ``csrc/swap_in.cuh``) into a cache entry of
their own; the ops use it only where a caller builds them on that module (``ops.swap_in.CudaOps(module=...)``),
never in place of the default build.

Environment:
    HISPARSE_CACHE_DIR: cache location.
    HISPARSE_CUDA_ARCH: target such as ``9.0a`` or ``8.0`` (default: the current GPU; ``a`` suffix
        on 9.0 for Hopper-specific code paths).
    CUDA_HOME: toolkit location (else the directory of ``nvcc`` on PATH, else /usr/local/cuda).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import pathlib
import re
import shutil
import subprocess
import tempfile
import time

from hisparse_sglang import __version__
from hisparse_sglang.errors import KernelBuildError

__all__ = ["load_module", "check_defines", "cache_dir", "source_dir", "source_files", "cuda_arch"]

logger = logging.getLogger(__name__)

_BINDING = "swap_in_binding.cu"  # the translation unit nvcc compiles; it includes the headers
_KERNEL_SUFFIXES = (".cuh", ".cu", ".h")  # what setup.py and MANIFEST.in ship
_NVCC_FLAGS = (
    "-O3",
    "-std=c++17",
    "-shared",
    "-Xcompiler",
    "-fPIC",
    "--expt-relaxed-constexpr",
    "-lineinfo",
)
# A macro name as C spells them, upper case as the sources' own (HISPARSE_TRACE), with an optional
# value of plain characters: nvcc gets it as one argument, so nothing here needs quoting.
_DEFINE = re.compile(r"[A-Z_][A-Z0-9_]*(=[A-Za-z0-9_.+-]*)?")


def source_dir() -> pathlib.Path:
    """The kernel sources: inside the package (a wheel), else ``csrc/`` next to ``src/`` (a source
    checkout, an editable install or an unpacked sdist)."""
    package_copy = pathlib.Path(__file__).resolve().parent.parent / "csrc"
    checkout = pathlib.Path(__file__).resolve().parents[3] / "csrc"
    for candidate in (package_copy, checkout):
        if (candidate / _BINDING).is_file():
            return candidate
    raise KernelBuildError(
        f"CUDA sources not found in {package_copy} or {checkout}; reinstall hisparse-sglang (a wheel carries "
        f"them as hisparse_sglang/csrc, an sdist as csrc/)."
    )


def source_files(sources: pathlib.Path) -> list[pathlib.Path]:
    """Every kernel source in ``sources`` (what the build depends on), in a stable order."""
    return sorted(path for path in sources.iterdir() if path.suffix in _KERNEL_SUFFIXES)


def cache_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("HISPARSE_CACHE_DIR", pathlib.Path.home() / ".cache" / "hisparse_sglang"))


def cuda_arch() -> str:
    """Target architecture, e.g. ``9.0a``."""
    override = os.environ.get("HISPARSE_CUDA_ARCH")
    if override:
        return override
    import torch

    if not torch.cuda.is_available():
        raise KernelBuildError(
            "no CUDA device to compile the HiSparse kernels for; set HISPARSE_CUDA_ARCH (e.g. 9.0a) to build without one."
        )
    major, minor = torch.cuda.get_device_capability()
    return f"{major}.{minor}{'a' if (major, minor) == (9, 0) else ''}"


def _gencode(arch: str) -> list[str]:
    digits = arch.replace(".", "")
    return [f"-gencode=arch=compute_{digits},code=sm_{digits}"]


def _cuda_home() -> pathlib.Path:
    if os.environ.get("CUDA_HOME"):
        return pathlib.Path(os.environ["CUDA_HOME"])
    nvcc = shutil.which("nvcc")
    if nvcc:
        resolved = pathlib.Path(nvcc).resolve()
        if resolved.parent.name == "bin" and (resolved.parent.parent / "include" / "cuda_runtime.h").exists():
            return resolved.parent.parent
    for candidate in ("/usr/local/cuda", *sorted(map(str, pathlib.Path("/usr/local").glob("cuda-*")), reverse=True)):
        if (pathlib.Path(candidate) / "bin" / "nvcc").exists():
            return pathlib.Path(candidate)
    raise KernelBuildError("nvcc not found: install the CUDA toolkit or set CUDA_HOME.")


def _tvm_ffi_paths() -> tuple[list[str], pathlib.Path, str]:
    try:
        import tvm_ffi
        from tvm_ffi import libinfo
    except ImportError as exc:
        raise KernelBuildError(f"apache-tvm-ffi is required to build the HiSparse kernels: {exc}") from exc
    library = pathlib.Path(libinfo.find_libtvm_ffi())
    includes = [libinfo.find_include_path(), libinfo.find_dlpack_include_path()]
    return includes, library, getattr(tvm_ffi, "__version__", "unknown")


def _build_key(sources: pathlib.Path, arch: str, flags: list[str], tvm_version: str) -> str:
    digest = hashlib.sha256()
    for path in source_files(sources):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    digest.update(" ".join(flags).encode())
    digest.update(arch.encode())
    digest.update(__version__.encode())
    digest.update(tvm_version.encode())
    return digest.hexdigest()[:20]


def check_defines(defines: tuple[str, ...]) -> tuple[str, ...]:
    """``defines`` as a tuple of ``NAME`` or ``NAME=VALUE`` macros (without ``-D``), in order.

    Raises:
        TypeError: ``defines`` is a single string or not a sequence of strings.
        ValueError: an entry is not ``NAME`` or ``NAME=VALUE`` (name ``[A-Z_][A-Z0-9_]*``, value of
            letters, digits and ``_.+-``).
    """
    if isinstance(defines, (str, bytes)):
        raise TypeError(f"defines must be a sequence of macros, got the string {defines!r}; pass ({defines!r},)")
    checked = tuple(defines)
    for define in checked:
        if not isinstance(define, str):
            raise TypeError(f"defines must hold strings, got {define!r} ({type(define).__name__})")
        if not _DEFINE.fullmatch(define):
            hint = f"; drop the -D: {define[2:]!r}" if define.startswith("-D") else ""
            raise ValueError(
                f"compile define {define!r} is not NAME or NAME=VALUE (NAME like HISPARSE_TRACE: upper-case letters, "
                f"digits and _; VALUE: letters, digits and _.+-){hint}"
            )
    return checked


@functools.cache
def load_module(defines: tuple[str, ...] = (), sources: str | None = None):
    """Build (once per cache key) and load the kernel library; returns the tvm-ffi module.

    ``defines``: a tuple (the call is cached: a list is refused as unhashable) of extra ``-D``
    macros, ``NAME`` or ``NAME=VALUE`` without the ``-D`` (see :func:`check_defines`), for variant
    builds such as ``("HISPARSE_TRACE",)``. They are part of the compiler flags and so of the cache
    key: each set of defines is a separate cache entry and a separate module; the default ``()`` is
    the build every op uses unless given another module. A variant module is used only where it is
    passed (``ops.swap_in.CudaOps(module=...)``).

    ``sources``: another directory of kernel sources (default :func:`source_dir`), for a benchmark's
    before/after comparison (``bench_swap_in.py table --against DIR``); its contents are part of the
    cache key like the package's own.

    Raises:
        TypeError, ValueError: ``defines`` is malformed (:func:`check_defines`), before any build.
        KernelBuildError: no CUDA sources, toolkit, target or tvm-ffi, or nvcc failed.
    """
    if sources is not None:
        sources = str(pathlib.Path(sources).resolve())
        if not (pathlib.Path(sources) / _BINDING).is_file():
            raise KernelBuildError(f"no {_BINDING} in {sources}: sources must name a directory of kernel sources")
    return _load_variant(check_defines(defines), sources)


@functools.cache
def _load_variant(defines: tuple[str, ...], other_sources: str | None):
    """One module per checked define set and source directory (``load_module()`` and
    ``load_module(())`` share it)."""
    sources = source_dir() if other_sources is None else pathlib.Path(other_sources)
    arch = cuda_arch()
    includes, library, tvm_version = _tvm_ffi_paths()
    flags = _flags(arch, defines)
    key = _build_key(sources, arch, flags, tvm_version)
    target_dir = cache_dir() / f"hisparse_kernels_{key}"
    target = target_dir / "hisparse_kernels.so"
    if not target.exists():
        _build(sources, target, flags, includes, library)
    import tvm_ffi

    return tvm_ffi.load_module(str(target))


def _flags(arch: str, defines: tuple[str, ...]) -> list[str]:
    """nvcc's flags: the fixed ones, the defines, the target (without defines, the flags of every
    earlier release, so the default build keeps its cache key)."""
    return [*_NVCC_FLAGS, *(f"-D{define}" for define in defines), *_gencode(arch)]


def _build(sources: pathlib.Path, target: pathlib.Path, flags: list[str], includes: list[str], library: pathlib.Path) -> None:
    target.parent.parent.mkdir(parents=True, exist_ok=True)
    lock_path = target.parent.parent / (target.parent.name + ".lock")
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():  # another process built it while we waited
            return
        nvcc = _cuda_home() / "bin" / "nvcc"
        with tempfile.TemporaryDirectory(dir=target.parent.parent, prefix=".build-") as scratch:
            output = pathlib.Path(scratch) / target.name
            command = [
                str(nvcc),
                *flags,
                *(f"-I{path}" for path in includes),
                str(sources / _BINDING),
                "-o",
                str(output),
                f"-L{library.parent}",
                f"-l{library.stem.removeprefix('lib')}",
                f"-Xlinker=-rpath={library.parent}",
            ]
            started = time.monotonic()
            logger.info("HiSparse: compiling CUDA kernels for %s (first use)", target.parent.name)
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode != 0:
                raise KernelBuildError(
                    f"nvcc failed ({result.returncode}) building the HiSparse kernels:\n{' '.join(command)}\n"
                    f"{result.stderr[-4000:]}"
                )
            staged = pathlib.Path(scratch) / "final"
            staged.mkdir()
            shutil.move(str(output), staged / target.name)
            if target.parent.exists():  # left behind by a build that crashed before the rename
                shutil.rmtree(target.parent)
            os.replace(staged, target.parent)
            logger.info("HiSparse: kernels compiled in %.1f s", time.monotonic() - started)
