"""The release-sensitive files of tests/sglang with the other supported releases' SGLang (CPU).

.ci/run installs the two ends of the supported range (0.5.17, 0.5.23) in clean environments; the five
releases between them differ in code the plugin calls (docs/sglang-versions.md), and a call that only one
of them changed went unseen once: the draft-budget hook H8 raised TypeError at pool sizing on 0.5.19 - 0.5.21.
This test downloads each neighbouring release's wheel without its dependencies and runs :data:`FILES` with it
ahead of the installed environment on ``PYTHONPATH``: 0.5.18 - 0.5.21 over an installed 0.5.17 (whose torch
2.11 stands in for their 2.13), 0.5.22 over an installed 0.5.23 (the torch they share). That is evidence for
our code paths on each release, not a clean install of it.

``HISPARSE_OTHER_RELEASES``: unset, the releases above for the installed one (none for another); ``0``, none;
else a comma-separated list. The wheels are kept in ``HISPARSE_WHEEL_CACHE`` (default
``~/.cache/hisparse-sglang/sglang-wheels``). Downloading needs PyPI: offline, set ``HISPARSE_OTHER_RELEASES=0``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from hisparse_sglang.integration.sglang import compat

pytestmark = pytest.mark.sglang

REPO = Path(__file__).resolve().parents[2]
# The release-sensitive files: hook targets and their application, the speculative hooks and adapter driven
# with SGLang's classes, validation with SGLang's argument resolution, request and pool fields, pool sizing,
# the coordinator on SGLang's pools, metrics, the PD decode queues and SGLang's Mooncake connector writing our
# host pool. Left to .ci/run's two releases (a minute or more each): the Mooncake fault sessions and the pool
# shared across TP ranks (the PD hooks of the two PD files above), the tokenizer's bench_serving runs (no hook).
FILES = (
    "tests/sglang/test_hooks.py",
    "tests/sglang/test_hook_table.py",
    "tests/sglang/test_compat.py",
    "tests/sglang/test_validation.py",
    "tests/sglang/test_plan_sglang.py",
    "tests/sglang/test_coordinator_sglang.py",
    "tests/sglang/test_metrics_sglang.py",
    "tests/sglang/test_speculative_hooks.py",
    "tests/sglang/test_speculative_sglang.py",
    "tests/sglang/test_pd_long_prompt.py",
    "tests/sglang/test_pd_sglang_mooncake.py",
)
NEIGHBOURS = {"0.5.17": ("0.5.18", "0.5.19", "0.5.20", "0.5.21"), "0.5.23": ("0.5.22",)}


def _releases() -> tuple[str, ...]:
    chosen = os.environ.get("HISPARSE_OTHER_RELEASES")
    if chosen is None:
        return NEIGHBOURS.get(compat.sglang_version() or "", ())
    if chosen.strip() in ("", "0"):
        return ()
    return tuple(release.strip() for release in chosen.split(",") if release.strip())


def _site(release: str) -> Path:
    """A folder holding SGLang ``release`` (its wheel unpacked), downloaded once into the cache."""
    cache = Path(os.environ.get("HISPARSE_WHEEL_CACHE", Path.home() / ".cache" / "hisparse-sglang" / "sglang-wheels"))
    site = cache / f"site-{release}"
    if (site / "sglang" / "version.py").exists():
        return site
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:", "--dest", str(wheels),
         f"sglang=={release}"],
        capture_output=True, text=True, timeout=900,
    )
    found = sorted(wheels.glob(f"sglang-{release}-*.whl"))
    if done.returncode != 0 or not found:
        pytest.fail(
            f"pip could not download the sglang {release} wheel (exit {done.returncode}): {done.stderr[-800:]}\n"
            f"Offline, set HISPARSE_OTHER_RELEASES=0 to skip this test."
        )
    partial = cache / f"site-{release}.partial"
    for leftover in (partial, site):  # an extraction cut short earlier
        shutil.rmtree(leftover, ignore_errors=True)
    with zipfile.ZipFile(found[-1]) as wheel:
        wheel.extractall(partial)
    partial.rename(site)
    return site


@pytest.mark.parametrize("release", _releases() or [pytest.param(None, marks=pytest.mark.skip(
    reason=f"no other release to run for sglang {compat.sglang_version()} (HISPARSE_OTHER_RELEASES)"))])
def test_release_sensitive_files_pass_with_another_release(release):
    site = _site(release)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(REPO / "src"), os.environ.get("PYTHONPATH", "")]))
    probe = subprocess.run([sys.executable, "-c", "import sglang; print(sglang.__version__)"], env=env,
                           capture_output=True, text=True, timeout=300)
    assert probe.stdout.strip() == release, f"{site} gives sglang {probe.stdout.strip()!r}: {probe.stderr[-800:]}"
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *FILES], env=env,
                            cwd=REPO, capture_output=True, text=True, timeout=1500)
    summary = result.stdout.strip().splitlines()[-1:] or ["no output"]
    assert result.returncode == 0, (
        f"tests/sglang with sglang {release}: {summary[0]}\n{result.stdout[-6000:]}\n{result.stderr[-2000:]}"
    )
