"""End to end on a GPU, PD disaggregation: a prefill instance (SGLang 0.5.17, no HiSparse) and a decode
instance with the plugin (arm pd-c) share the GPU; the prefill sends every request's KV over Mooncake (TCP
on 127.0.0.1) into the decode instance's host pool. Greedy tokens and logprobs are judged against the
co-located baseline without HiSparse (arm a) by the rule of test_e2e_correctness.py
(benchmarks/e2e/judge.py), and the decode instance checks every 4th decode batch row by row against its
host pool, the rows the prefill wrote (benchmarks/e2e/kv_check_fixture.py). HISPARSE_E2E_PD_ARMS=a,pd-c,pd-b adds SGLang's in-tree HiSparse on the decode
side. Needs bundle part 2 (Mooncake) installed: docs/gpu-e2e.md. State in HISPARSE_E2E_PD_STATE (default
/tmp/hisparse_e2e_pd); HISPARSE_E2E_RUN=0 judges an earlier run's results.
"""

import os
import pathlib

import pytest
from e2e_harness import assert_decodes_like_baseline, run_harness

pytestmark = [pytest.mark.gpu, pytest.mark.e2e]

PD_ARMS = ("pd-c", "pd-b")
SITE = pathlib.Path(os.environ.get("HISPARSE_E2E_SITE", "/tmp/site"))


@pytest.fixture(scope="module")
def data() -> dict:
    if os.environ.get("HISPARSE_E2E_RUN", "1") == "1" and not (SITE / "mooncake" / "engine.so").exists():
        pytest.skip(f"Mooncake (bundle part 2) is not installed in {SITE}: "
                    "bash tools/gpu-bundle/install_part.sh .e2e/parts/part2.tar.xz (docs/gpu-e2e.md)")
    state = pathlib.Path(os.environ.get("HISPARSE_E2E_PD_STATE", "/tmp/hisparse_e2e_pd"))
    return run_harness(os.environ.get("HISPARSE_E2E_PD_ARMS", "a,pd-c"), state, ["--site", str(SITE)])


@pytest.mark.parametrize("arm", PD_ARMS)
def test_pd_decode_instance_decodes_like_sglang_without_hisparse(data, arm):
    if arm not in data["arms"]:
        pytest.skip(f"arm {arm} was not run (HISPARSE_E2E_PD_ARMS)")
    assert_decodes_like_baseline(data, arm, kv_checked=arm == "pd-c")  # pd-b decodes with SGLang's own HiSparse
