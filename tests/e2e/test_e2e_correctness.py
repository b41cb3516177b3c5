"""End to end on a GPU: SGLang 0.5.17 serving the tiny DeepSeek-V3.2 model with the plugin gives the
same greedy tokens and per-token logprobs as SGLang without HiSparse (and as its in-tree HiSparse).

Runs benchmarks/e2e/run_e2e.py (correctness phase) unless HISPARSE_E2E_RUN=0, in which case it
checks the results.json a harness run just wrote (HISPARSE_E2E_STATE, default /tmp/hisparse_e2e).
Needs the bundle installed (docs/gpu-e2e.md) and HISPARSE_E2E=1.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.e2e]

REPO = pathlib.Path(__file__).resolve().parents[2]


def results() -> dict:
    state = pathlib.Path(os.environ.get("HISPARSE_E2E_STATE", "/tmp/hisparse_e2e"))
    if os.environ.get("HISPARSE_E2E_RUN", "1") == "1":
        arms = os.environ.get("HISPARSE_E2E_ARMS", "a,c")
        subprocess.run(
            [sys.executable, str(REPO / "benchmarks/e2e/run_e2e.py"), "--arms", arms,
             "--phases", "preflight,correctness,report", "--state-dir", str(state)],
            check=False,
        )
    return json.loads((state / "results.json").read_text())


def test_plugin_matches_no_hisparse_tokens_and_logprobs():
    data = results()
    comparison = data["compare"].get("c_vs_a")
    assert comparison is not None, f"no c_vs_a comparison in the results: {sorted(data['compare'])}"
    assert comparison["same_weights"], "the arms did not load identical weights"
    assert comparison["prompts_compared"] >= 3, comparison
    assert comparison["prompts_identical"] == comparison["prompts_compared"], comparison["per_prompt"]
    assert comparison["mismatched_tokens"] == 0
    assert comparison["max_abs_dlogprob_before_divergence"] == 0.0
    assert comparison["max_abs_dtop5_before_divergence"] == 0.0
    correctness = data["arms"]["a"]["correctness"]
    assert correctness.get("context_sensitive", True), "outputs do not depend on the context: the check proves little"
