"""Ships the CUDA sources of csrc/ inside the wheel as hisparse_sglang/csrc (compiled on first use).

csrc/ stays at the top level of the checkout and of the sdist (MANIFEST.in); a wheel, built from
either, gets a copy inside the package, where ops/jit.py looks first.
"""

import pathlib
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

KERNEL_SUFFIXES = (".cuh", ".cu", ".h")


class BuildPyWithKernelSources(build_py):
    def run(self):
        super().run()
        source_dir = pathlib.Path(__file__).resolve().parent / "csrc"
        sources = sorted(path for path in source_dir.glob("*") if path.suffix in KERNEL_SUFFIXES)
        if not sources:
            raise RuntimeError(
                f"no CUDA sources in {source_dir}: this sdist or checkout is incomplete (MANIFEST.in must "
                f"include csrc/); a wheel without them could never compile its kernels."
            )
        target_dir = pathlib.Path(self.build_lib) / "hisparse_sglang" / "csrc"
        target_dir.mkdir(parents=True, exist_ok=True)
        for path in sources:
            shutil.copy2(path, target_dir / path.name)


setup(cmdclass={"build_py": BuildPyWithKernelSources})
