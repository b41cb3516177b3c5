"""The plugin's metrics on SGLang's /metrics endpoint: SGLang's naming and labels, values equal to the
coordinator's reports and to its log line (metrics_peer.py runs one scheduler process's worth on the CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.sglang

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks" / "e2e"))
import scrape  # noqa: E402

from hisparse_sglang.integration.sglang.metrics import METRICS  # noqa: E402


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    directory = tmp_path_factory.mktemp("prometheus")
    out = directory / "out.json"
    env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=str(directory / "multiproc"),
               PYTHONPATH=os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]))
    (directory / "multiproc").mkdir()
    completed = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("metrics_peer.py")), str(out)],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    return json.loads(out.read_text())


def test_every_plugin_metric_is_served_with_sglangs_scheduler_labels(exported):
    samples = scrape.parse_samples(exported["metrics_text"])
    sglang_own = [labels for name, labels, _ in samples if name == "sglang:num_running_reqs"]
    assert sglang_own == [exported["labels"]]
    ours = {name: labels for name, labels, _ in samples if name.startswith("sglang:hisparse_")}
    assert set(ours) == {spec.name for spec in METRICS}
    assert all(labels == exported["labels"] for labels in ours.values())
    types = dict(line.split()[2:4] for line in exported["metrics_text"].splitlines() if line.startswith("# TYPE"))
    for spec in METRICS:
        assert types[spec.name] == spec.kind, spec.name
        assert spec.name.startswith("sglang:hisparse_") and (spec.kind == "gauge") != spec.name.endswith("_total")


def test_gauges_hold_the_last_report_and_counters_the_sum_of_all(exported):
    reports = exported["reports"]
    last = reports[-1]
    values = scrape.plugin_values(exported["metrics_text"])
    assert last["demotions_total"] >= 1 and last["lookups_total"] > 0, "the run must demote and swap in"
    for spec in METRICS:
        if spec.kind == "gauge":
            assert values[spec.key] == pytest.approx(last[spec.key]), spec.name
        elif spec.cumulative:
            assert values[spec.key] == last[spec.key], spec.name
        else:
            assert values[spec.key] == sum(report[spec.key] for report in reports), spec.name
    assert values["lookups"] == last["lookups_total"] and values["misses"] == last["misses_total"]


def test_scraped_metrics_agree_with_the_log_line(exported):
    values = scrape.plugin_values(exported["metrics_text"])
    check = scrape.compare_with_log(values, exported["log_text"])
    assert check["mismatches"] == [] and check["lines"] == len(exported["reports"])
    # a log line that says otherwise is caught
    last_line = exported["log_text"].strip().splitlines()[-1]
    changed = last_line.replace(f"resident {exported['reports'][-1]['resident']},", "resident 99,")
    assert changed != last_line
    check = scrape.compare_with_log(values, exported["log_text"].replace(last_line, changed))
    assert check["mismatches"] == [f"resident: metric {values['resident']:g}, log 99 (tolerance 0)"]


def test_a_report_without_lookups_exports_no_hit_rate(exported):
    assert exported["reports"][0]["hit_rate"] is None
    first = scrape.plugin_values(exported["metrics_text_first"])
    assert first["hit_rate"] is None and first["lookups"] == 0 and first["resident"] == 0
    assert scrape.parse_log_lines(exported["log_text"])[0]["hit_rate"] is None
