"""The serving phase's pieces that need no server of SGLang's (benchmarks/e2e/bench_serving_phase.py): the /metrics
check against a live HTTP endpoint and a server log (and that it fails when they disagree), the failures it
records, bench_serving beside the own client in the report, and the one-process driver of the levels
(bench_serving_levels.py) on a stand-in ``sglang.bench_serving``. The whole phase runs end to end against the
mock server in tools/e2e-selftest (tests/test_e2e_selftest.py); the real bench_serving against a fake
/generate in tests/sglang/test_tiny_tokenizer.py."""

from __future__ import annotations

import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "e2e"))
import bench_serving_phase as bsp  # noqa: E402
from test_scrape import FIGURES as SCRAPE_FIGURES  # noqa: E402
from test_scrape import LINE as SCRAPE_LINE  # noqa: E402

from hisparse_sglang.integration.sglang.metrics import METRICS  # noqa: E402

# test_scrape's line with nothing quarantined; what the plugin exports with two such lines (gauges: the last
# line; the bytes counter: both lines' moved)
LINE = SCRAPE_LINE.replace("(quarantined 128)", "(quarantined 0)")
assert "(quarantined 0)" in LINE, "test_scrape.LINE changed: update this derivation"
FIGURES = {**SCRAPE_FIGURES, "host_rows_quarantined": 0}
LABELS = 'engine_type="unified",model_name="m",moe_ep_rank="0",pp_rank="0",tp_rank="0"'


def exposition(values: dict) -> str:
    lines = [f"sglang:num_running_reqs{{{LABELS}}} 0.0"]
    for spec in METRICS:
        if spec.key in values:
            lines += [f"# TYPE {spec.name} {spec.kind}", f"{spec.name}{{{LABELS}}} {float(values[spec.key])}"]
    return "\n".join(lines) + "\n"


class Metrics(BaseHTTPRequestHandler):
    text = ""

    def log_message(self, *args):
        pass

    def do_GET(self):
        body = self.text.encode()
        self.send_response(200 if self.path == "/metrics" else 404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def metrics_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


def server_log(tmp_path: Path, lines: int) -> Path:
    """A server log as the harness appends it: an earlier start whose lines must not count, then this start's."""
    log = tmp_path / "server-c.log"
    log.write_text("===== run_e2e.py arm c start 1 =====\n" + (LINE + "\n") * 5
                   + "===== run_e2e.py arm c start 2 =====\n" + (LINE + "\n") * lines)
    return log


def test_metrics_check_agrees_with_the_log_of_this_start(tmp_path, metrics_server):
    Metrics.text = exposition(FIGURES)
    check = bsp.metrics_check(metrics_server.server_address[1], server_log(tmp_path, 2))
    assert check["ok"] and check["mismatches"] == [] and check["lines"] == 2
    assert check["metrics"]["resident"] == 3 and check["log"]["offloaded"] == 33


@pytest.mark.parametrize(("mutation", "expected"), [
    ({"resident": 4}, "resident: metric 4, log 3 (tolerance 0)"),
    ({"host_rows_used": 820353}, "host_rows_used: metric 820353, log 820352 (tolerance 0)"),
    ({"hit_rate": 0.9}, "hit_rate: metric 0.9, log 0.975 (tolerance 0.0005)"),
    ({"bytes_moved": 4.5 * 2**20}, "bytes_moved: counter 4.50 MiB, the 2 log lines sum to 3.00 MiB"),
])
def test_metrics_check_fails_when_metrics_and_log_disagree(tmp_path, metrics_server, mutation, expected):
    Metrics.text = exposition(FIGURES | mutation)
    check = bsp.metrics_check(metrics_server.server_address[1], server_log(tmp_path, 2))
    assert not check["ok"] and check["mismatches"] == [expected]
    result = {"arm": "c", "serving": {"metrics_check": check}, "throughput": {"metrics_check": {"ok": True}}}
    logged = []
    failures = bsp.record_check_failures(result, ["throughput", "serving"], logged.append)
    assert failures == result["check_failures"] == [f"serving: /metrics disagrees with the plugin's log line: {expected}"]
    assert logged == [f"arm c: CHECK FAILED: {failures[0]}"]
    # a check of a phase not run now does not fail this run
    assert bsp.record_check_failures(result, ["throughput"], logged.append) == [] and "check_failures" not in result


def test_metrics_check_fails_without_the_plugins_metrics_or_its_line(tmp_path, metrics_server):
    Metrics.text = f"sglang:num_running_reqs{{{LABELS}}} 0.0\n"
    check = bsp.metrics_check(metrics_server.server_address[1], server_log(tmp_path, 2))
    assert not check["ok"] and "no sglang:hisparse_* metric" in check["error"]
    Metrics.text = exposition(FIGURES)
    check = bsp.metrics_check(metrics_server.server_address[1], server_log(tmp_path, 0))
    assert not check["ok"] and check["mismatches"] == ["no 'HiSparse: hit rate' line in the log"]


def bench_level(n: int, tok_s: float, tpot: float, ttft: float, prompts_per_level: int = 2) -> dict:
    summary = {"completed": prompts_per_level * n, "output_throughput": tok_s, "median_tpot_ms": tpot,
               "median_ttft_ms": ttft}
    return {"max_concurrency": n, "num_prompts": prompts_per_level * n, "ok": True, "summary": summary}


def own_level(n: int, tok_s: float, tpot: float, ttft_s: float) -> dict:
    return {"level": n, "concurrency": n, "ok": n, "output_tok_s": tok_s, "tpot_ms_median": tpot, "ttft_s_median": ttft_s}


def arm_result() -> dict:
    settings = {"levels": [1, 8], "input_len": 16384, "output_len": 1024, "prompts_per_level": 2, "dataset": "random",
                "random_range_ratio": 1.0, "one_process": True}
    return {
        "capacity": {"max_running": 7},
        "throughput": {"input_len": 16384, "output_len": 256,
                       "levels": [own_level(1, 360.0, 2.2, 0.14), own_level(8, 1500.0, 4.0, 0.9)]},
        "lowload": {"settings": {"input_len": 16384, "output_len": 1024},
                    "runs": [own_level(8, 2000.0, 4.1, 0.8), own_level(8, 2100.0, 4.3, 1.0)]},
        "serving": {"settings": settings, "same_server_phases": ["throughput"],
                    "levels": [bench_level(1, 370.0, 2.25, 137.0), bench_level(8, 2400.0, 4.2, 500.0)]},
    }


def test_bench_serving_beside_the_own_client_and_why_they_differ():
    one, eight = bsp.compare_clients(arm_result())
    # level 1: only the throughput phase ran it; within 15 %, but the lengths differ
    assert one["own"]["phase"] == "throughput" and one["differs"] == []
    assert one["ratio"] == {"output_tok_s": pytest.approx(1.028, abs=1e-3), "tpot_ms": pytest.approx(1.023, abs=1e-3),
                            "ttft_ms": pytest.approx(0.979, abs=1e-3)}
    assert len(one["why"]) == 1 and one["why"][0].startswith("the lengths differ (bench_serving 16384+1024, own 16384+256)")
    # level 8: the lowload phase has the same lengths (medians over its repeats), from another server start
    assert eight["own"] == {"phase": "lowload", "input_len": 16384, "output_len": 1024, "runs": 2,
                            "output_tok_s": 2050.0, "tpot_ms": 4.2, "ttft_ms": 900.0}
    assert eight["differs"] == ["output_tok_s", "ttft_ms"]
    assert [w.split(" ")[0:3] for w in eight["why"]] == [["bench_serving", "sends", "16"], ["the", "server", "runs"],
                                                          ["the", "own", "client's"]]
    md = "\n".join(bsp.render_serving({"c": arm_result()}, ["c"]))
    assert "| c | 8 | 16 of 16 | 2400.0 / 2050.0 | 4.20 / 4.20 | 500 / 900 | lowload, 16384+1024 | output_tok_s, ttft_ms |" in md
    assert "| c | 1 | 2 of 2 | 370.0 / 360.0 | 2.25 / 2.20 | 137 / 140 | throughput, 16384+256 | no |" in md
    assert "- c, N=8: bench_serving / own output_tok_s 1.17, ttft_ms 0.56. bench_serving sends 16 requests" in md
    assert "--random-range-ratio 1 --num-prompts 2N --max-concurrency N" in md


def test_report_shows_each_metrics_check():
    arms = {"c": {"serving": {"metrics_check": {"ok": False, "lines": 2, "mismatches": ["resident: metric 4, log 3"],
                                                "metrics": dict(FIGURES, resident=4)}},
                  "throughput": {"metrics_check": {"ok": True, "lines": 1, "mismatches": [], "metrics": FIGURES}}}}
    md = "\n".join(bsp.render_serving(arms, ["c"]))
    assert "| c | throughput | yes | 1 | 3 / 33 | 97.5 % | 130944 | 820352 | 3.0 | – |" in md
    assert "| c | serving | NO | 2 | 4 / 33 | 97.5 % | 130944 | 820352 | 3.0 | resident: metric 4, log 3 |" in md


STAND_IN = '''
import argparse, json, sys
ap = argparse.ArgumentParser()
ap.add_argument("--max-concurrency", type=int); ap.add_argument("--num-prompts", type=int); ap.add_argument("--output-file")
a, _ = ap.parse_known_args()
print("stand-in bench_serving", a.max_concurrency)
if a.max_concurrency == 2:
    sys.exit(3)
with open(a.output_file, "a") as f:
    f.write(json.dumps({"completed": a.num_prompts, "max_concurrency": a.max_concurrency, "output_throughput": 10.0,
                        "median_tpot_ms": 1.0, "median_ttft_ms": 5.0}) + "\\n")
'''


@pytest.mark.parametrize("one_process", [True, False], ids=["one process", "process per level"])
def test_levels_run_in_order_and_a_failed_level_does_not_stop_the_next(tmp_path, one_process):
    site = tmp_path / "site"
    (site / "sglang").mkdir(parents=True)
    (site / "sglang" / "__init__.py").write_text("")
    (site / "sglang" / "bench_serving.py").write_text(STAND_IN)
    seen = []
    rows = bsp.run_bench_serving(
        python=sys.executable, port=9, model_dir=Path("/nonexistent"), levels=[1, 2, 4], out_dir=tmp_path / "out",
        env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}, dataset_name="random-ids", timeout_s=60,
        one_process=one_process, log=lambda line: None, after_level=seen.append)
    assert [row["max_concurrency"] for row in rows] == [1, 2, 4] and seen == rows
    assert [row["ok"] for row in rows] == [True, False, True] and [row["rc"] for row in rows] == [0, 3, 0]
    assert rows[2]["summary"]["completed"] == 8 and rows[2]["cmd"][1:3] == ["-m", "sglang.bench_serving"]
    assert "exit code 3; completed None of 4" in rows[1]["error"] and "stand-in bench_serving 2" in rows[1]["error"]
    assert (tmp_path / "out" / "level_4.log").read_text().strip() == "stand-in bench_serving 4"


def test_no_level_starts_without_time_left(tmp_path):
    rows = bsp.run_bench_serving(
        python=sys.executable, port=9, model_dir=Path("/nonexistent"), levels=[1], out_dir=tmp_path,
        dataset_name="random-ids", time_left=lambda: 5.0, log=lambda line: None)
    assert rows[0]["rc"] is None and not rows[0]["ok"] and "not run (time ran out)" in rows[0]["error"]
