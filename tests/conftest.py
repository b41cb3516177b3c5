"""Test markers, each skipped with a reason when its requirement is missing.

* ``gpu``: a CUDA GPU (the kernel tests; run them on the GPU machine).
* ``sglang``: an SGLang release in the supported range importable (``compat.SUPPORTED_SGLANG``;
  .ci/run installs each end of the range in turn).
* ``mooncake``: the Mooncake transfer engine importable (installed by .ci/run).
* ``slow``: a test too long for the default command; skipped unless HISPARSE_RUN_SLOW=1. A test marked
  slow runs neither under the README's ``python -m pytest -q`` nor in .ci/run, so a doc citing it must
  say that it is not checked there. None is marked now: the two that were run by default since
  2026-11-25, the writer's SIGKILL in tests/test_shared_host_pool.py (8-42 s on the loaded 2-core
  machine, once its cause of missed deadlines was found: docs/shared-host-pool.md, "Known problems") and
  the three nvcc builds of tests/test_bench_cli.py (53 s; skipped where nvcc is missing).
* ``e2e``: serves a real model; needs a GPU and HISPARSE_E2E=1 (see docs/gpu-e2e.md).

Fixture ``row_off_the_gpu``: a prefill's staging finds its first row off the GPU and goes to ``copy_rows``.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import pytest

from hisparse_sglang.integration.sglang.compat import SUPPORTED_SGLANG, is_supported, sglang_version


@functools.cache
def _has_gpu() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


@functools.cache
def _has_mooncake() -> str | None:
    """None if importable, else the reason."""
    if importlib.util.find_spec("mooncake") is None:
        return "mooncake transfer engine not installed (pip install 'hisparse-sglang[mooncake]')"
    try:
        import mooncake.engine  # noqa: F401
    except Exception as exc:  # e.g. libibverbs.so.1 missing
        return f"mooncake transfer engine does not import: {exc}"
    return None


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("gpu") and not _has_gpu():
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU; run on the GPU machine (docs/kernels.md)"))
        if item.get_closest_marker("sglang") and not is_supported(sglang_version()):
            item.add_marker(
                pytest.mark.skip(
                    reason=f"needs sglang{SUPPORTED_SGLANG} (found {sglang_version()}); .ci/run installs it"
                )
            )
        if item.get_closest_marker("mooncake"):
            reason = _has_mooncake()
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))
        if item.get_closest_marker("slow") and os.environ.get("HISPARSE_RUN_SLOW") != "1":
            item.add_marker(pytest.mark.skip(reason="slow test; set HISPARSE_RUN_SLOW=1 to run it"))
        if item.get_closest_marker("e2e") and (not _has_gpu() or os.environ.get("HISPARSE_E2E") != "1"):
            item.add_marker(pytest.mark.skip(reason="end-to-end test; needs a GPU and HISPARSE_E2E=1 (docs/gpu-e2e.md)"))


@pytest.fixture
def row_off_the_gpu(monkeypatch):
    """``coordinator.staging.row_runs`` as if a prefill's first row were not on the GPU (device row 0), which a
    request just prefilled never has: its staging goes to ``copy_rows``."""
    from hisparse_sglang.coordinator import staging

    row_runs = staging.row_runs

    def runs_with_a_row_off_the_gpu(src_rows, dst_rows):
        runs = row_runs(src_rows, dst_rows)
        runs[0, 0] = 0
        return runs

    monkeypatch.setattr(staging, "row_runs", runs_with_a_row_off_the_gpu)
