"""The GPU harness's chaos and hostpool phases (benchmarks/e2e/chaos.py, hostpool.py) end to end on the CPU,
against the fake SGLang server of tools/e2e-selftest, and proof that their checks can fail.

* a sound mock (arm c co-located, arm pd-c as a prefill and a decode instance): every fault passes, with the
  numbers each check states;
* a mock that leaks the host rows of aborted requests: abort_all fails on the plugin's accounting;
* a mock that never drops a disconnected request: the disconnect fails (the server never gets back to idle);
* the host pool: sized from the requested GiB, its pinning line read, both teardowns timed; refused with a
  typed message where the host cannot hold it; a server that ignores SIGTERM fails the teardown.

The harness runs run in parallel (about 30 s on a 2-core machine); the checks below read their results.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
E2E = REPO / "benchmarks" / "e2e"
sys.path[:0] = [str(E2E), str(REPO / "tools" / "e2e-selftest")]

import chaos  # noqa: E402
import hostpool  # noqa: E402
import scrape  # noqa: E402
import servers  # noqa: E402
from mock_sglang import leftover_children, make_mock_site  # noqa: E402

MOCK = ["--max-total-tokens", "4096", "--health-timeout", "30", "--arm-min-s", "5", "--reserve-s", "5",
        "--plugin-ep", "hisparse=mockplug:register", "--plugin-env", "MOCK_HISPARSE_LOG=1",
        "--plugin-env", "MOCK_ACCOUNTING=1", "--plugin-env", "MOCK_PD_LOGICAL=1"]
CHAOS = ["--phases", "chaos,report", "--chaos-input-len", "256", "--chaos-output-len", "400", "--chaos-inject-after", "20",
         "--chaos-probe-len", "256", "--chaos-probe-out", "300", "--chaos-fresh-len", "64", "--chaos-fresh-out", "16",
         "--chaos-release-s", "5", "--chaos-row-tolerance", "256", "--chaos-fault-min-s", "5", "--chaos-restart-s", "10",
         "--chaos-request-timeout", "30"]
# The host memory's return is not judged here (--hostpool-min-held-gib): on a shared CPU machine, with the other
# runs starting and stopping servers, MemFree/MemAvailable move by more than the mock's 0.26 GiB pool.
HOSTPOOL = ["--arms", "c", "--phases", "hostpool,report", "--plugin-env", "MOCK_HOST_POOL_TOUCH=1",
            "--hostpool-min-rate", "0.01", "--hostpool-margin-gib", "1", "--hostpool-teardown-max-s", "5",
            "--hostpool-min-held-gib", "1000"]
RUNS = {
    # name: (harness arguments, environment of the harness and so of every server)
    "sound_c": (["--arms", "c", *CHAOS, "--chaos-settle-s", "8", "--plugin-args=--enable-metrics"], {}),
    "sound_pd": (["--arms", "pd-c", *CHAOS, "--chaos-settle-s", "8", "--pd-timeout-s", "4",
                  "--pd-decode-max-total-tokens", "4096", "--pd-prefill-max-total-tokens", "16384",
                  "--plugin-args=--enable-metrics"],
                 {"MOCK_PREFILL_S_PER_TOKEN": "2e-5", "MOCK_QUARANTINE_S": "6"}),
    "leak_on_abort": (["--arms", "c", *CHAOS, "--chaos-faults", "abort_all", "--chaos-settle-s", "3",
                       "--plugin-env", "MOCK_LEAK_ON_ABORT=1"], {}),
    "stuck_after_disconnect": (["--arms", "c", *CHAOS, "--chaos-faults", "disconnect", "--chaos-settle-s", "3",
                                "--plugin-env", "MOCK_LEAK_ON_DISCONNECT=1"], {}),
    "hostpool": ([*HOSTPOOL, "--hostpool-gib", "0.25"], {}),
    "hostpool_refused": ([*HOSTPOOL, "--hostpool-gib", "100000"], {}),
    "hostpool_sigterm_ignored": ([*HOSTPOOL, "--hostpool-gib", "0.25", "--hostpool-signals", "SIGTERM",
                                 "--hostpool-teardown-max-s", "2", "--plugin-env", "MOCK_IGNORE_SIGTERM=1"], {}),
}


def free_port_bases(n: int) -> list[int]:
    """n bases of 100 ports none of which answers now (other test sessions may run mock servers too), below the
    ephemeral ports (servers.free_port_bases)."""
    return servers.free_port_bases(n, hostpool.harness_port_offsets(), start=26000)


@pytest.fixture(scope="module")
def runs():
    """Every run of RUNS (own state dir and ports), in parallel: {name: (exit code, results.json, results.md, log)}."""
    td = Path(tempfile.mkdtemp(prefix="e2e_chaos_"))
    site = make_mock_site(td)
    bases = free_port_bases(len(RUNS))

    def one(item):
        i, (name, (argv, env)) = item
        out = td / name
        cmd = [sys.executable, str(E2E / "run_e2e.py"), "--fresh", "--site", str(site), "--python", sys.executable,
               "--state-dir", str(out / "state"), "--out", str(out / "out"), "--port-base", str(bases[i]),
               "--mooncake-syslibs", str(td / "no-syslibs"), *MOCK, *argv]
        full_env = dict(os.environ, MOCK_SKIP_TORCH="1", **env)
        full_env.pop("PYTHONPATH", None)
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=full_env, check=False)
        res = json.loads((out / "out" / "results.json").read_text()) if (out / "out" / "results.json").exists() else {}
        md = (out / "out" / "results.md").read_text() if (out / "out" / "results.md").exists() else ""
        return name, (p.returncode, res, md, p.stdout[-6000:] + p.stderr[-3000:])

    with ThreadPoolExecutor(len(RUNS)) as pool:
        done = dict(pool.map(one, enumerate(RUNS.items())))
    yield done
    assert not leftover_children(str(td)), f"mock scheduler children left behind: {leftover_children(str(td))}"
    shutil.rmtree(td, ignore_errors=True)


def faults_of(res: dict, arm: str) -> dict:
    return {f["fault"]: f for f in res["arms"][arm]["chaos"]["faults"]}


def failed_checks(fault: dict) -> list[str]:
    return [c["check"] for c in fault["checks"] if not c["ok"]]


# ---------------------------------------------------------------------------------------------- chaos
@pytest.mark.parametrize("name, arm", [("sound_c", "c"), ("sound_pd", "pd-c")])
def test_a_sound_server_passes_every_fault(runs, name, arm):
    rc, res, md, log = runs[name]
    assert rc == 0, log
    ch = res["arms"][arm]["chaos"]
    faults = faults_of(res, arm)
    expected = set(chaos.FAULTS) - (set() if arm == "pd-c" else set(chaos.PD_ONLY_FAULTS))
    assert set(faults) == expected, log
    assert ch["verdict"] == "pass", {f: failed_checks(v) for f, v in faults.items()}
    assert ch["baseline"]["ok"] and ch["baseline"]["probe"]["requests_max"] == 1
    assert "gauges" in ch["baseline"]["metrics"], "the mock exports the plugin's metrics with --enable-metrics"
    for f in faults.values():
        assert f["fresh"]["tokens"] == 16 and f["settle"]["idle"]["idle"] and f["settle"]["accounting_ok"]
        assert not f["settle"]["metrics"]["mismatches"], f["settle"]["metrics"]
    assert faults["disconnect"]["requests"] == {"closed": 16, "completed": 16}
    assert faults["disconnect"]["release"]["released"], faults["disconnect"]["release"]
    assert faults["abort_all"]["requests"].get("aborted", 0) >= 1
    assert all(o["message"] == "Aborted" for o in faults["abort_all"]["failed_requests"])
    for bad in ("oversize_prompt", "max_new_tokens"):
        assert faults[bad]["requests"] == {"completed": 32}
        answers = faults[bad]["bad_request"]["answers"]
        assert set(answers) == ({"decode", "prefill"} if arm == "pd-c" else {"server"})
        assert all(a["status"] == 400 for a in answers.values()), answers
    assert faults["oversize_prompt"]["bad_request"]["input_len"] == 65537  # context 65536 > every pool of the mock
    assert "context length" in faults["max_new_tokens"]["bad_request"]["answers"][
        "decode" if arm == "pd-c" else "server"]["message"]
    kill = faults["decode_kill"]
    assert kill["restart"][0]["ok"] and kill["requests"].get("completed", 0) + kill["requests"].get("error", 0) == 32
    assert "## Chaos: faults while requests decode" in md and f"**Arm {arm}: verdict PASS.**" in md
    assert md.count("✗") == 0 and md.count("✓") >= 7 * len(expected)


def test_a_prefill_killed_mid_transfer_fails_only_the_transfers_and_their_rows_come_back(runs):
    _, res, _, _ = runs["sound_pd"]
    f = faults_of(res, "pd-c")["prefill_kill"]
    assert f["ok"], failed_checks(f)
    failed = f["failed_requests"]
    # the decode gave the prefill up (its heartbeat) or the transfer timed out (--pd-timeout-s), as SGLang says
    assert failed and all(("Lost connection with prefill instance" in o["message"] or "KVPoll.WaitingForInput" in o["message"])
                          and o["finish_status"] == 500 for o in failed), failed[:2]
    # the failed transfers' rows were quarantined (MOCK_QUARANTINE_S=6): the first probe saw them, a later one not
    attempts = f["settle"]["attempts"]
    assert len(attempts) >= 2 and attempts[0]["quarantined"] > 0 and attempts[-1]["quarantined"] == 0, attempts
    assert f["restart"][0]["server"] == "pd-c-prefill" and f["restart"][0]["ok"]


def test_a_mock_that_leaks_host_rows_after_abort_fails_the_accounting_check(runs):
    rc, res, md, log = runs["leak_on_abort"]
    assert rc == 0, log  # the harness ran; the verdict is in the results
    ch = res["arms"]["c"]["chaos"]
    f = faults_of(res, "c")["abort_all"]
    assert ch["verdict"] == "fail" and not f["ok"]
    assert failed_checks(f) == [("the plugin's accounting back at its baseline (probe alone: host/device rows, "
                                 "quarantine, requests)")], failed_checks(f)
    last = f["settle"]["attempts"][-1]
    assert last["host_rows_excess"] >= 32 * 256, last  # every aborted request's rows stayed in use
    assert "**Arm c: verdict FAIL.**" in md and "✗ FAIL the plugin's accounting back" in md


def test_a_mock_that_never_drops_disconnected_requests_never_returns_to_baseline(runs):
    _, res, _, _ = runs["stuck_after_disconnect"]
    f = faults_of(res, "c")["disconnect"]
    assert res["arms"]["c"]["chaos"]["verdict"] == "fail"
    failed = failed_checks(f)
    assert "the server dropped the closed requests while the others still decoded" in failed
    assert any(c.startswith("every server idle again") for c in failed)
    assert any(c.startswith("the plugin's accounting back") for c in failed)
    assert f["settle"]["idle"]["loads"]["server"]["num_running_reqs"] == 16, f["settle"]["idle"]
    assert f["settle"]["attempts"][-1]["requests_max"] == 17  # the probe and 16 phantoms


# ---------------------------------------------------------------------------------------------- hostpool
def test_the_host_pool_is_sized_read_and_torn_down_by_both_signals(runs):
    rc, res, md, log = runs["hostpool"]
    assert rc == 0, log
    hp = res["meta"]["hostpool"]
    plan = hp["plan"]
    assert plan["ratio"] == 15 and plan["host_rows"] == (4096 * 15 // 64 + 1) * 64 and plan["predicted_gib"] >= 0.25
    assert [s["signal"] for s in hp["starts"]] == ["SIGTERM", "SIGKILL"]
    for s in hp["starts"]:
        assert s["pool"]["rows"] == plan["host_rows"] and s["pool"]["rate_gib_s"] > 0 and s["pool"]["threads"] == 1
        td = s["teardown"]
        assert td["main_exit_s"] is not None and td["group_gone_s"] < 5 and td["port_free_s"] is not None, td
        assert td["escalated_to_sigkill_at_s"] is None and s["ok"], s.get("failures")
    assert hp["verdict"] == "pass"
    assert "## Host pool: start-up and teardown" in md and "host_to_device_ratio 15" in md


def test_a_host_pool_the_host_cannot_hold_is_refused_with_a_typed_message(runs):
    rc, res, md, _ = runs["hostpool_refused"]
    hp = res["meta"]["hostpool"]
    assert rc == 2 and hp["verdict"] == "refused" and hp["starts"] == []
    assert hp["refused"]["type"] == "InsufficientHostMemory" and "--hostpool-gib max" in hp["refused"]["message"]
    assert "**Refused (InsufficientHostMemory)**" in md


def test_a_server_that_ignores_sigterm_fails_the_teardown(runs):
    _, res, _, _ = runs["hostpool_sigterm_ignored"]
    hp = res["meta"]["hostpool"]
    (start,) = hp["starts"]
    assert hp["verdict"] == "fail" and not start["ok"]
    assert start["teardown"]["escalated_to_sigkill_at_s"] is not None
    assert any("not back after" in f for f in start["failures"]), start["failures"]


# ---------------------------------------------------------------------------------------------- pure functions
def test_plan_pool_sizes_100_gib_on_the_gpu_defaults_and_refuses_beyond_the_host():
    layers, row = hostpool.model_rows(REPO / "benchmarks/models/tiny-dsv32", "bfloat16")
    assert (layers, row) == (4, 1152)
    plan = hostpool.plan_pool(100.0, 131072, layers, row, usable=200 * 2**30)
    assert plan["ratio"] == 178 and 100 <= plan["predicted_gib"] < 100.6, plan
    assert "host_to_device_ratio 178" in plan["sentence"]
    beyond = hostpool.plan_pool(100.0, 4096, layers, row, usable=200 * 2**30)
    assert beyond["refused"]["type"] == "SizeBeyondRatioLimit", beyond  # 4096 tokens x 1024 is 18 GiB: not started
    small = hostpool.plan_pool(100.0, 131072, layers, row, usable=90 * 2**30)
    assert small["refused"]["type"] == "InsufficientHostMemory" and small["largest_ratio_that_fits"] == 159
    assert hostpool.plan_pool("max", 131072, layers, row, usable=90 * 2**30)["ratio"] == 159


def test_the_ready_line_regex_reads_the_plugins_own_format():
    src = (REPO / "src/hisparse_sglang/memory/host_pool.py").read_text()
    fmt = src[src.index('"HiSparse host pool: %.2f GiB ready'):].split("\n")[0].strip().rstrip(",").strip('"')
    line = fmt % (100.12, 8.4, 11.9, 2.1, ", pinned in 6.3 s", 16)
    assert hostpool.parse_pool_log(line) == {"ready_gib": 100.12, "ready_s": 8.4, "rate_gib_s": 11.9, "touched_s": 2.1,
                                             "pinned_s": 6.3, "threads": 16}


PROBE_LINES = """\
HiSparse: hit rate n/a, moved 0.0 MiB, resident 1, offloaded 0 (promoting 0), demotions 0.0/min, promotions 0.0/min, device rows 6208/131072, host rows 6208/1048576 (quarantined 0), switch work max 0.00 ms/step, step host work 0.017 ms (max 0.20)
HiSparse: hit rate n/a, moved 0.0 MiB, resident 1, offloaded 0 (promoting 0), demotions 0.0/min, promotions 0.0/min, device rows 6400/131072, host rows 6400/1048576 (quarantined 0), switch work max 0.00 ms/step, step host work 0.011 ms (max 0.14)
HiSparse: hit rate n/a, moved 0.0 MiB, resident 0, offloaded 0 (promoting 0), demotions 0.0/min, promotions 0.0/min, device rows 0/131072, host rows 0/1048576 (quarantined 0), switch work max 0.00 ms/step, step host work 0.009 ms (max 0.02)
"""


def test_probe_figures_leave_out_the_line_of_the_server_going_idle():
    """The plugin logs one more line as the probe leaves (no request, no rows): the baseline probe of the
    first GPU chaos run (H100, 2026-11-26) failed on it ("counted as 0..1 requests"). A line without a
    request but with rows in use is a leak and still counts."""
    lines = scrape.parse_log_lines(PROBE_LINES)
    figures = chaos.probe_figures(lines)
    assert (figures["lines"], figures["idle_lines"], figures["requests_min"], figures["requests_max"]) == (3, 1, 1, 1)
    assert figures["host_rows_used_max"] == 6400
    leaked = scrape.parse_log_lines(PROBE_LINES.replace("device rows 0/131072, host rows 0/", "device rows 0/131072, host rows 64/"))
    assert chaos.probe_figures(leaked)["requests_min"] == 0


def test_compare_probe_names_each_leak():
    base = {"lines": 3, "tokens": 300, "requests_min": 1, "requests_max": 1, "host_rows_used_max": 576,
            "device_rows_used_max": 4160, "quarantined_max": 0}
    ok, _, nums = chaos.compare_probe(dict(base, host_rows_used_max=640), base, 128)
    assert ok and nums["host_rows_excess"] == 64
    ok, why, _ = chaos.compare_probe(dict(base, host_rows_used_max=10816, quarantined_max=320, requests_max=2), base, 128)
    assert not ok and "+10240 > 128" in why and "quarantined rows 320 vs 0" in why and "1..2 requests" in why
    ok, why, _ = chaos.compare_probe({"lines": 0, "tokens": 300}, base, 128)
    assert not ok and "no HiSparse line" in why
    assert chaos.verdict({"baseline": {"ok": True}, "faults": [{"ok": True}, {"skipped": "deadline"}],
                          "skipped_rest": "deadline"}) == "incomplete"
    assert chaos.verdict({"baseline": {"ok": True}, "faults": [{"ok": True}, {"ok": False}]}) == "fail"
