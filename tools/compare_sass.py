"""Shows that two trees of kernel sources compile to the same machine code, kernel by kernel.

Compiles ``swap_in_binding.cu`` of each source directory into an sm_90a cubin with the flags of
the package's own build (``ops/jit.py``), once per variant (the production build and each test or
trace define the GPU tests use), and compares ``cuobjdump -sass`` of every kernel: instructions,
addresses and encodings. Needs nvcc, cuobjdump and apache-tvm-ffi's headers; no GPU.

    git archive HEAD csrc | tar -x -C /tmp/before
    python3 tools/compare_sass.py /tmp/before/csrc            # against this tree's csrc/

Prints one line per variant and kernel, ``same`` or ``DIFFERENT``; exits 1 if any kernel differs
or a kernel is in one build only. A refactor that moves code between headers must leave every
line ``same``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))  # runs from a checkout, installed or not

from hisparse_sglang.ops import jit  # noqa: E402 (after the path above)

ARCH = "9.0a"
# The builds whose code runs on a GPU: production, and the variants the GPU tests and the
# end-to-end checks load (docs/kernels.md, "Correctness"; docs/gpu-e2e.md, the corrupting build).
VARIANTS = (
    (),
    ("HISPARSE_TEST_LATE_ARRIVALS_NS=30000",),
    ("HISPARSE_TEST_CORRUPT_MISSES=16",),
    ("HISPARSE_TEST_LATE_COPIERS_NS=30000",),
    ("HISPARSE_TEST_LATE_PLANNER_NS=30000",),
    ("HISPARSE_TRACE",),
)
_FUNCTION = re.compile(r"\s*Function : (\S+)")


def cubin_flags(defines: tuple[str, ...]) -> list[str]:
    """The package build's nvcc flags for ``defines``, producing a cubin instead of a library."""
    return [flag for flag in jit._flags(ARCH, jit.check_defines(defines)) if flag != "-shared"] + ["-cubin"]


def sass_by_kernel(sources: pathlib.Path, defines: tuple[str, ...], scratch: pathlib.Path, cuobjdump: str) -> dict:
    """{mangled kernel name: its SASS lines} of one build."""
    includes, _, _ = jit._tvm_ffi_paths()
    name = "_".join(defines).replace("=", "-") or "production"
    cubin = scratch / f"{name}.cubin"
    nvcc = jit._cuda_home() / "bin" / "nvcc"
    command = [str(nvcc), *cubin_flags(defines), *(f"-I{path}" for path in includes),
               str(sources / "swap_in_binding.cu"), "-o", str(cubin)]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"nvcc failed for {sources} {defines}:\n{' '.join(command)}\n{result.stderr[-4000:]}")
    listing = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    kernels: dict[str, list[str]] = {}
    current = None
    for line in listing.splitlines():
        match = _FUNCTION.match(line)
        if match:
            current = kernels.setdefault(match.group(1), [])
        elif current is not None:
            # cuobjdump pads every line to the widest instruction of the whole file: compare the tokens.
            current.append(" ".join(line.split()))
    return kernels


def find_cuobjdump(given: str | None) -> str:
    candidates = [given] if given else [shutil.which("cuobjdump"), str(jit._cuda_home() / "bin" / "cuobjdump")]
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise SystemExit("cuobjdump not found: put it on PATH or pass --cuobjdump")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", type=pathlib.Path, help="a directory of kernel sources (e.g. an earlier commit's csrc/)")
    parser.add_argument("after", type=pathlib.Path, nargs="?", default=REPO / "csrc", help="default: this tree's csrc/")
    parser.add_argument("--cuobjdump", help="path of cuobjdump (default: PATH, then the CUDA toolkit's bin/)")
    args = parser.parse_args(argv)
    cuobjdump = find_cuobjdump(args.cuobjdump)
    identical = True
    with tempfile.TemporaryDirectory(prefix="hisparse-sass-") as scratch, \
            concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        jobs = {}
        for side, sources in (("before", args.before), ("after", args.after)):
            directory = pathlib.Path(scratch) / side
            directory.mkdir()
            for defines in VARIANTS:
                jobs[side, defines] = pool.submit(sass_by_kernel, sources.resolve(), defines, directory, cuobjdump)
        for defines in VARIANTS:
            before, after = jobs["before", defines].result(), jobs["after", defines].result()
            label = " ".join(f"-D{define}" for define in defines) or "production"
            for kernel in sorted(set(before) | set(after)):
                if kernel not in before or kernel not in after:
                    identical = False
                    print(f"{label}: only in {'after' if kernel in after else 'before'}: {kernel}")
                    continue
                same = before[kernel] == after[kernel]
                identical &= same
                print(f"{label}: {'same' if same else 'DIFFERENT'} ({len(before[kernel])} lines) {kernel}")
    print("every kernel identical" if identical else "some kernels differ")
    return 0 if identical else 1


if __name__ == "__main__":
    raise SystemExit(main())
