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

KV_CHECK_EVERY = 4  # decode batches between two in-server KV checks (kv_check_fixture.py)


def run_harness(arms: str, state: pathlib.Path, extra: list[str]) -> dict:
    """A fresh harness run of the correctness phase (every prompt decoded 3 times per server, the
    in-server KV check on every 4th decode batch), or with HISPARSE_E2E_RUN=0 the results an earlier run
    left in `state`; fails the test if the harness exited non-zero or an arm is missing or not ok (a
    skipped or failed arm must not pass)."""
    rc = 0
    if os.environ.get("HISPARSE_E2E_RUN", "1") == "1":
        rc = subprocess.run(
            [sys.executable, str(REPO / "benchmarks/e2e/run_e2e.py"), "--fresh", "--arms", arms,
             "--phases", "preflight,correctness,report", "--kv-check-every", str(KV_CHECK_EVERY),
             "--state-dir", str(state), *extra],
            check=False,
        ).returncode
    path = state / "results.json"
    data = json.loads(path.read_text()) if path.exists() else None
    failures = run_failures(rc, data, arms.split(","))
    if failures:
        pytest.fail(f"harness run unusable (see {state / 'harness.log'}): " + "; ".join(failures))
    return data


def assert_run_kv_dtype(data: dict, state: pathlib.Path, kv_dtype: str) -> None:
    """Fails the test if the results are of another ``--kv-cache-dtype`` than the one asked for (a state
    dir reused with HISPARSE_E2E_RUN=0 may hold a run of the other dtype)."""
    ran_with = data["meta"]["args"].get("kv_cache_dtype")
    if ran_with != kv_dtype:
        pytest.fail(
            f"the results in {state} are of --kv-cache-dtype {ran_with}, not {kv_dtype}: run them again "
            "(HISPARSE_E2E_RUN=1) or point HISPARSE_E2E_STATE at a run of that dtype"
        )


def verdict_against_baseline(data: dict, arm: str, baseline: str = "a") -> dict:
    """judge.judge_correctness of `arm` against `baseline` (arm a, or a+mtp), recomputed from the results."""
    comparison = data["compare"].get(f"{arm}_vs_{baseline}")
    assert comparison is not None, f"no {arm}_vs_{baseline} comparison in the results: {sorted(data['compare'])}"
    return judge_correctness(data["arms"][arm]["correctness"], data["arms"][baseline]["correctness"],
                             comparison.get("same_weights"))


def kv_check_of(data: dict, arm: str) -> dict:
    """The in-server KV check's totals of an arm's decoding server (it must have run)."""
    kv = data["arms"][arm].get("log", {}).get("kv_check")
    assert kv and kv["checks"] > 0 and kv["rows"] > 0, f"arm {arm}: the in-server KV check did not run: {kv}"
    return kv


def assert_decodes_like_baseline(data: dict, arm: str, kv_checked: bool = True, baseline: str = "a") -> None:
    """The judge accepts the arm against `baseline` and, where the plugin decodes (`kv_checked`), the
    in-server KV check ran and found no mismatch."""
    verdict = verdict_against_baseline(data, arm, baseline)
    assert verdict["ok"], f"arm {arm} vs {baseline}: {verdict}"
    if not kv_checked:
        return
    kv = kv_check_of(data, arm)
    assert kv["mismatches"] == 0, f"arm {arm}: rows attention read differ from the host pool: {kv}"
