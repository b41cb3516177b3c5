"""End to end on a GPU: SGLang 0.5.17 serving the tiny DeepSeek-V3.2 with speculative decoding (EAGLE / NextN
MTP, one NextN layer, topk 1) and the plugin decodes like SGLang with the same speculation and no HiSparse.

Arms (benchmarks/e2e/arms.py): a+mtp (no HiSparse), c+mtp (resident-first), d+mtp (always offload: every
verify step swaps in the history rows of every position), and a (no speculation). Judged as
test_e2e_correctness.py judges (benchmarks/e2e/judge.py): each plugin arm against a+mtp, and, where the
outputs are the target's own greedy ones (no acceptance simulation), against a. Inside the plugin's servers
every 4th decode batch's rows are checked against the host pool (kv_check_fixture.py: a verify's history
before the newest committed token).

HISPARSE_E2E_MTP_STEPS (1 - 3, default 1): draft steps S (T = S + 1 verify positions). HISPARSE_E2E_MTP_BUFFER
(default: the plugin's default, 4096 slots): the plugin arms' device_buffer_size; below T x 2048 a step whose
positions name more distinct tokens than the buffer holds leaves its later positions out and accepts fewer
drafts (the tiny model's random indexer does so at most steps at T = 4). HISPARSE_E2E_MTP_ACCEPT_LEN (default 0): > 0 accepts that many tokens per
verify with SGLang's own acceptance simulation (the draft's real tokens), so the paths of long accepts run;
the dummy-weight draft's own acceptance is about 1.0. Then only a+mtp is the baseline, and every MTP arm
must show exactly that accept length. HISPARSE_E2E_MTP_PD=1 adds arm pd-c+mtp (PD decode with the plugin, both
instances speculating; needs bundle part 2, Mooncake, in HISPARSE_E2E_SITE, default /tmp/site), judged and
KV-checked as the co-located plugin arms. HISPARSE_E2E_MTP_ARMS (default: all of them) runs a subset of the
plugin arms, e.g. pd-c+mtp alone beside its baselines. HISPARSE_E2E_MTP_DX=1 adds arm dx+mtp (d+mtp on the kernel
build that copies every 16th missed row from the wrong host row, the verify's swap-in included): the in-server
KV check must see wrong rows and the judge must reject it against a+mtp. HISPARSE_E2E_KV_DTYPE=fp8_e4m3 runs every arm with an fp8 KV cache
(DSA backend flashmla_kv, 656-B rows) instead of bfloat16. HISPARSE_E2E_RUN / HISPARSE_E2E_STATE as in
test_e2e_correctness.py (a state reused with HISPARSE_E2E_RUN=0 must be of the KV dtype asked for).
"""

import json
import os
import pathlib

import pytest
from e2e_harness import (
    assert_decodes_like_baseline,
    assert_run_kv_dtype,
    kv_check_of,
    run_harness,
    verdict_against_baseline,
)

pytestmark = [pytest.mark.gpu, pytest.mark.e2e]

STEPS = int(os.environ.get("HISPARSE_E2E_MTP_STEPS", "1"))
ACCEPT_LEN = float(os.environ.get("HISPARSE_E2E_MTP_ACCEPT_LEN", "0"))
PD = os.environ.get("HISPARSE_E2E_MTP_PD", "0") == "1"
DX = os.environ.get("HISPARSE_E2E_MTP_DX", "0") == "1"
SITE = pathlib.Path(os.environ.get("HISPARSE_E2E_SITE", "/tmp/site"))
BUFFER = int(os.environ.get("HISPARSE_E2E_MTP_BUFFER", "0"))  # 0: the plugin's default device_buffer_size
KV_DTYPE = os.environ.get("HISPARSE_E2E_KV_DTYPE", "bfloat16")  # fp8_e4m3: the flashmla_kv path
ALL_PLUGIN_MTP_ARMS = ("c+mtp", "d+mtp") + (("pd-c+mtp",) if PD else ())
PLUGIN_MTP_ARMS = tuple(os.environ.get("HISPARSE_E2E_MTP_ARMS", ",".join(ALL_PLUGIN_MTP_ARMS)).split(","))
if not set(PLUGIN_MTP_ARMS) <= set(ALL_PLUGIN_MTP_ARMS):
    raise ValueError(f"HISPARSE_E2E_MTP_ARMS={','.join(PLUGIN_MTP_ARMS)}: each arm must be one of "
                     f"{', '.join(ALL_PLUGIN_MTP_ARMS)} (pd-c+mtp needs HISPARSE_E2E_MTP_PD=1)")


@pytest.fixture(scope="module")
def data() -> dict:
    if PD and os.environ.get("HISPARSE_E2E_RUN", "1") == "1" and not (SITE / "mooncake" / "engine.so").exists():
        pytest.skip(f"HISPARSE_E2E_MTP_PD=1 needs Mooncake (bundle part 2) in {SITE}: "
                    "bash tools/gpu-bundle/install_part.sh .e2e/parts/part2.tar.xz (docs/gpu-e2e.md)")
    state = pathlib.Path(os.environ.get("HISPARSE_E2E_STATE", "/tmp/hisparse_e2e_mtp"))
    extra = ["--mtp-steps", str(STEPS), "--mtp-accept-len", str(ACCEPT_LEN), "--kv-cache-dtype", KV_DTYPE]
    extra += ["--site", str(SITE)] if PD else []
    if BUFFER:
        extra += ["--plugin-hisparse-config", json.dumps({"device_buffer_size": BUFFER})]
    arms = ",".join(("a+mtp",) + PLUGIN_MTP_ARMS + (("dx+mtp",) if DX else ())) + ("" if ACCEPT_LEN else ",a")
    data = run_harness(arms, state, extra)
    assert_run_kv_dtype(data, state, KV_DTYPE)
    return data


@pytest.mark.parametrize("arm", PLUGIN_MTP_ARMS)
def test_plugin_with_mtp_decodes_like_sglang_with_mtp_without_hisparse(data, arm):
    assert_decodes_like_baseline(data, arm, baseline="a+mtp")


@pytest.mark.parametrize("arm", PLUGIN_MTP_ARMS)
def test_plugin_with_mtp_decodes_like_sglang_without_speculation(data, arm):
    if ACCEPT_LEN:
        pytest.skip("with simulated acceptance the outputs are not the target's own greedy ones")
    assert_decodes_like_baseline(data, arm, kv_checked=False, baseline="a")


def test_every_mtp_arm_verified_with_the_accept_length_asked_for(data):
    for arm in ("a+mtp",) + PLUGIN_MTP_ARMS:
        spec = data["arms"][arm]["correctness"].get("speculative")
        assert spec and spec["verify_steps"] > 0, f"arm {arm}: no speculative verify steps recorded: {spec}"
        if ACCEPT_LEN:
            assert spec["accept_length"] == pytest.approx(ACCEPT_LEN), f"arm {arm}: {spec}"


def test_a_corrupting_kernel_build_with_mtp_is_rejected(data):
    if not DX:
        pytest.skip("arm dx+mtp was not asked for (HISPARSE_E2E_MTP_DX=1)")
    kv = kv_check_of(data, "dx+mtp")
    assert kv["mismatches"] > 0, f"the in-server KV check did not see the corrupted rows: {kv}"
    verdict = verdict_against_baseline(data, "dx+mtp", baseline="a+mtp")
    assert not verdict["ok"], f"the judge accepted a kernel build that corrupts the verify's rows: {verdict}"
