"""Ships the CUDA sources of csrc/ inside the wheel as hisparse_sglang/csrc (compiled on first use)."""

import pathlib
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPyWithKernelSources(build_py):
    def run(self):
        super().run()
        source_dir = pathlib.Path(__file__).parent / "csrc"
        target_dir = pathlib.Path(self.build_lib) / "hisparse_sglang" / "csrc"
        target_dir.mkdir(parents=True, exist_ok=True)
        for path in sorted(source_dir.glob("*")):
            if path.suffix in (".cuh", ".cu", ".h"):
                shutil.copy2(path, target_dir / path.name)


setup(cmdclass={"build_py": BuildPyWithKernelSources})
