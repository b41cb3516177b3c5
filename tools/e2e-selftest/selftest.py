#!/usr/bin/env python3
"""CPU-only checks of the e2e harness (no GPU, no network).

    python3 tools/e2e-selftest/selftest.py                  # unit checks + mock-server end-to-end run
    python3 tools/e2e-selftest/selftest.py --torch-python /work/sgl-venv/bin/python
        # the mock server runs under a python that has torch, so the weight-init fixture really runs
    python3 tools/e2e-selftest/selftest.py --server-args-python /work/sgl-venv/bin/python
        # also parse every arm's server argv with the real sglang.srt.server_args (fake CUDA)

The mock server (mock_launch_server.py, written by mock_sglang.py to a temp dir as a fake `sglang`
package that shadows the real one via --site) speaks the subset of SGLang 0.5.17's HTTP API that the
harness (benchmarks/e2e/run_e2e.py) uses (/health, /generate incl. streaming and logprobs, /v1/loads,
/abort_request, /server_info), prints SGLang-style log lines, discovers and runs `sglang.srt.plugins`
entry points like sglang.srt.plugins.load_plugins, and spawns a child process like the scheduler, so
server start/stop by process group is exercised. The bundle builder's checks (selftest_bundle.py) test
tools/gpu-bundle/.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import types
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
E2E = REPO / "benchmarks" / "e2e"  # the harness under test
# This folder (the mock), the harness's modules and the bundle builder's (selftest_bundle checks them).
sys.path[:0] = [str(HERE), str(E2E), str(REPO / "tools" / "gpu-bundle")]
import arms  # noqa: E402
import bench_serving_phase  # noqa: E402
import client  # noqa: E402
import judge  # noqa: E402
import logs  # noqa: E402
import lowload  # noqa: E402
import options  # noqa: E402
import pd  # noqa: E402
import report  # noqa: E402
import selftest_bundle  # noqa: E402
import stats  # noqa: E402
import storm  # noqa: E402
from mock_sglang import leftover_children, make_mock_site  # noqa: E402

FAILS: list[str] = []
PASSES = 0


def check(cond, what: str) -> None:
    global PASSES
    if cond:
        PASSES += 1
    else:
        FAILS.append(what)
        print(f"FAIL: {what}", flush=True)


def check_rejected(argv: list[str]) -> None:
    """options.parse_args must reject `argv` (argparse exits; its message is silenced)."""
    try:
        with open(os.devnull, "w") as dn:
            old, sys.stderr = sys.stderr, dn
            try:
                options.parse_args(argv)
            finally:
                sys.stderr = old
        check(False, f"parse_args({argv}) should fail")
    except SystemExit:
        check(True, "")


# --------------------------------------------------------------------------------------------
def unit_checks() -> None:
    dec = ("[2026-11-22 10:00:01] Decode batch, #running-req: 7, #token: 114688, token usage: 0.88, "
           "cuda graph: True, gen throughput (token/s): 5612.31, #queue-req: 57,\n"
           "[2026-11-22 10:00:02 TP0] Decode batch [1234], #running-req: 40, #gpu token: 2048, gpu token usage: 0.31, "
           "#cpu token: 655360, cpu token usage: 0.62, cuda graph: False, gen throughput (token/s): 11800.00, #queue-req: 0")
    pre = ("[2026-11-22 10:00:00] Prefill batch, #new-seq: 1, #new-token: 8192, #cached-token: 0, token usage: 0.06, "
           "#running-req: 6, #queue-req: 58, #pending-token: 0, cuda graph: False, input throughput (token/s): 90000.00")
    d = logs.parse_decode_lines(dec)
    check(len(d) == 2, "two decode lines parsed")
    check(d[0] == {"running": 7, "gen_tput": 5612.31, "queue": 57, "token_usage": 0.88, "cuda_graph": True}, f"decode line 1: {d[0]}")
    check(d[1]["running"] == 40 and d[1]["gpu_token_usage"] == 0.31 and d[1]["cpu_token_usage"] == 0.62
          and d[1]["cuda_graph"] is False and "token_usage" not in d[1], f"hisparse decode line: {d[1]}")
    p = logs.parse_prefill_lines(pre)
    check(p == [{"new_seq": 1, "new_token": 8192, "running": 6, "queue": 58}], f"prefill line: {p}")
    extra = ("\n[hisparse-e2e-fixture] pid=12 weights mode=scaled seed=1234 params_initialised=40 params=40 "
             "elements=480000000 fingerprint=1.234000000e+02/4.560000000e+05\n"
             "[hisparse-e2e-fixture] pid=12 visible sglang.srt.plugins entry points: ['hisparse=hisparse_sglang.x:register']\n"
             "[2026-11-22] max_total_num_tokens=131072, chunked_prefill_size=8192\n"
             "KV cache pool is full. Retract requests. #retracted_reqs: 3, #new_tokens_gained: 10\n"
             "Failed to load plugin hisparse from group sglang.srt.plugins\n"
             "Dense attention kv len threshold is manually set to 0 for DSA.\n")
    s = logs.summarize_log(pre + "\n" + dec + extra)
    check(s["max_running"] == 40 and s["max_decode_running"] == 40, f"max running {s['max_running']}")
    check(s["gen_tput_median"] == (5612.31 + 11800.0) / 2, "median gen throughput")
    check(s["cuda_graph_fraction"] == 0.5, "cuda graph fraction")
    check(s["weight_fingerprints"] == ["1.234000000e+02/4.560000000e+05"], f"fingerprint {s['weight_fingerprints']}")
    check(s["max_total_num_tokens"] == 131072 and s["retracted_reqs"] == 3, "max_total_num_tokens / retractions")
    check(s["plugin_failures"] == ["load plugin: hisparse"], f"plugin failures {s['plugin_failures']}")
    check(s["dense_attn_threshold"] == 0, "dense threshold")
    check(s["visible_plugins"] == ["['hisparse=hisparse_sglang.x:register']"], f"visible {s['visible_plugins']}")
    check(logs.summarize_log("")["max_running"] is None, "empty log")

    check(stats.detect_cycle([5, 1, 2, 3, 1, 2, 3, 1, 2, 3]) == 3, "cycle 3")
    check(stats.detect_cycle([7] * 10) == 1, "cycle 1")
    check(stats.detect_cycle(list(range(20))) is None, "no cycle")

    meta = {"output_token_logprobs": [[-0.5, 11, None], [-1.25, 12, None]],
            "output_top_logprobs": [[[-0.5, 11, None], [-2.0, 3, None]], None]}
    lps, top = client.extract_logprobs(meta)
    check(lps == [-0.5, -1.25] and top == [[[11, -0.5], [3, -2.0]], None], f"extract_logprobs {lps} {top}")

    ref = {"prompts": [{"id": "p1", "output_ids": [1, 2, 3, 4], "logprobs": [-1.0, -1.0, -1.0, -1.0],
                        "top": [[[1, -1.0], [9, -2.0]]] * 4},
                       {"id": "p2", "output_ids": [5, 6], "logprobs": [-0.1, -0.2], "top": []}]}
    oth = {"prompts": [{"id": "p1", "output_ids": [1, 2, 7, 4], "logprobs": [-1.0, -1.001, -3.0, -1.0],
                        "top": [[[1, -1.0], [9, -2.5]]] * 4},
                       {"id": "p2", "output_ids": [5, 6], "logprobs": [-0.1, -0.2], "top": []}]}
    c = stats.compare_outputs(ref, oth)
    check(c["prompts_compared"] == 2 and c["prompts_identical"] == 1 and c["mismatched_tokens"] == 1, f"compare counts {c}")
    r1 = c["per_prompt"][0]
    check(r1["first_mismatch"] == 2 and abs(r1["max_abs_dlogprob"] - 0.001) < 1e-9 and abs(r1["max_abs_dtop5"] - 0.5) < 1e-9,
          f"compare row {r1}")
    c2 = stats.compare_outputs(ref, {"prompts": [{"id": "p1", "output_ids": [1, 2], "logprobs": [-1, -1], "top": []}]})
    check(c2["per_prompt"][0]["first_mismatch"] == 2 and c2["per_prompt"][1]["status"] == "missing", "length mismatch / missing")

    check(options.parse_levels("1,8, 32,max") == [1, 8, 32, "max"], "levels")
    for bad in ("0", "x", ""):
        try:
            options.parse_levels(bad)
            check(False, f"parse_levels({bad!r}) should fail")
        except ValueError:
            check(True, "")
    check(options.parse_csv("c,a,a", arms.ALL_ARMS, "arms") == ["a", "c"], "parse_csv order/dedup")
    check(arms.parse_env_assignments(["A=1", "B=x=y"]) == {"A": "1", "B": "x=y"}, "env assignments")
    check(arms.read_plugin_entry_point(REPO / "pyproject.toml")[0] == "hisparse", "entry point from pyproject")
    check(client.make_prompt(1, 5, 100) == client.make_prompt(1, 5, 100) and all(2 <= x < 100 for x in client.make_prompt(2, 1000, 100)),
          "prompts deterministic and in range")

    # argument handling
    a = options.parse_args(["--arms", "b,a", "--phases", "correctness,report", "--tp-levels", "1,max",
                      "--plugin-env", "FOO=1", "--plugin-args", "--foo 'a b'", "--state-dir", "/tmp/x"])
    check(a.arms == ["a", "b"] and a.phases == ["correctness", "report"] and a.tp_levels == [1, "max"], "parse_args lists")
    a = options.parse_args(["--state-dir", "/tmp/x"])
    check(a.arms == ["a", "b", "c"] and "storm" not in a.phases and "throughput" in a.phases,
          f"defaults: arms {a.arms}, phases {a.phases} (d and storm are opt-in)")
    a = options.parse_args(["--arms", "d,a,c,b", "--phases", "report,storm,throughput", "--state-dir", "/tmp/x"])
    check(a.arms == ["a", "b", "c", "d"] and a.phases == ["throughput", "storm", "report"], f"arm d / storm order {a.phases}")
    for bad in (["--arms", "e"], ["--phases", "warmup"], ["--tp-levels", "0"], ["--plugin-env", "NOEQ"],
                ["--hisparse-config", "{bad json"], ["--hisparse-config", "[1, 2]"], ["--plugin-ep", "nocolon"],
                ["--corr-lens", "65536"], ["--arms", "c,d", "--plugin-no-enable-hisparse"],
                ["--storm-after-tokens", "600"], ["--storm-after-tokens", "20"], ["--storm-requests", "0"],
                ["--storm-input-len", "65000"]):
        check_rejected(bad)
    # the chaos and hostpool phases (run end to end against this mock by tests/test_e2e_chaos.py)
    for bad in (["--chaos-faults", "meteor"], ["--chaos-inject-after", "5000"], ["--chaos-requests", "1"],
                ["--chaos-input-len", "65000"], ["--hostpool-gib", "0"], ["--hostpool-signals", "SIGHUP"]):
        check_rejected(bad)
    a = options.parse_args(["--phases", "report,hostpool,chaos", "--chaos-faults", "decode_kill,disconnect",
                            "--hostpool-gib", "max", "--state-dir", "/tmp/x"])
    check(a.phases == ["chaos", "hostpool", "report"] and a.chaos_faults == ["disconnect", "decode_kill"]
          and a.hostpool_gib == "max" and a.hostpool_signals == ["SIGTERM", "SIGKILL"] and a.chaos_requests == 32,
          f"chaos / hostpool options {a.phases} {a.chaos_faults} {a.hostpool_gib}")

    # arm specs: JSON without spaces, plugin arm adds src + dist-info dir + env + args
    with tempfile.TemporaryDirectory() as td:
        td = Path(td)
        a = options.parse_args(["--state-dir", str(td), "--plugin-env", "HISPARSE_X=1", "--plugin-args", "--foo bar",
                          "--hisparse-config", '{"top_k": 2048, "device_buffer_size": 4096, "host_to_device_ratio": 8}'])
        common, plug, ep = arms.prepare_pyext(td, a)
        specs = {arm: arms.arm_spec(arm, a, {"X": "1"}, common, plug, 30000) for arm in arms.COLOCATED_ARMS}
        ca, cb, cc, cd = (specs[x][0] for x in arms.COLOCATED_ARMS)
        check("--enable-hisparse" not in ca and all("--enable-hisparse" in c for c in (cb, cc, cd)), "hisparse flags")
        check(cb[cb.index("--hisparse-config") + 1] == '{"top_k":2048,"device_buffer_size":4096,"host_to_device_ratio":8}'
              and cc[cc.index("--hisparse-config") + 1] == cb[cb.index("--hisparse-config") + 1],
              "hisparse JSON without spaces, same in arms b and c")
        check(cd[cd.index("--hisparse-config") + 1]
              == '{"top_k":2048,"device_buffer_size":4096,"host_to_device_ratio":8,"resident_first":false}',
              f"arm d adds resident_first false: {cd[cd.index('--hisparse-config') + 1]}")
        check(cc[-2:] == ["--foo", "bar"] and cd[-2:] == ["--foo", "bar"] and specs["c"][1]["HISPARSE_X"] == "1"
              and specs["d"][1]["HISPARSE_X"] == "1" and "HISPARSE_X" not in specs["b"][1],
              "plugin args/env in arms c and d only")
        strip = lambda cmd: [x for x in cmd if not x.startswith("{")]  # noqa: E731
        check(strip(cc) == strip(cd) and specs["c"][1] == specs["d"][1], "arm d = arm c except the hisparse config")
        pp = specs["c"][1]["PYTHONPATH"].split(os.pathsep)
        check(pp[0] == str(plug) and pp[1] == str(REPO / "src") and str(common) in specs["a"][1]["PYTHONPATH"]
              and str(plug) not in specs["b"][1]["PYTHONPATH"], f"PYTHONPATH of arm c: {pp}")
        check(arms.hisparse_config_json('{"resident_first": true, "top_k": 1}', "d") == '{"resident_first":false,"top_k":1}',
              "arm d overrides a resident_first of the common config")
        for flag in ("--attention-backend", "--dsa-prefill-backend", "--dsa-decode-backend", "--kv-cache-dtype",
                     "--load-format", "--skip-tokenizer-init", "--disable-radix-cache", "--max-total-tokens",
                     "--mem-fraction-static", "--context-length"):
            check(all(flag in specs[x][0] for x in arms.COLOCATED_ARMS), f"{flag} in every arm")
        check("--disable-cuda-graph" not in ca, "CUDA graph on by default")
        pd_checks(a, common, plug)
        # entry points are discoverable from the generated dist-infos (fresh interpreter)
        code = ("import importlib.metadata as m, json; "
                "print(json.dumps(sorted((e.name, e.value, e.dist.name) for e in m.entry_points(group='sglang.srt.plugins'))))")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(plug), str(common)]))
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True).stdout
        eps = json.loads(out)
        check(["hisparse", "hisparse_sglang.integration.sglang.plugin:register", "hisparse-sglang"] in [list(x) for x in eps]
              and any(x[0] == "hisparse_e2e_weight_init" for x in eps), f"entry points discoverable: {eps}")
        # markdown renders with partial data
        md = report.render_markdown({"meta": {}, "arms": {"a": {"status": "failed", "error": "boom"}}, "compare": {}})
        check("boom" in md and "| status | failed |" in md, "markdown with a failed arm")
        cells = [report.kv_check_cell({"log": {"kv_check": kv}}) for kv in (
            {"rows": 5, "mismatches": 0, "checks": 2, "given_query_rows": 3}, {"rows": 5, "mismatches": 1, "checks": 2})]
        check(cells == ["5 / 0 (2), 3 query rows of device rows", "5 / 1 (2)"], f"KV check cells: {cells}")
    storm_checks()
    lowload_checks()
    serving_checks()
    judge_checks()
    try:  # it imports the harness modules by name
        import profile_decode
        check(True, "")
    except ImportError as e:
        check(False, f"profile_decode.py does not import: {e}")
    else:
        # the GPU's idle time per step: kernels a [0, 10) with b inside it, c [12, 20), d [20, 25), a [30, 31)
        # over two steps: span 31, busy 24, gaps d -> a (5) and a -> c (2)
        idle = profile_decode.gpu_idle([(30, 31, "a"), (0, 10, "a"), (2, 5, "b"), (12, 20, "c"), (20, 25, "d")], 2, 5)
        check(idle["span_us_per_step"] == 15.5 and idle["busy_us_per_step"] == 12.0 and idle["idle_us_per_step"] == 3.5
              and [(g["before"], g["after"], g["us_per_step"]) for g in idle["gaps"]] == [("d", "a", 2.5), ("a", "c", 1.0)],
              f"profile: the GPU's idle time and its gaps: {idle}")
    paired_checks()
    print(f"unit checks: {PASSES} passed, {len(FAILS)} failed", flush=True)


def paired_checks() -> None:
    """paired_decode.summarize: ratios taken per round (the CPU of a round slows both arms alike), a failed
    request leaves its round out of that arm's figures only; --ratios picks the pairs; the table and the rounds."""
    import paired_decode
    speeds = [1.0, 2.1, 1.3, 1.7]  # the CPU / minute of each round
    rounds = [{"round": i, "cpu": 2 + i, "order": ["a", "c"], "tpot_ms": {"a": {"1": 1.5 * f}, "c": {"1": 1.5 * f * 1.08}}}
              for i, f in enumerate(speeds)]
    rounds.append({"round": 4, "cpu": 6, "order": ["c", "a"], "tpot_ms": {"a": {"1": 1.5}, "c": {"1": "HTTP 500"}}})
    summary = paired_decode.summarize(["a", "c"], [1], rounds, within=0.05)["1"]
    ratio = summary["ratio"]["c / a"]
    check(abs(ratio["median"] - 1.08) < 1e-3 and ratio["max"] - ratio["min"] < 1e-3 and ratio["n"] == 4
          and ratio["within"] == 0 and summary["tpot_ms"]["a"]["n"] == 5 and summary["tpot_ms"]["c"]["n"] == 4,
          f"paired ratios per round: {summary}")
    wide = paired_decode.summarize(["a", "c"], [1], rounds, within=0.1)["1"]["ratio"]["c / a"]["within"]
    check(wide == 4, f"paired: rounds within 10 %: {wide}")
    inverse = paired_decode.summarize(["a", "c"], [1], rounds, 0.05, paired_decode.parse_ratios("a/c", ["a", "c"]))
    check(list(inverse["1"]["ratio"]) == ["a / c"] and abs(inverse["1"]["ratio"]["a / c"]["median"] - 1 / 1.08) < 1e-3,
          f"paired --ratios a/c: {inverse}")
    fits = [paired_decode.another_round_fits(e, r, m) for e, r, m in
            ((500, [], 100), (70, [20, 30], 100), (71, [20, 30], 100), (10**6, [50], 0))]
    check(fits == [True, True, False, True], f"paired --max-seconds: {fits}")
    run = {"variants": ["a", "c"], "levels": [1], "meta": {"within": 0.05}, "rounds": rounds[:2]}
    second = [dict(r, round=k) for k, r in enumerate(rounds[2:])]  # a second run numbers its rounds from 0
    pooled = paired_decode.pool_runs([run, run | {"rounds": second, "meta": {"within": 0.1}}])
    check([r["round"] for r in pooled["rounds"]] == [0, 1, 2, 3, 4] and pooled["meta"]["within"] == 0.05
          and [r["cpu"] for r in pooled["rounds"]] == [r["cpu"] for r in rounds],
          f"paired --from-json twice: the rounds pooled: {pooled}")
    try:
        paired_decode.pool_runs([run, run | {"variants": ["a", "b"]}])
        check(False, "paired --from-json pooled runs of other arms")
    except ValueError:
        check(True, "")
    try:
        paired_decode.parse_ratios("c/b", ["a", "c"])
        check(False, "paired --ratios c/b with no arm b was accepted")
    except ValueError:
        check(True, "")
    # one level through phases.run_level: the mean of the requests' times per token, or the first error
    class Endpoint:
        def __init__(self, outs):
            self.outs = iter(outs)

        def generate_stream(self, ids, out_len, timeout, trace=False):
            return next(self.outs)

    target = types.SimpleNamespace(log_path=Path("/nonexistent/server.log"))
    target.endpoint = Endpoint([{"tpot_s": 0.001, "tokens": 4, "e2e_s": 1.0}, {"tpot_s": 0.002, "tokens": 4, "e2e_s": 1.0}])
    level = paired_decode.decode_level(target, [[1], [2]], 4)
    target.endpoint = Endpoint([{"tpot_s": 0.001, "tokens": 4, "e2e_s": 1.0}, {"error": "HTTP 500: boom"}])
    failed = paired_decode.decode_level(target, [[1], [2]], 4)
    check(level == {"tpot_ms": 1.5} and failed == {"error": "HTTP 500: boom"},
          f"paired: a level's mean time per token and its error: {level} {failed}")
    # --steady: the window in which both requests decode is [1.0, 2.0] s (the second's first token, the first's
    # last); inside it request 0 brought 4 -> 14 tokens (0.1 s each), request 1 2 -> 7 (0.2 s each), where their
    # whole requests took 0.3 and 0.5 s per token; each in one chunk of 1 s (10 and 5 tokens)
    steady_outs = [{"tpot_s": 0.3, "tokens": 20, "e2e_s": 3.0, "arrivals": [(0.5, 1), (1.0, 4), (2.0, 14)]},
                   {"tpot_s": 0.5, "tokens": 20, "e2e_s": 3.0, "arrivals": [(1.0, 2), (2.0, 7), (3.0, 20)]}]
    target.endpoint = Endpoint(steady_outs)
    steady = paired_decode.decode_level(target, [[1], [2]], 20, steady=True)
    target.endpoint = Endpoint([dict(steady_outs[0], arrivals=[(0.5, 1), (0.9, 4)]), steady_outs[1]])
    apart = paired_decode.decode_level(target, [[1], [2]], 20, steady=True)
    # every chunk's arrival and the window are kept on the level's clock (run_level's start: the times shift alike)
    kept = steady.pop("arrivals", None) or {}
    shift = kept.get("steady_window", [0.0])[0] - 1.0
    got = [x for request in kept.get("requests") or [] for x in request]
    want = [(t + shift, n) for o in steady_outs for t, n in o["arrivals"]]
    on_level_clock = len(got) == len(want) and all(abs(g[0] - w[0]) < 1e-4 and g[1] == w[1] for g, w in zip(got, want))
    check(steady == {"tpot_ms": 400.0, "steady_ms": 150.0, "chunk_ms": 1000.0, "tokens_per_chunk": 7.5}
          and on_level_clock and abs(kept["steady_window"][1] - (2.0 + shift)) < 1e-4
          and apart["steady_ms"] == "no window in which every request decoded" and apart["arrivals"]["steady_window"] is None,
          f"paired --steady: the mean per-request time per token inside the common window: {steady} {apart}")
    steady_rounds = [dict(r, steady_ms={"a": {"1": 1.0}, "c": {"1": 1.02}}) for r in rounds]
    steady_summary = paired_decode.summarize(["a", "c"], [1], steady_rounds, 0.05, metric="steady_ms")["1"]
    check(abs(steady_summary["ratio"]["c / a"]["median"] - 1.02) < 1e-9
          and steady_summary["ratio"]["c / a"]["within"] == 5, f"paired --steady summary: {steady_summary}")
    text = paired_decode.render(["a", "c"], {"1": summary}, {"rounds": 5, "cpus": [2, 3], "park_cpu": 1,
                                                            "client_cpu": 0, "input_len": 8, "output_len": 4,
                                                            "within": 0.05}, rounds,
                                {"a": None, "c": {"lines": 9, "resident_max": 2, "offloaded_max": 1,
                                                  "hit_rate_pct_min": 58.4, "step_host_ms_median": 0.016,
                                                  "switch_work_max_ms": 4.6}})
    check("**1.080**" in text and "0 of 4" in text and "| 4 | 6 | c, a | 1.5 | HTTP 500 |" in text
          and "c, the plugin's log lines (9): at most 2 requests resident and 1 offloaded" in text
          and "lowest LRU hit rate 58.4 %" in text and "a, the plugin" not in text,
          f"paired table, plugin lines and rounds: {text}")
    both = paired_decode.render(["a", "c"], {"1": summary}, {"rounds": 5, "cpus": [2, 3], "park_cpu": 1,
                                                            "client_cpu": 0, "input_len": 8, "output_len": 4,
                                                            "within": 0.05}, steady={"1": steady_summary})
    check("**1.080**" in both and "While every request of the level decodes" in both and "**1.020**" in both
          and "While every request" not in text, f"paired table with --steady: {both}")


def pd_checks(a, common: Path, plug: Path) -> None:
    """A PD arm's two servers: the prefill takes arm a's flags, the decode arm c's (pd-c) or b's (pd-b), each
    with its pool and the PD flags; the client's routing fields."""
    env0 = {"X": "1", "PATH": "/bin"}
    pd_env0 = dict(env0, LD_LIBRARY_PATH="/tmp/mooncake-sys/lib", MC_FORCE_TCP="1", SGLANG_HOST_IP="127.0.0.1")
    for arm, decode_arm in (("pd-c", "c"), ("pd-b", "b")):
        prefill, decode = arms.arm_servers(arm, a, env0, pd_env0, common, plug)
        p, d = prefill.cmd, decode.cmd
        port = arms.arm_port(a, arm)
        check(prefill.role == "prefill" and decode.role == "decode" and prefill.port == port and decode.port == port + 1
              and p[p.index("--disaggregation-bootstrap-port") + 1] == str(port + 2)
              and p[p.index("--disaggregation-mode") + 1] == "prefill" and d[d.index("--disaggregation-mode") + 1] == "decode"
              and p[p.index("--disaggregation-transfer-backend") + 1] == "mooncake_tcp" == d[d.index("--disaggregation-transfer-backend") + 1],
              f"{arm}: PD flags and ports {p} {d}")
        check("--enable-hisparse" not in p and "--enable-hisparse" in d and str(plug) not in prefill.env["PYTHONPATH"]
              and (str(plug) in decode.env["PYTHONPATH"]) == (decode_arm == "c")
              and d[d.index("--max-total-tokens") + 1] == str(a.pd_decode_max_total_tokens)
              and p[p.index("--max-total-tokens") + 1] == str(a.pd_prefill_max_total_tokens)
              and d[d.index("--mem-fraction-static") + 1] == str(a.pd_mem_fraction_static),
              f"{arm}: prefill without HiSparse or plugin, decode as arm {decode_arm}, own pools")
        check(all(s.env["LD_LIBRARY_PATH"] == "/tmp/mooncake-sys/lib" and s.env["HISPARSE_E2E_PD_TRACE"] == "1"
                  and s.env["SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT"] == str(int(a.pd_timeout_s)) for s in (prefill, decode)),
              f"{arm}: PD environment on both servers")
    check([s.role for s in arms.arm_servers("a", a, env0, pd_env0, common, plug)] == [""]
          and "LD_LIBRARY_PATH" not in arms.arm_servers("a", a, env0, pd_env0, common, plug)[0].env, "arm a: one server, no PD env")
    pair = client.PDPair(31040, 31041, 31042)
    r1, r2 = pair.routed({"input_ids": [1]}, None), pair.routed({"input_ids": [1]}, "x")
    check(r1["bootstrap_host"] == "127.0.0.1" and r1["bootstrap_port"] == 31042 and 0 <= r1["bootstrap_room"] < 2**63
          and r1["bootstrap_room"] != r2["bootstrap_room"] and r1["rid"] == f"pd-{r1['bootstrap_room']}" and r2["rid"] == "x",
          f"PD routing fields {r1} {r2}")
    check(options.parse_args(["--arms", "a,pd-c", "--state-dir", "/tmp/x"]).preflight_mooncake
          and not options.parse_args(["--arms", "a,c", "--state-dir", "/tmp/x"]).preflight_mooncake,
          "the Mooncake preflight is on with a PD arm")
    check_rejected(["--arms", "pd-c", "--pd-decode-max-total-tokens", "200000"])


def serving_checks() -> None:
    """The serving phase's options and what it changes in the servers' flags (the rest: tests/test_bench_serving_phase.py)."""
    a = options.parse_args(["--arms", "a,b,c,d,pd-c", "--phases", "report,serving,throughput", "--state-dir", "/tmp/x"])
    check(a.phases == ["throughput", "serving", "report"] and a.bs_levels == [1, 8, 32] and a.bs_input_len == 16384
          and a.bs_output_len == 1024 and a.bs_prompts_per_level == 2 and a.scrape_metrics and not a.bs_process_per_level,
          f"serving phase options {a.phases} {a.bs_levels} scrape={a.scrape_metrics}")
    check(not options.parse_args(["--state-dir", "/tmp/x"]).scrape_metrics
          and options.parse_args(["--phases", "throughput", "--scrape-metrics", "--state-dir", "/tmp/x"]).scrape_metrics
          and not options.parse_args(["--phases", "serving", "--no-scrape-metrics", "--state-dir", "/tmp/x"]).scrape_metrics,
          "--scrape-metrics: on with the serving phase, else off; both ways by flag")
    for bad in (["--bs-levels", "0"], ["--bs-levels", "max"], ["--bs-prompts-per-level", "0"],
                ["--phases", "serving", "--bs-input-len", "65000"]):
        check_rejected(bad)
    with tempfile.TemporaryDirectory() as td:
        common, plug, _ = arms.prepare_pyext(Path(td), a)
        for phases, scraped in (("serving", None), ("throughput", None), ("throughput", "--scrape-metrics")):
            b = options.parse_args(["--phases", phases, "--state-dir", td] + ([scraped] if scraped else []))
            for arm in ("a", "b", "c", "d", "pd-c"):
                specs = bench_serving_phase.server_specs(arm, arms.arm_servers(arm, b, {}, {}, common, plug), b)
                for spec in specs:
                    pd_server = bool(spec.role)
                    check(("--skip-tokenizer-init" in spec.cmd) == (pd_server or phases != "serving")
                          and ("--enable-metrics" in spec.cmd) == (not pd_server and b.scrape_metrics),
                          f"{arm} {spec.role} with --phases {phases} {scraped or ''}: tokenizer / metrics flags {spec.cmd}")


def judge_checks() -> None:
    """The run verdict, the PD registration record and evidence."""
    # The correctness rule itself: tests/test_e2e_judge.py (CPU suite).
    data = {"arms": {"a": {"status": "ok"}, "c": {"status": "failed", "error": "boom"}}}
    check(judge.run_failures(0, {"arms": {"a": {"status": "ok"}}}, ["a"]) == []
          and len(judge.run_failures(3, data, ["a", "c", "d"])) == 3, "run verdict: exit code, failed and missing arms")
    reg = {"mode": "decode", "kv": {"regions": 4, "bytes": 4 * 262208 * 1152, "by_kind": {"host": 4 * 262208 * 1152}},
           "kv_item_bytes": [73728], "aux": {"regions": 1, "bytes": 64, "by_kind": {"device": 64}},
           "state": [{"regions": 4, "bytes": 10, "by_kind": {"device": 10}}]}
    text = f"x\n[hisparse-e2e-fixture] pid=7 pd-register {json.dumps(reg)}\n"
    check(logs.parse_pd_register(text) == reg and logs.summarize_log(text)["pd_register"] == reg
          and logs.parse_pd_register("nothing") is None, "pd-register record parsed")
    kv = [{"checks": k, "rows": 8192 * k, "mismatches": 0, "first_mismatch": None} for k in (1, 2)]
    text = "".join(f"[hisparse-e2e-fixture] pid=7 kv-check {json.dumps(x)}\n" for x in kv)
    check(logs.summarize_log(text)["kv_check"] == kv[-1] and logs.parse_kv_check("nothing") is None,
          "the last kv-check totals parsed")
    result = {"logs": {"decode": {"pd_register": reg, "max_total_num_tokens": 32768}, "prefill": {}},
              "longprompt": {"input_len": 49152, "admitted_and_decoded": True,
                             "decode_log": {"hisparse": {"host_rows_used_max": 49408, "device_rows_used_max": 4160}},
                             "gpu_memory_mib": {"before": {"pd-c-decode": 1000}, "max_during": {"pd-c-decode": 1010}}}}
    ev = pd.pd_evidence(result)
    check(ev["kv_regions_host_only"] and ev["kv_rows_per_layer"] == 262208 and ev["decode_gpu_growth_mib"] == 10
          and any("49152-token prompt was decoded" in x for x in ev["statements"])
          and any("'host'" in x for x in ev["statements"]), f"PD evidence {ev}")
    no_samples = pd.pd_evidence(dict(result, longprompt=dict(result["longprompt"], gpu_memory_mib={
        "before": {"pd-c-decode": 1000}, "max_during": {"pd-c-decode": None}})))
    check("decode_gpu_growth_mib" not in no_samples, "no GPU memory sample during the long prompt: no growth claimed")
    rejected = pd.pd_evidence({"logs": {"decode": {"max_total_num_tokens": 32768}},
                               "longprompt": {"input_len": 49152, "admitted_and_decoded": False, "error": "too long"}})
    check("kv_regions_host_only" not in rejected and any("not decoded: too long" in x for x in rejected["statements"])
          and any("No registration record" in x for x in rejected["statements"]), f"PD evidence without a record {rejected}")


def lowload_checks() -> None:
    """Steady-window TPOT, the per-level summary over repeats, the ratios, the lowload options."""
    # request A: tokens 1..100 every 10 ms from t=0; request B starts at 0.5 s, every 20 ms, 30 tokens
    a = [(0.01 * (n - 1), n) for n in range(1, 101)]
    b = [(0.5 + 0.02 * (n - 1), n) for n in range(1, 31)]
    w = stats.steady_window([a, b])
    check(close(w[0], 0.5) and close(w[1], 0.99), f"steady window {w}")
    check(close(stats.window_tpot(a, w), 0.01) and close(stats.window_tpot(b, w), 0.02), "per-request TPOT in the window")
    check(stats.steady_window([a, []]) is None and stats.steady_window([]) is None
          and stats.steady_window([[(1.0, 1)], [(2.0, 1)]]) is None, "no steady window")
    check(stats.window_tpot([(0.0, 1), (5.0, 9)], (1.0, 2.0)) is None, "window without two chunks")

    def level_run(level, rep, tpot, ok=None, resident=None, offloaded=None, host=0.2):
        return {"level": level, "repeat": rep, "concurrency": level, "ok": level if ok is None else ok, "errors": [],
                "tpot_ms_median": tpot, "steady_tpot_ms_median": tpot - 0.1, "output_tok_s": 1000.0 / tpot,
                "log_gen_tput_median": 900.0 / tpot, "hisparse_step_host_ms_median": host,
                "hisparse_all_resident": resident, "hisparse_offloaded_max": offloaded}

    runs = [level_run(1, 0, 2.0, resident=True, offloaded=0), level_run(1, 1, 2.2, resident=True, offloaded=0),
            level_run(1, 2, 2.1, resident=True, offloaded=0), level_run(8, 0, 3.0, resident=False, offloaded=8),
            level_run(8, 1, 3.4, ok=7), level_run(8, 2, 3.2, resident=True, offloaded=0)]
    lv = lowload.summarize_lowload(runs)
    check([x["level"] for x in lv] == [1, 8] and lv[0]["repeats"] == 3 and lv[1]["repeats"] == 2
          and lv[1]["failed_repeats"] == 1, f"repeats counted where every request completed: {lv}")
    check(close(lv[0]["tpot_ms"], 2.1) and lv[0]["tpot_ms_min"] == 2.0 and lv[0]["tpot_ms_max"] == 2.2
          and close(lv[1]["tpot_ms"], 3.1) and close(lv[0]["steady_tpot_ms"], 2.0) and close(lv[0]["step_host_ms"], 0.2),
          f"medians and spread over the repeats: {lv}")
    check(lv[0]["all_resident"] is True and lv[1]["all_resident"] is False and lv[1]["offloaded_max"] == 8,
          f"all resident only if every repeat was: {lv}")
    settings = {"input_len": 16384, "output_len": 1024, "levels": [1, 8], "repeats": 3}
    base = {"settings": settings, "invocation": "t1",
            "levels": lowload.summarize_lowload([level_run(1, 0, 2.0), level_run(8, 0, 2.5)])}
    arm_c = {"settings": settings, "invocation": "t1", "levels": lv}
    arm_d = {"settings": dict(settings, output_len=512), "invocation": "t1", "levels": lv}
    rt = lowload.lowload_ratios({"a": {"lowload": base}, "c": {"lowload": arm_c}, "d": {"lowload": arm_d}})
    check(sorted(rt) == ["c/a"] and rt["c/a"]["same_invocation"] and close(rt["c/a"]["levels"][0]["tpot_ms"], 1.05)
          and close(rt["c/a"]["levels"][1]["tpot_ms"], 1.24) and close(rt["c/a"]["levels"][1]["output_tok_s"], 0.807, 1e-3),
          f"ratios only between equal settings: {rt}")
    a = options.parse_args(["--phases", "lowload,report", "--ll-levels", "8,1", "--state-dir", "/tmp/x"])
    check(a.phases == ["lowload", "report"] and a.ll_levels == [8, 1] and a.ll_repeats == 3 and a.ll_output_len == 1024,
          f"lowload options {a.ll_levels}")
    for bad in (["--ll-levels", "1,max"], ["--ll-repeats", "0"], ["--ll-input-len", "65000"]):
        check_rejected(bad)


def close(x, y, tol: float = 1e-6) -> bool:
    return x is not None and y is not None and abs(x - y) <= tol


def storm_checks() -> None:
    """storm_gap_stats on synthetic arrivals, the plugin's HiSparse line, the storm table, the dry run."""
    # token 1 at t=0 (TTFT), then one token per 10 ms up to token 100 (t=0.99); the burst starts at
    # 0.995; 300 ms later a chunk of 3 tokens (101-103), 104 after 10 ms, 105 after 200 ms, then
    # 10 ms per token up to 120; the window ends at 1.515
    arr = [(0.01 * (n - 1), n) for n in range(1, 101)]
    arr += [(1.29, 103), (1.30, 104), (1.50, 105)] + [(1.50 + 0.01 * (n - 105), n) for n in range(106, 121)]
    arr.insert(50, (arr[49][0], 50))  # a chunk that adds no token is ignored
    st = storm.storm_gap_stats(arr, (0.995, 1.515), 20, 100)
    check(close(st["tpot_before_ms"], 10.0, 1e-3) and st["tpot_before_gaps"] == 80, f"tpot before {st}")
    check(st["tokens"] == 120 and st["chunks"] == 117 and st["multi_token_chunks"] == 1, f"chunks {st}")
    # window chunks: (0.99,1.29] 3 tokens, (1.29,1.30], (1.30,1.50], (1.50,1.51], (1.51,1.52]
    check(st["window_tokens"] == 7 and close(st["max_gap_ms"], 300.0, 1e-3), f"window max gap {st}")
    check(st["gaps_over_2x"] == 4, f"gaps over 2x: {st['gaps_over_2x']}")
    check(close(st["stall_ms"], (300 - 3 * 10) + (200 - 10), 1e-2), f"stall {st['stall_ms']}")
    check(close(st["p99_gap_ms"], 100 + 100 * 0.94, 1e-2), f"p99 of per-token gaps {st['p99_gap_ms']}")
    check(close(st["tpot_after_ms"], 10.0, 1e-3) and close(st["window_s"], 0.52, 1e-9), f"after {st}")
    # every chunk carries 2 tokens, 20 ms apart: 10 ms per token; a 100 ms chunk of 2 in the window
    arr2 = [(0.02 * i, 2 * i) for i in range(1, 51)] + [(1.10, 102)] + [(1.10 + 0.02 * i, 102 + 2 * i) for i in range(1, 20)]
    st2 = storm.storm_gap_stats(arr2, (1.005, 1.0999), 20, 100)
    check(close(st2["tpot_before_ms"], 10.0, 1e-3) and st2["tpot_before_gaps"] == 80 and st2["multi_token_chunks"] == len(arr2) - 1,
          f"two-token chunks: tpot {st2}")
    check(close(st2["max_gap_ms"], 100.0, 1e-3) and st2["window_tokens"] == 2 and st2["gaps_over_2x"] == 2
          and close(st2["stall_ms"], 80.0, 1e-3) and close(st2["tpot_after_ms"], 10.0, 1e-3), f"two-token chunks: window {st2}")
    # too few tokens / no window / nothing at all: None, not an exception
    few = storm.storm_gap_stats([(0.0, 1), (0.01, 2), (0.02, 3)], (0.015, 0.03), 20, 100)
    check(few["tpot_before_ms"] is None and few["stall_ms"] is None and few["gaps_over_2x"] is None
          and few["p99_gap_ms"] is None and few["tpot_after_ms"] is None and close(few["max_gap_ms"], 10.0, 1e-6), f"few tokens {few}")
    none = storm.storm_gap_stats(arr, None, 20, 100)
    check(none["window_s"] is None and none["max_gap_ms"] is None and close(none["tpot_before_ms"], 10.0, 1e-3), f"no window {none}")
    empty = storm.storm_gap_stats([], (0.0, 1.0), 20, 100)
    check(empty["tokens"] == 0 and empty["max_gap_ms"] is None and empty["tpot_before_ms"] is None, f"no arrivals {empty}")
    check(storm.stream_chunks([(0.0, 3), (0.1, 3), (0.2, 5)]) == [(0.0, 0.2, 4, 2)], "stream_chunks")

    hs = ("[2026-11-22 10:00:03 TP0] HiSparse: hit rate 24.8%, moved 35.2 MiB, resident 3, offloaded 33 (promoting 0), "
          "demotions 12.0/min, promotions 0.0/min, device rows 130944/131136, host rows 820352/1048640, switch work max 0.41 ms/step\n"
          "[2026-11-22 10:00:04 TP0] HiSparse: hit rate n/a, moved 0.0 MiB, resident 5, offloaded 0 (promoting 2), "
          "demotions 30.5/min, promotions 6.0/min, device rows 1/2, host rows 3/4, switch work max 1.25 ms/step, "
          "step host work 0.120 ms (max 0.31)\n"
          "[2026-11-22 10:00:05 TP0] HiSparse: hit rate 90.0%, moved 1.0 MiB, resident 1, offloaded 2 (promoting 0), "
          "demotions 2.0/min, promotions 0.0/min, device rows 1/2, host rows 3/4\n"
          "[2026-11-22 10:00:05 TP0] HiSparse: alloc_device_buffer failed for req 7\n")
    rows = logs.parse_hisparse_lines(hs)
    check(len(rows) == 3 and rows[0] == {"hit_rate_pct": 24.8, "moved_mib": 35.2, "resident": 3, "offloaded": 33, "promoting": 0,
                                         "demotions_per_min": 12.0, "promotions_per_min": 0.0, "device_rows_used": 130944,
                                         "host_rows_used": 820352, "switch_work_max_ms": 0.41},
          f"HiSparse line: {rows[:1]}")
    check("hit_rate_pct" not in rows[1] and rows[1]["promoting"] == 2 and "switch_work_max_ms" not in rows[2],
          f"HiSparse lines without a hit rate / without switch work: {rows[1:]}")
    sh = logs.summarize_hisparse(hs)
    check(sh == {"lines": 3, "switch_work_max_ms": 1.25, "demotions_per_min_max": 30.5, "promotions_per_min_max": 6.0,
                 "offloaded_max": 33, "resident_max": 5, "hit_rate_pct_min": 24.8, "step_host_ms_median": 0.12,
                 "device_rows_used_max": 130944, "host_rows_used_max": 820352,
                 "staged_by_dma": None, "staged_by_kernel": None,  # lines of a plugin that did not count them
                 "all_resident": False},
          f"HiSparse summary {sh}")
    check(logs.summarize_hisparse(hs.split("\n")[2]) ["switch_work_max_ms"] is None, "older line without switch work")
    check(logs.summarize_hisparse("HiSparse: admitting request r1 directly") is None and logs.summarize_log(hs)["hisparse"] == sh,
          "in-tree HiSparse lines are not the plugin's; summarize_log carries the summary")

    storm_row = {"requests": 24, "input_len": 16384, "burst_output_len": 32, "after_tokens": 100, "tpot_before_ms": 1.83,
             "max_gap_ms": 412.5, "p99_gap_ms": 300.0, "stall_ms": 1200.25, "gaps_over_2x": 9, "tpot_after_ms": 1.9,
             "window_s": 2.5, "burst_latency_s_median": 1.5, "burst_latency_s_max": 2.4, "prefill_batches_window": 48,
             "hisparse_after_burst_start": {"switch_work_max_ms": 0.41, "demotions_per_min_max": 12.0}}
    md = report.render_markdown({"meta": {}, "arms": {"c": {"status": "ok", "storm": storm_row},
                                                 "d": {"status": "ok", "storm": dict(storm_row, timed_out=True, hisparse_after_burst_start=None)}},
                            "compare": {}})
    check("## Storm: 24 new 16384-token requests" in md
          and "| c | 1.83 | 412.5 | 300.0 | 1200.2 | 9 | 1.90 | 2.50 | 1.50 / 2.40 | 48 | 0.41 | 12.0 |" in md
          and "| d (timed out) | 1.83 |" in md and "d: hisparse-sglang plugin, always offload" in md, f"storm table:\n{md}")

    with tempfile.TemporaryDirectory() as td:
        p = subprocess.run([sys.executable, str(E2E / "run_e2e.py"), "--dry-run", "--arms", "a,b,c,d", "--phases",
                            "preflight,correctness,capacity,throughput,storm,report", "--state-dir", td,
                            "--plugin-env", "HISPARSE_X=1"], capture_output=True, text=True, timeout=120)
        blocks = {b.split("\n", 1)[0].split(":")[0]: b for b in p.stdout.split("# arm ")[1:]}
        d = blocks.get("d", "")
        check(p.returncode == 0 and set(blocks) == {"a", "b", "c", "d"}, f"dry run of arms a-d rc={p.returncode} {p.stderr[-500:]}")
        check("'{\"top_k\":2048,\"device_buffer_size\":4096,\"host_to_device_ratio\":8,\"resident_first\":false}'" in d
              and f"PYTHONPATH={td}/pyext-plugin:{REPO / 'src'}:" in d and "HISPARSE_X=1" in d and "--port 31030" in d,
              f"dry run of arm d: {d}")
        check('"resident_first"' not in blocks.get("c", "") and f"{td}/pyext-plugin" in blocks.get("c", ""), "dry run of arm c")
        p = subprocess.run([sys.executable, str(E2E / "run_e2e.py"), "--dry-run", "--arms", "c", "--phases", "report",
                            "--state-dir", f"{td}/deep", "--model-layers", "16"], capture_output=True, text=True, timeout=120)
        check(p.returncode == 0 and f"--model-path {td}/deep/tiny-dsv32-L16 " in p.stdout
              and '"num_hidden_layers": 16' in Path(f"{td}/deep/tiny-dsv32-L16/config.json").read_text(),
              f"dry run with --model-layers 16: rc={p.returncode} {p.stdout[-800:]} {p.stderr[-500:]}")


# --------------------------------------------------------------------------------------------
def free_port_base() -> int:
    """A base of 100 ports where none that the arms use answers now (other sessions on this machine may run
    this self-test at the same time), below the ephemeral ports (servers.free_port_bases)."""
    import hostpool
    import servers

    return servers.free_port_bases(1, hostpool.harness_port_offsets(), start=23100)[0]


# --------------------------------------------------------------------------------------------
def mock_e2e(python: str) -> None:
    with tempfile.TemporaryDirectory() as td:
        td = Path(td)
        site = make_mock_site(td)
        out = td / "out"
        common = ["--site", str(site), "--python", python, "--state-dir", str(td / "state"),
                  "--out", str(out), "--max-total-tokens", "4096", "--corr-lens", "64,128", "--corr-seeds", "2",
                  "--corr-out", "16", "--corr-pair-len", "128", "--cap-input-len", "256", "--cap-output-len", "500",
                  "--cap-requests", "12", "--cap-plateau-s", "1.5", "--cap-poll-s", "0.1", "--tp-input-len", "128",
                  "--tp-output-len", "200", "--tp-levels", "1,4,max", "--port-base", str(free_port_base()), "--preflight-timeout", "60",
                  "--health-timeout", "90", "--arm-min-s", "5", "--reserve-s", "5"]
        # run 1: arms a,b; run 2: arm c with a mismatch injected and a loadable plugin entry point;
        # run 3: arm c with an entry point that cannot be imported -> must fail loudly
        r1 = subprocess.run([sys.executable, str(E2E / "run_e2e.py"), "--arms", "a,b", "--tp-repeats", "2", *common],
                            capture_output=True, text=True, timeout=300)
        print(r1.stdout[-3000:], r1.stderr[-2000:], sep="\n", flush=True)
        check(r1.returncode == 0, f"mock run 1 rc={r1.returncode}")
        r2 = subprocess.run([sys.executable, str(E2E / "run_e2e.py"), "--arms", "c", "--phases", "correctness,report",
                             "--plugin-ep", "hisparse=mockplug:register", "--plugin-env", "MOCK_FLIP_AT=5", *common],
                            capture_output=True, text=True, timeout=300)
        print(r2.stdout[-2500:], r2.stderr[-2000:], sep="\n", flush=True)
        check(r2.returncode == 0, f"mock run 2 rc={r2.returncode}")
        res = json.loads((out / "results.json").read_text())
        arm_results = res["arms"]
        check(set(arm_results) == {"a", "b", "c"} and all(arm_results[x]["status"] == "ok" for x in arm_results),
              f"all arms ok: { {x: arm_results[x].get('status') for x in arm_results} }")
        ca, cb = arm_results["a"]["capacity"], arm_results["b"]["capacity"]
        check(ca["max_running"] == 5 and "plateau" in ca["stop_reason"], f"baseline capacity {ca['max_running']} {ca['stop_reason']}")
        check(cb["max_running"] == 12 and cb["stop_reason"] == "all requests running", f"hisparse capacity {cb['max_running']} {cb['stop_reason']}")
        runs = [(row["level"], row["repeat"]) for row in arm_results["b"]["throughput"]["levels"]]
        check(runs == [(1, 0), (1, 1), (4, 0), (4, 1), ("max", 0), ("max", 1)], f"throughput runs {runs}")
        lv = {row["level"]: row for row in arm_results["b"]["throughput"]["levels"] if row["repeat"] == 0}
        check(set(lv) == {1, 4, "max"} and lv["max"]["concurrency"] == 12 and lv[4]["ok"] == 4
              and lv[1]["tpot_ms_median"] and lv[1]["log_gen_tput_median"], f"throughput levels {list(lv)}")
        check(len(lv["max"]["requests"]) == 12 and all(r[2] == 200 and r[0] <= r[1] for r in lv["max"]["requests"]),
              f"per-request TTFT / end-to-end / tokens {lv['max']['requests'][:2]}")
        check("capacity" in arm_results["a"] and arm_results["a"]["correctness"]["prompts_ok"] == 6, "arm a data kept across runs")
        cmp_ba, cmp_ca = res["compare"]["b_vs_a"], res["compare"]["c_vs_a"]
        check(cmp_ba["prompts_identical"] == 6 and cmp_ba["mismatched_tokens"] == 0, f"b vs a identical: {cmp_ba['prompts_identical']}")
        check(cmp_ca["prompts_identical"] == 0 and all(r["first_mismatch"] == 5 for r in cmp_ca["per_prompt"]),
              "c vs a: injected mismatch at token 5 detected")
        check(arm_results["a"]["correctness"]["context_sensitive"] is True, "context-sensitivity pair differs in the mock")
        check(arm_results["c"]["plugin_check"]["visible"] and not arm_results["c"]["plugin_check"]["failures"], "plugin visible in arm c")
        check(cmp_ba["same_weights"] is True and arm_results["a"]["weight_fingerprints"], f"same weights b/a: {arm_results['a'].get('weight_fingerprints')}")
        check(arm_results["a"]["log"]["dense_attn_threshold"] == 0, "dense threshold env reached the server")
        files = sorted(p.name for p in out.iterdir())
        check(len(files) <= 8 and {"results.json", "results.md", "server-a.log", "harness.log"} <= set(files), f"$OUT files {files}")
        md = (out / "results.md").read_text()
        check("| c=max (run 2): output tok/s (client) |" in md and "b_vs_a" in md, "markdown table rows")
        mock_storm(common, out)
        mock_lowload(common, td)
        mock_serving(common, td)
        mock_pd_mtp(common, td)  # before mock_pd, whose tests_helper_checks judge its results too
        mock_pd(common, td)
        r3 = subprocess.run([sys.executable, str(E2E / "run_e2e.py"), "--arms", "c", "--phases", "correctness,report",
                             "--plugin-ep", "hisparse=no_such_module_xyz:register", *common],
                            capture_output=True, text=True, timeout=300)
        res3 = json.loads((out / "results.json").read_text())
        check(r3.returncode == 2 and res3["arms"]["c"]["status"] == "failed" and "plugin" in res3["arms"]["c"]["error"],
              f"unloadable plugin makes arm c fail loudly (rc={r3.returncode}, {res3['arms']['c'].get('error', '')[:120]})")
        # deadline handling: nothing fits -> arms skipped, rc 3, still a report
        r4 = subprocess.run([sys.executable, str(E2E / "run_e2e.py"), "--arms", "b", "--deadline-s", "3", "--fresh",
                             *[x for x in common if x not in ()]], capture_output=True, text=True, timeout=120)
        res4 = json.loads((out / "results.json").read_text())
        check(r4.returncode == 3 and res4["arms"]["b"]["status"] == "skipped", f"deadline skip rc={r4.returncode}")
        check(not leftover_children(str(td)), f"no mock scheduler children left: {leftover_children(str(td))}")
        if FAILS:
            shutil.copytree(td, "/tmp/e2e_selftest_failed", dirs_exist_ok=True)
            print("kept the mock run in /tmp/e2e_selftest_failed")


def mock_storm(common: list[str], out: Path) -> None:
    """Run 2b: arms a and d, correctness + storm; prefill stalls decoding in the mock; arm d logs HiSparse lines."""
    storm_flags = ["--storm-input-len", "1024", "--storm-output-len", "400", "--storm-after-tokens", "50",
             "--storm-requests", "6", "--storm-burst-output-len", "32", "--storm-timeout", "60"]
    r = subprocess.run([sys.executable, str(E2E / "run_e2e.py"), "--arms", "a,d", "--phases", "correctness,storm,report",
                        "--plugin-ep", "hisparse=mockplug:register", "--plugin-env", "MOCK_HISPARSE_LOG=1", *storm_flags, *common],
                       capture_output=True, text=True, timeout=300, env=dict(os.environ, MOCK_PREFILL_S_PER_TOKEN="2e-5"))
    print(r.stdout[-2500:], r.stderr[-2000:], sep="\n", flush=True)
    check(r.returncode == 0, f"mock storm run rc={r.returncode}")
    res = json.loads((out / "results.json").read_text())
    arm_results = res["arms"]
    check(set(arm_results) == {"a", "b", "c", "d"} and arm_results["d"]["status"] == "ok", f"arm d ok: {arm_results['d'].get('status')} {arm_results['d'].get('error')}")
    for x in ("a", "d"):
        st = arm_results[x].get("storm") or {}
        print(f"storm {x}:", {k: v for k, v in st.items() if k != "r0"})
        check(st.get("tpot_before_ms") and st.get("max_gap_ms") and st["max_gap_ms"] > 3 * st["tpot_before_ms"]
              and st.get("stall_ms", 0) > 0 and st.get("gaps_over_2x", 0) >= 1 and st.get("tpot_after_ms")
              and not st.get("timed_out") and st.get("burst_ok") == 6 and st.get("prefill_batches_window", 0) >= 1
              and st["r0"]["tokens"] == 400 and len(st["r0"]["arrivals_ms"]) > 100 and st["r0"]["tokens_at_burst"] >= 50,
              f"storm of arm {x}: {st}")
    hs = arm_results["d"]["storm"].get("hisparse_after_burst_start") or {}
    check(hs.get("switch_work_max_ms") == 0.25 and hs.get("demotions_per_min_max", 0) >= 6.0,
          f"arm d: HiSparse lines parsed after the burst start: {hs}")
    check(arm_results["a"]["storm"].get("hisparse_after_burst_start") is None, "arm a logs no HiSparse line")
    check(arm_results["d"]["pythonpath"].split(os.pathsep)[1] == str(REPO / "src") and arm_results["d"]["plugin_check"]["visible"]
          and arm_results["d"]["env"].get("MOCK_HISPARSE_LOG") == "1", "arm d loads the plugin like arm c")
    check('"resident_first":false' in (out / "server-d.log").read_text()
          and '"resident_first"' not in (out / "server-c.log").read_text(), "arm d's server got resident_first false")
    cmp = res["compare"]
    check(cmp.get("d_vs_a", {}).get("prompts_identical") == 6
          and all(r["first_mismatch"] == 5 for r in cmp.get("c_vs_d", {}).get("per_prompt", [{}])),
          f"d vs a identical, c vs d at the injected token: {sorted(cmp)}")
    md = (out / "results.md").read_text()
    check("## Storm: 6 new 1024-token requests" in md and "\n| a | " in md and "\n| d | " in md
          and "| d_vs_a |" in md and "| c_vs_d |" in md, "storm table and d comparisons in results.md")
    files = sorted(p.name for p in out.iterdir())
    check(len(files) <= 8 and "server-d.log" in files, f"$OUT files with four arms: {files}")


def mock_lowload(common: list[str], td: Path) -> None:
    """Run 2c: arms a, c and d, the low-load phase (own state dir); arm c's mock keeps up to 2 requests resident."""
    out = td / "ll_out"
    ll = ["--ll-levels", "1,2,4", "--ll-repeats", "2", "--ll-input-len", "128", "--ll-output-len", "300"]
    res = mock_run(["--arms", "a,c,d", "--phases", "lowload,report", "--plugin-ep", "hisparse=mockplug:register",
                    "--plugin-env", "MOCK_HISPARSE_LOG=1", "--plugin-env", "MOCK_RESIDENT_UP_TO=2", *ll,
                    *own_dirs(common, td, "ll")], out, "mock lowload run")
    arm_results = res["arms"]
    for x in ("a", "c", "d"):
        ll_res = arm_results[x].get("lowload") or {}
        runs = [(row["level"], row["repeat"]) for row in ll_res.get("runs", [])]
        check(runs == [(1, 0), (2, 0), (4, 0), (1, 1), (2, 1), (4, 1)], f"arm {x}: lowload runs interleaved: {runs}")
        levels = ll_res.get("levels", [])
        check([lv["level"] for lv in levels] == [1, 2, 4] and all(lv["repeats"] == 2 for lv in levels)
              and all(lv["tpot_ms"] and lv["tpot_ms_min"] <= lv["tpot_ms"] <= lv["tpot_ms_max"] for lv in levels)
              and all(lv["steady_tpot_ms"] and lv["output_tok_s"] and lv["log_gen_tput"] for lv in levels),
              f"arm {x}: lowload levels {levels}")
    c_res = {lv["level"]: lv for lv in arm_results["c"]["lowload"]["levels"]}
    check(c_res[1]["all_resident"] is True and c_res[2]["all_resident"] is True and c_res[4]["all_resident"] is False
          and c_res[4]["offloaded_max"] >= 3 and c_res[1]["step_host_ms"] == 0.11, f"arm c: resident levels {c_res}")
    check(all(lv["all_resident"] is None for lv in arm_results["a"]["lowload"]["levels"]), "arm a logs no HiSparse line")
    ratios = res["lowload_ratios"]
    check(sorted(ratios) == ["c/a", "d/a"] and all(rt["same_invocation"] for rt in ratios.values())
          and all(0.5 < lv["tpot_ms"] < 2.0 for lv in ratios["c/a"]["levels"]) and len(ratios["d/a"]["levels"]) == 3,
          f"lowload ratios {ratios}")
    md = (out / "results.md").read_text()
    check("## Low load: 128 input + 300 output tokens" in md and "| c/a TPOT | c/a steady TPOT |" in md
          and "Arm c kept every running request resident at concurrency: 1, 2." in md, f"lowload markdown:\n{md[-3000:]}")


def mock_run(argv: list[str], out: Path, what: str, timeout: float = 400) -> dict:
    """run_e2e.py against the mock; its output tail is printed, a non-zero exit is a failure; the results."""
    r = subprocess.run([sys.executable, str(E2E / "run_e2e.py"), *argv], capture_output=True, text=True, timeout=timeout)
    print(r.stdout[-4000:], r.stderr[-2000:], sep="\n", flush=True)
    check(r.returncode == 0, f"{what} rc={r.returncode}")
    return json.loads((out / "results.json").read_text())


def own_dirs(common: list[str], td: Path, name: str) -> list[str]:
    """The mock flags with a state and $OUT folder of their own."""
    flags = list(common)
    flags[flags.index("--state-dir") + 1], flags[flags.index("--out") + 1] = str(td / f"{name}_state"), str(td / f"{name}_out")
    return flags


def mock_pd_mtp(common: list[str], td: Path) -> None:
    """Run 2e: PD with MTP (arm pd-c+mtp) beside a+mtp: both PD instances start on the MTP model with the
    speculative flags, the decode with the plugin, and the pair decodes like a+mtp."""
    flags = own_dirs(common, td, "pdmtp")
    out = td / "pdmtp_out"
    res = mock_run(["--arms", "a+mtp,pd-c+mtp", "--phases", "preflight,correctness,report", "--corr-decodes", "2",
                    "--mtp-steps", "1", "--pd-decode-max-total-tokens", "2048", "--pd-prefill-max-total-tokens", "16384",
                    "--plugin-ep", "hisparse=mockplug:register", "--plugin-env", "MOCK_PD_LOGICAL=1",
                    "--mooncake-syslibs", str(td / "no-syslibs"), *flags], out, "mock PD + MTP run")
    arm_results = res["arms"]
    check(all(arm_results.get(x, {}).get("status") == "ok" for x in ("a+mtp", "pd-c+mtp")),
          f"PD + MTP arms ok: { {x: (v.get('status'), str(v.get('error'))[:300]) for x, v in arm_results.items()} }")
    if arm_results.get("pd-c+mtp", {}).get("status") != "ok":
        return
    cmp = res["compare"].get("pd-c+mtp_vs_a+mtp", {})
    check(cmp.get("verdict", {}).get("ok") and cmp.get("prompts_compared") == 6, f"pd-c+mtp decodes like a+mtp (mock): {cmp.get('verdict')}")
    cmds = arm_results["pd-c+mtp"].get("cmd") or {}
    check(set(cmds) == {"prefill", "decode"} and all("--speculative-algorithm EAGLE" in str(c) and "model-mtp" in str(c) for c in cmds.values())
          and "--enable-hisparse" in str(cmds["decode"]) and "--enable-hisparse" not in str(cmds["prefill"]),
          f"pd-c+mtp: both instances speculate on the MTP model, the decode with HiSparse: {str(cmds)[:400]}")


def mock_pd(common: list[str], td: Path) -> None:
    """Run 2d: arm a and the PD arms pd-c and pd-b (both instances mocked): correctness, long prompt, saturation;
    then a run whose Mooncake preflight fails."""
    flags = own_dirs(common, td, "pd")
    out = td / "pd_out"
    pd_flags = ["--corr-decodes", "2", "--pd-decode-max-total-tokens", "2048", "--pd-prefill-max-total-tokens", "16384",
                "--long-len", "6000", "--long-out", "300", "--sat-input-len", "256", "--sat-output-len", "200",
                "--sat-requests", "8", "--sat-tpot-repeats", "2", "--mooncake-syslibs", str(td / "no-syslibs")]
    res = mock_run(["--arms", "a,pd-c,pd-b", "--phases", "preflight,correctness,longprompt,saturation,report",
                    "--plugin-ep", "hisparse=mockplug:register", "--plugin-env", "MOCK_PD_LOGICAL=1",
                    "--plugin-env", "MOCK_HISPARSE_LOG=1", *pd_flags, *flags], out, "mock PD run")
    arm_results = res["arms"]
    check(all(arm_results[x]["status"] == "ok" for x in ("a", "pd-c", "pd-b")),
          f"PD arms ok: { {x: (v.get('status'), str(v.get('error'))[:300]) for x, v in arm_results.items()} }")
    check(res["meta"]["preflight"]["mooncake"]["ok"] and res["meta"]["preflight"]["mooncake"]["host_to_host"]["match"],
          f"Mooncake preflight: {res['meta']['preflight'].get('mooncake')}")
    for x in ("pd-c", "pd-b"):
        if arm_results.get(x, {}).get("status") != "ok":  # already a FAIL above; its checks below need its results
            continue
        v = res["compare"][f"{x}_vs_a"]["verdict"]
        check(v["ok"] and v["rule"] == "identical" and res["compare"][f"{x}_vs_a"]["prompts_compared"] == 6,
              f"{x} decodes like arm a (mock): {v}")
        check(set(arm_results[x]["startup_s_per_server"]) == {f"{x}-prefill", f"{x}-decode"}
              and arm_results[x]["logs"]["decode"]["pd_register"]["kv"]["regions"] == 4
              and arm_results[x]["logs"]["prefill"]["pd_register"]["mode"] == "prefill", f"{x}: both servers, their records")
        logs_text = {role: (td / "pd_state" / f"server-{x}-{role}.log").read_text() for role in ("prefill", "decode")}
        rooms = {role: re.findall(r"PD " + role + r" room (\d+) rid ", text) for role, text in logs_text.items()}
        check(rooms["prefill"] and sorted(rooms["prefill"]) == sorted(rooms["decode"])
              and len(set(rooms["decode"])) == len(rooms["decode"]),
              f"{x}: every request reached both instances with one fresh bootstrap room "
              f"({len(rooms['prefill'])} prefill, {len(rooms['decode'])} decode)")
    long_c, long_b, long_a = (arm_results[x]["longprompt"] for x in ("pd-c", "pd-b", "a"))
    check(long_c["admitted_and_decoded"] and long_c["tokens"] == 300 and long_c["longer_than_device_pool"]
          and long_c["decode_log"]["hisparse"]["host_rows_used_max"] == 200, f"pd-c decodes the long prompt: {long_c}")
    check(not long_b["admitted_and_decoded"] and "exceeds the maximum allowed length" in long_b["error"]
          and long_b["decode_log"]["input_too_long"], f"pd-b rejects it, as SGLang does: {long_b}")
    check("not_applicable" in long_a, "the long prompt is not run on a co-located arm")
    for x in ("a", "pd-c", "pd-b"):
        sat = arm_results[x]["saturation"]
        check(sat["concurrency_1"]["tpot_ms"] and len(sat["concurrency_1"]["runs"]) == 2
              and sat["saturated"]["ok"] == 8 and sat["saturated"]["max_running"] >= 6
              and sat["saturated"]["log_gen_tput_at_max"], f"{x}: saturation {sat}")
    check(arm_results["pd-c"]["pd"]["decode_registered"]["kv"]["regions"] == 4
          and any("was decoded by a decode instance whose GPU KV pool holds 2048 tokens" in line
                  for line in arm_results["pd-c"]["pd"]["statements"]), f"pd-c evidence {arm_results['pd-c'].get('pd')}")
    md = (out / "results.md").read_text()
    check("## PD disaggregation" in md and "| pd-c_vs_a |" in md and "Where the KV lands, arm pd-c:" in md,
          f"PD markdown:\n{md[-3000:]}")
    files = sorted(p.name for p in out.iterdir())
    check(len(files) <= 8 and {"server-pd-c-prefill.log", "server-pd-c-decode.log", "server-pd-b-decode.log",
                               "server-a.log", "harness.log"} <= set(files), f"$OUT of the PD run: {files}")
    tests_helper_checks(td)
    # the Mooncake part does not import: the PD arms fail before starting anything, arm a runs
    r = subprocess.run([sys.executable, str(E2E / "run_e2e.py"), "--arms", "a,pd-c", "--phases", "preflight,correctness,report",
                        "--corr-lens", "64", "--corr-pair-len", "0", *[x for x in own_dirs(common, td, "pd2")]],
                       capture_output=True, text=True, timeout=300, env=dict(os.environ, MOCK_MOONCAKE_BROKEN="1"))
    res = json.loads((td / "pd2_out" / "results.json").read_text())
    check(r.returncode == 2 and res["arms"]["a"]["status"] == "ok" and res["arms"]["pd-c"]["status"] == "failed"
          and "Mooncake preflight failed" in res["arms"]["pd-c"]["error"] and "startup_s" not in res["arms"]["pd-c"],
          f"a failed Mooncake preflight fails the PD arms loudly: rc={r.returncode} {res['arms']['pd-c'].get('error')}")


def real_bench_serving(python: str) -> bool:
    """Whether `python` imports SGLang's own bench_serving when the mock site is not on its path."""
    code = ("import importlib.util as u, pathlib; s = u.find_spec('sglang'); "
            "print(bool(s and s.origin and (pathlib.Path(s.origin).parent / 'bench_serving.py').exists()))")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([python, "-c", code], capture_output=True, text=True, env=env).stdout.strip() == "True"


def mock_serving(common: list[str], td: Path) -> None:
    """Run 2e: arms a and c, throughput + serving; the /metrics check agrees. Run 2f: arm c whose /metrics
    disagree with its log line (MOCK_METRICS_SKEW): the check must fail the run (exit 2)."""
    flags = own_dirs(common, td, "bs")
    # after the common flags, whose throughput levels and lengths they replace (argparse: the last wins). The
    # mock logs the plugin's line at its 0.2 s ticks that find a request running: 250 tokens (>= 0.5 s) per
    # request make each phase's requests span several ticks, so each phase logs lines before the scrape that
    # follows it (requests of 40 tokens, 85 ms, could all fall between two ticks: no line, a flaky failure)
    sv = ["--tp-levels", "1,2", "--tp-output-len", "250", "--bs-levels", "1,2", "--bs-input-len", "160",
          "--bs-output-len", "250", "--plugin-ep", "hisparse=mockplug:register", "--plugin-env", "MOCK_HISPARSE_LOG=1"]
    # the mock site's stand-in for bench_serving, one process per level
    res = mock_run(["--arms", "a,c", "--phases", "throughput,serving,report", "--bs-process-per-level", *flags, *sv],
                   td / "bs_out", "mock serving run")
    arm_results = res["arms"]
    for x in ("a", "c"):
        log_text = (td / "bs_state" / f"server-{x}.log").read_text()
        check("--skip-tokenizer-init" not in log_text and "'--enable-metrics'" in log_text,
              f"arm {x}: with the serving phase the server loads its tokenizer and exports metrics")
        levels = (arm_results[x].get("serving") or {}).get("levels") or []
        check([lv["max_concurrency"] for lv in levels] == [1, 2] and all(lv["ok"] for lv in levels)
              and [lv["summary"]["total_output_tokens"] for lv in levels] == [500, 1000]
              and all(lv["cmd"].split()[1:3] == ["-m", "sglang.bench_serving"] and "--random-range-ratio 1.0" in lv["cmd"]
                      for lv in levels), f"arm {x}: bench_serving levels {levels}")
        rows = bench_serving_phase.compare_clients(arm_results[x])
        check(len(rows) == 2 and all(r["own"] and r["own"]["phase"] == "throughput" and r["ratio"]["output_tok_s"]
                                     for r in rows), f"arm {x}: bench_serving beside the own client {rows}")
    check("metrics_check" not in arm_results["a"]["serving"], "no /metrics check on arm a (no plugin)")
    for phase in ("throughput", "serving"):
        mc = arm_results["c"][phase].get("metrics_check") or {}
        check(mc.get("ok") is True and mc.get("lines", 0) >= 1 and mc["metrics"]["hit_rate"] == 0.975
              and mc["metrics"]["bytes_moved"] == 1.5 * 2**20 * mc["lines"], f"arm c: /metrics after {phase}: {mc}")
    md = (td / "bs_out" / "results.md").read_text()
    check("## bench_serving (SGLang's client) beside the harness's own client" in md and "\n| c | 2 | 4 of 4 |" in md
          and "| c | serving | yes |" in md and "| c | throughput | yes |" in md, f"serving markdown:\n{md[-3000:]}")
    # run 2f: the mutation; SGLang's own bench_serving where this Python has it, in one process
    real = real_bench_serving(sys.executable)
    print(f"serving run with {'SGLang' if real else 'the mock site'}'s bench_serving", flush=True)
    empty = td / "no_site"
    empty.mkdir()
    mutated = own_dirs(flags, td, "bs2")
    r = subprocess.run([sys.executable, str(E2E / "run_e2e.py"), "--arms", "c", "--phases", "serving,report", *mutated, *sv,
                        "--plugin-env", "MOCK_METRICS_SKEW=resident,bytes_moved"]
                       + (["--bs-python", sys.executable, "--bs-site", str(empty)] if real else []),
                       capture_output=True, text=True, timeout=300)
    print(r.stdout[-2500:], r.stderr[-2000:], sep="\n", flush=True)
    res = json.loads((td / "bs2_out" / "results.json").read_text())
    c = res["arms"]["c"]
    mc = c["serving"].get("metrics_check") or {}
    check(r.returncode == 2 and c["status"] == "ok" and mc.get("ok") is False
          and any(m.startswith("resident: metric 1, log 0") for m in mc["mismatches"])
          and any(m.startswith("bytes_moved: counter") for m in mc["mismatches"])
          and len(c.get("check_failures", [])) == 1,
          f"a /metrics that disagrees with the log line fails the run: rc={r.returncode} {mc} {c.get('check_failures')}")
    md = (td / "bs2_out" / "results.md").read_text()
    check("| c | serving | NO |" in md and "- arm c: serving: /metrics disagrees with the plugin's log line" in md,
          f"the disagreement in results.md:\n{md[-2000:]}")
    levels = c["serving"]["levels"]
    check([lv["max_concurrency"] for lv in levels] == [1, 2] and all(lv["ok"] for lv in levels)
          and c["serving"]["settings"]["one_process"], f"bench_serving in one process: {levels}")
    if real:  # SGLang's random dataset with range ratio 1: the server saw exactly --bs-input-len tokens per request
        log_text = (td / "bs2_state" / "server-c.log").read_text()
        sent = sum(lv["num_prompts"] + 1 for lv in levels)  # one warm-up request per run
        check(len(re.findall(r"#new-token: 160,", log_text)) == sent and "fake_bench_serving" not in json.dumps(levels),
              f"SGLang's bench_serving: {sent} prompts of exactly 160 tokens each "
              f"({len(re.findall(r'#new-token: 160,', log_text))} such prefills)")


def tests_helper_checks(td: Path) -> None:
    """tests/e2e's helper judges the mock PD run's results like a GPU run's (HISPARSE_E2E_RUN=0)."""
    sys.path.insert(0, str(REPO / "tests" / "e2e"))
    old = os.environ.get("HISPARSE_E2E_RUN")
    os.environ["HISPARSE_E2E_RUN"] = "0"
    try:
        import e2e_harness

        data = e2e_harness.run_harness("a,pd-c,pd-b", td / "pd_state", [])
        # the mock servers run no plugin of ours, so no in-server KV check
        e2e_harness.assert_decodes_like_baseline(data, "pd-c", kv_checked=False)
        check(True, "")
        # the PD + MTP run (mock_pd_mtp) as tests/e2e/test_e2e_speculative.py judges it with HISPARSE_E2E_MTP_PD=1
        data = e2e_harness.run_harness("a+mtp,pd-c+mtp", td / "pdmtp_state", [])
        e2e_harness.assert_decodes_like_baseline(data, "pd-c+mtp", kv_checked=False, baseline="a+mtp")
        e2e_harness.assert_run_kv_dtype(data, td / "pdmtp_state", "bfloat16")
        check(True, "")
        try:
            e2e_harness.assert_run_kv_dtype(data, td / "pdmtp_state", "fp8_e4m3")
            check(False, "tests/e2e must fail on results of another KV dtype")
        except BaseException as e:  # pytest's Failed
            check("of --kv-cache-dtype bfloat16, not fp8_e4m3" in str(e), f"tests/e2e fails on another KV dtype: {e}")
        try:
            e2e_harness.run_harness("a,pd-c,d", td / "pd_state", [])
            check(False, "tests/e2e must fail on an arm without results")
        except BaseException as e:  # pytest.fail raises pytest's Failed (a BaseException)
            check("arm d: no results" in str(e), f"tests/e2e fails on a missing arm: {e}")
    except ImportError as e:
        print(f"tests/e2e helper not checked: {e}")
    except Exception as e:
        check(False, f"tests/e2e helper on the mock PD results: {type(e).__name__}: {e}")
    finally:
        if old is None:
            os.environ.pop("HISPARSE_E2E_RUN", None)
        else:
            os.environ["HISPARSE_E2E_RUN"] = old


def server_args_check(python: str) -> None:
    """Parse every arm's argv with the real sglang.srt.server_args under a fake CUDA device."""
    with tempfile.TemporaryDirectory() as td:
        td = Path(td)
        stub = td / "stub"
        stub.mkdir()
        syms = ["cuGetErrorString", "cuGetProcAddress", "cuLaunchKernel", "cuFuncSetAttribute", "cuModuleGetFunction",
                "cuModuleLoadData", "cuDriverGetVersion", "cuInit", "cuCtxGetCurrent", "cuLibraryLoadData",
                "cuLibraryGetKernel", "cuKernelGetFunction", "cuLaunchKernelEx", "cuTensorMapEncodeTiled",
                "cuGetErrorName", "cuDeviceGetAttribute", "cuOccupancyMaxActiveClusters", "cuLibraryUnload"]
        # every cu* driver symbol the sgl_kernel extensions import (nm), so that they dlopen
        skdir = subprocess.run([python, "-c", "import importlib.util as u; print(list(u.find_spec('sgl_kernel').submodule_search_locations)[0])"],
                               capture_output=True, text=True).stdout.strip()
        for so in Path(skdir).rglob("*.so") if skdir else []:
            nm = subprocess.run(["nm", "-D", "--undefined-only", str(so)], capture_output=True, text=True).stdout
            syms += [w.split("@")[0] for w in nm.split() if w.startswith("cu") and w[2:3].isupper()]
        (td / "stub.c").write_text("".join(f"int {s}(void){{return 0;}}\n" for s in sorted(set(syms))))
        if subprocess.run(["cc", "-shared", "-fPIC", "-o", str(stub / "libcuda.so.1"), str(td / "stub.c"),
                           "-Wl,-soname,libcuda.so.1"]).returncode != 0:
            print("server-args check skipped: no C compiler")
            return
        fake = textwrap.dedent('''
            import sys, json, torch
            for m in ("cutlass",): sys.modules[m] = None
            class P: total_memory = 80 * 2**30; name = "NVIDIA H100 80GB HBM3"; major = 9; minor = 0; multi_processor_count = 132
            torch.cuda.is_available = lambda: True; torch.cuda.device_count = lambda: 1
            torch.cuda.get_device_capability = lambda d=None: (9, 0); torch.cuda.get_device_name = lambda d=None: P.name
            torch.cuda.get_device_properties = lambda d=None: P(); torch.cuda.mem_get_info = lambda d=None: (78 * 2**30, 80 * 2**30)
            torch.cuda.current_device = lambda: 0; torch.cuda._lazy_init = lambda: None
            from sglang.srt.server_args import prepare_server_args
            a = prepare_server_args(sys.argv[1:])
            print("ARGS_JSON=" + json.dumps({k: getattr(a, k, None) for k in ("attention_backend", "dsa_prefill_backend",
                  "dsa_decode_backend", "kv_cache_dtype", "page_size", "enable_hisparse", "hisparse_config",
                  "max_total_tokens", "context_length", "disable_radix_cache", "skip_tokenizer_init", "load_format",
                  "disaggregation_mode", "disaggregation_transfer_backend", "disaggregation_bootstrap_port")}
                  | {"mc_force_tcp": __import__("os").environ.get("MC_FORCE_TCP")}, default=str))
        ''')
        (td / "fake.py").write_text(fake)
        # the fixture plugin through the real sglang plugin loader + HookRegistry
        fixture_code = fake.split("from sglang.srt.server_args")[0] + textwrap.dedent('''
            import sglang.srt.model_loader.loader as loader
            from sglang.srt.plugins import load_plugins
            load_plugins()
            class Toy(torch.nn.Module):
                def __init__(self):
                    super().__init__()
                    self.embed_tokens = torch.nn.Embedding(64, 16); self.norm = torch.nn.LayerNorm(16)
                    self.lm_head = torch.nn.Linear(16, 64, bias=False)
            m = Toy(); loader.initialize_dummy_weights(m)
            print("FIXTURE_JSON=" + json.dumps({"norm": float(m.norm.weight.mean()), "bias": float(m.norm.bias.abs().sum()),
                  "emb_std": float(m.embed_tokens.weight.std()), "lm_std": float(m.lm_head.weight.std())}))
        ''')
        (td / "fixture_check.py").write_text(fixture_code)
        a = options.parse_args(["--state-dir", str(td / "state")])
        common, plug, _ = arms.prepare_pyext(td / "state", a)
        env = dict(os.environ, LD_LIBRARY_PATH=str(stub), PYTHONPATH=str(common), HISPARSE_E2E_WEIGHT_INIT="scaled")
        p = subprocess.run([python, str(td / "fixture_check.py")], env=env, capture_output=True, text=True, timeout=600)
        line = next((ln for ln in p.stdout.splitlines() if ln.startswith("FIXTURE_JSON=")), None)
        fx = json.loads(line.split("=", 1)[1]) if line else {}
        print("fixture via sglang load_plugins:", fx, [ln for ln in p.stderr.splitlines() if "hisparse-e2e-fixture" in ln][-1:])
        check(fx.get("norm") == 1.0 and fx.get("bias") == 0.0 and 0.07 < fx.get("emb_std", 0) < 0.13
              and 0.35 < fx.get("lm_std", 0) < 0.65 and "fingerprint=" in p.stderr,
              f"fixture hooked initialize_dummy_weights through sglang's HookRegistry: {fx} {p.stderr[-800:]}")
        for arm in arms.ALL_ARMS:
            for spec in arms.arm_servers(arm, a, {}, {}, common, plug):
                argv = spec.cmd[3:]  # drop "python -m sglang.launch_server"
                env = dict(os.environ, LD_LIBRARY_PATH=str(stub), SGLANG_DSA_PREFILL_DENSE_ATTN_KV_LEN_THRESHOLD="0")
                p = subprocess.run([python, str(td / "fake.py"), *argv], env=env, capture_output=True, text=True, timeout=600)
                line = next((ln for ln in p.stdout.splitlines() if ln.startswith("ARGS_JSON=")), None)
                name = spec.name(arm)
                check(line is not None, f"{name}: prepare_server_args failed: {p.stderr[-1500:]}")
                if line:
                    got = json.loads(line.split("=", 1)[1])
                    print(f"{name}: {got}")
                    check(got["attention_backend"] == "dsa" and got["dsa_prefill_backend"] == "flashmla_sparse"
                          and got["dsa_decode_backend"] == "flashmla_sparse" and got["kv_cache_dtype"] == "bfloat16"
                          and str(got["enable_hisparse"]) == str(arm != "a" and spec.role != "prefill")
                          and got["disaggregation_mode"] == (spec.role or "null")
                          and (not spec.role or (got["disaggregation_transfer_backend"] == "mooncake" and got["mc_force_tcp"] == "1"
                                                 and got["disable_radix_cache"])),
                          f"{name} resolved args {got}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--torch-python", default=sys.executable, help="python that runs the mock server")
    ap.add_argument("--server-args-python", default=None, help="python with sglang==0.5.17 installed")
    ap.add_argument("--skip-mock", action="store_true")
    ap.add_argument("--part2", type=Path, default=None,
                    help="a built part 2 (.e2e/parts/part2.tar.xz): install it and run mooncake_check.py (needs --py312)")
    ap.add_argument("--py312", default=None, help="a Python 3.12 (the Mooncake wheel is cp312)")
    a = ap.parse_args()
    unit_checks()
    selftest_bundle.bundle_checks(check)
    if a.part2:
        if not a.py312:
            ap.error("--part2 needs --py312")
        selftest_bundle.part2_checks(check, a.part2, a.py312, selftest_bundle.default_cudart_dir(a.torch_python))
    if not a.skip_mock:
        mock_e2e(a.torch_python)
    if a.server_args_python:
        server_args_check(a.server_args_python)
    print(f"{PASSES} passed, {len(FAILS)} failed")
    for f in FAILS:
        print("  FAILED:", f)
    return 1 if FAILS else 0


if __name__ == "__main__":
    sys.exit(main())
