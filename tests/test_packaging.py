"""The CUDA sources travel with every distribution: sdist, wheel built from that sdist, checkout.

Builds offline (no build isolation) with the build frontend and the installed setuptools; skipped
with a reason where those are missing (``pip install '.[test]'`` installs them).
"""

import importlib.util
import pathlib
import shutil
import subprocess
import sys
import tarfile
import zipfile

import pytest

from hisparse_sglang.ops import jit

REPO = pathlib.Path(__file__).resolve().parents[1]
KERNEL_SUFFIXES = (".cuh", ".cu", ".h")


def build_tools_missing() -> str | None:
    if importlib.util.find_spec("build") is None:
        return "the 'build' package is not installed (pip install '.[test]')"
    probe = subprocess.run(
        [sys.executable, "-c", "import setuptools.command.bdist_wheel"], capture_output=True, text=True
    )
    if probe.returncode != 0 and importlib.util.find_spec("wheel") is None:
        return "setuptools >= 70.1 (or the 'wheel' package) is needed to build a wheel offline (pip install '.[test]')"
    return None


def copy_of_the_checkout(target: pathlib.Path) -> pathlib.Path:
    """The files a release is built from (tracked and not ignored, when in a git checkout)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO, capture_output=True
    )
    if listed.returncode == 0 and listed.stdout:
        for name in listed.stdout.decode().split("\0"):
            if name and (REPO / name).is_file() and not name.startswith(("benchmarks/", "tests/", "docs/")):
                (target / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(REPO / name, target / name)
    else:
        for name in ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "src", "csrc"):
            source = REPO / name
            (shutil.copytree if source.is_dir() else shutil.copy2)(source, target / name)
    return target


def locate_sources(python_path: pathlib.Path) -> pathlib.Path:
    """hisparse_sglang.ops.jit.source_dir() as an installation at ``python_path`` sees it."""
    code = "from hisparse_sglang.ops import jit; print(jit.source_dir())"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True,
        env={"PYTHONPATH": str(python_path), "PATH": "/usr/bin:/bin"},
    )
    return pathlib.Path(result.stdout.strip())


def test_sdist_and_a_wheel_built_from_it_carry_the_kernel_sources(tmp_path):
    reason = build_tools_missing()
    if reason:
        pytest.skip(reason)
    checkout = copy_of_the_checkout(tmp_path / "checkout")
    expected = sorted(path.name for path in jit.source_files(REPO / "csrc"))
    headers = {"primitives.cuh", "swap_in.cuh", "swap_in_config.h", "copy_rows.cuh", "decode_rows.cuh"}
    assert headers | {"swap_in_binding.cu"} <= set(expected)
    # No --sdist/--wheel: the frontend builds the sdist, then the wheel from the unpacked sdist.
    subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--skip-dependency-check", "--outdir", str(tmp_path / "dist"),
         str(checkout)],
        check=True, capture_output=True, text=True,
    )
    (sdist,) = (tmp_path / "dist").glob("*.tar.gz")
    (wheel,) = (tmp_path / "dist").glob("*.whl")

    with tarfile.open(sdist) as archive:
        names = archive.getnames()
        root = names[0].split("/")[0]
        assert sorted(n.split("/")[-1] for n in names if n.startswith(f"{root}/csrc/")) == expected, names
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}  # Python >= 3.11.4
        archive.extractall(tmp_path / "sdist", **safe)
    with zipfile.ZipFile(wheel) as archive:
        in_wheel = sorted(n.split("/")[-1] for n in archive.namelist() if n.startswith("hisparse_sglang/csrc/"))
        assert in_wheel == expected, archive.namelist()
        archive.extractall(tmp_path / "site")

    # The package's source-locating code finds them in the installed wheel and in the unpacked sdist.
    found = locate_sources(tmp_path / "site")
    assert found == (tmp_path / "site" / "hisparse_sglang" / "csrc").resolve()
    assert sorted(path.name for path in jit.source_files(found)) == expected
    unpacked = tmp_path / "sdist" / root
    assert locate_sources(unpacked / "src") == (unpacked / "csrc").resolve()
    for name in expected:
        assert (found / name).read_bytes() == (REPO / "csrc" / name).read_bytes()


def test_a_checkout_or_editable_install_uses_the_top_level_csrc():
    assert jit.source_dir() == (REPO / "csrc").resolve() or (jit.source_dir() / "swap_in_binding.cu").is_file()
    assert [path.suffix for path in jit.source_files(jit.source_dir())] == [
        path.suffix for path in sorted((REPO / "csrc").iterdir()) if path.suffix in KERNEL_SUFFIXES
    ]


def test_other_kernel_sources_must_hold_the_binding(tmp_path):
    """``load_module(sources=DIR)`` (a benchmark's before/after) names a directory without the binding
    before any build."""
    from hisparse_sglang.errors import KernelBuildError

    with pytest.raises(KernelBuildError, match=r"no swap_in_binding\.cu in .*sources must name a directory"):
        jit.load_module(sources=str(tmp_path))


def test_cuda_ops_refuse_a_cpu_device_and_name_the_reference_ops():
    from hisparse_sglang.errors import HiSparseError
    from hisparse_sglang.ops.swap_in import CudaOps

    with pytest.raises(HiSparseError, match=r"CudaOps needs a CUDA device, got cpu; use hisparse_sglang.ops.reference"):
        CudaOps("cpu")
