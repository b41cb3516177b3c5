"""What the GPU end-to-end tests share: one fresh run of benchmarks/e2e/run_e2e.py and the verdict on an arm.

The rule an arm is judged by lives in benchmarks/e2e/judge.py, so that the harness's report states the
same verdict the tests reach."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks" / "e2e"))

from judge import judge_correctness, run_failures  # noqa: E402


def run_harness(arms: str, state: pathlib.Path, extra: list[str]) -> dict:
    """A fresh harness run of the correctness phase with every prompt decoded twice per server (or, with
    HISPARSE_E2E_RUN=0, the results an earlier run left in `state`); fails the test if the harness exited
    non-zero or an arm is missing or not ok (a skipped or failed arm must not pass)."""
    rc = 0
    if os.environ.get("HISPARSE_E2E_RUN", "1") == "1":
        rc = subprocess.run(
            [sys.executable, str(REPO / "benchmarks/e2e/run_e2e.py"), "--fresh", "--arms", arms,
             "--phases", "preflight,correctness,report", "--corr-repeat", "8", "--state-dir", str(state), *extra],
            check=False,
        ).returncode
    path = state / "results.json"
    data = json.loads(path.read_text()) if path.exists() else None
    failures = run_failures(rc, data, arms.split(","))
    if failures:
        pytest.fail(f"harness run unusable (see {state / 'harness.log'}): " + "; ".join(failures))
    return data


def assert_decodes_like_baseline(data: dict, arm: str) -> None:
    comparison = data["compare"].get(f"{arm}_vs_a")
    assert comparison is not None, f"no {arm}_vs_a comparison in the results: {sorted(data['compare'])}"
    verdict = judge_correctness(comparison, data["arms"][arm]["correctness"], data["arms"]["a"]["correctness"])
    assert verdict["ok"], f"arm {arm} vs baseline: {verdict}"
