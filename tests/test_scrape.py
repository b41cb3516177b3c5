"""benchmarks/e2e/scrape.py on synthetic /metrics texts and log lines (the end-to-end check against SGLang's
own endpoint is tests/sglang/test_metrics_sglang.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "e2e"))
import scrape  # noqa: E402

from hisparse_sglang.integration.sglang.metrics import METRICS  # noqa: E402

LINE = (
    "[2026-11-25 10:00:00 TP0] HiSparse: hit rate 97.5%, moved 1.5 MiB, resident 3, offloaded 33 (promoting 1), "
    "demotions 12.0/min, promotions 0.5/min, device rows 130944/131136, host rows 820352/1048640 (quarantined 128), "
    "switch work max 0.41 ms/step, step host work 0.110 ms (max 0.20)"
)
FIGURES = {
    "hit_rate": 0.975, "resident": 3, "offloaded": 33, "promoting": 1, "demotions_per_min": 12.0,
    "promotions_per_min": 0.5, "device_rows_used": 130944, "device_rows_total": 131136, "host_rows_used": 820352,
    "host_rows_total": 1048640, "host_rows_quarantined": 128, "switch_ms_max": 0.41, "step_host_ms": 0.11,
    "step_host_ms_max": 0.2, "lookups": 4000, "misses": 100, "bytes_moved": 3 * 2**20, "demotions_total": 7,
    "promotions_total": 2, "verify_rows_capped_total": 5, "verify_drafts_dropped_total": 9,
}


def exposition(values: dict, labels: str = 'model_name="m",tp_rank="0"') -> str:
    lines = ["# HELP sglang:num_running_reqs The number of running requests.",
             f"sglang:num_running_reqs{{{labels}}} 3.0"]
    for spec in METRICS:
        value = values[spec.key]
        lines += [f"# TYPE {spec.name} {spec.kind}", f"{spec.name}{{{labels}}} {'NaN' if value is None else value}"]
    return "\n".join(lines) + "\n"


def test_samples_keep_escaped_label_values_and_skip_comments():
    text = '# HELP x y\nm{a="q\\"u\\\\o\\nte",b="2"} 1.5e+06 1700000000\nplain 3\n'
    assert scrape.parse_samples(text) == [("m", {"a": 'q"u\\o\nte', "b": "2"}, 1.5e6), ("plain", {}, 3.0)]
    with pytest.raises(ValueError, match="not a Prometheus sample line"):
        scrape.parse_samples("m{a=1} x y z\n")


def test_plugin_values_of_one_label_set():
    text = exposition(FIGURES) + exposition(dict(FIGURES, resident=5), labels='model_name="m",tp_rank="1"')
    with pytest.raises(ValueError, match="2 label sets"):
        scrape.plugin_values(text)
    assert scrape.plugin_values(text, {"tp_rank": 1})["resident"] == 5
    assert scrape.plugin_values(text, {"tp_rank": "0"}) == FIGURES
    assert scrape.plugin_values(exposition(dict(FIGURES, hit_rate=None)))["hit_rate"] is None
    with pytest.raises(ValueError, match="no sglang:hisparse_"):
        scrape.plugin_values(text, {"tp_rank": "7"})


def test_log_line_fields():
    (line,) = scrape.parse_log_lines(LINE)
    assert line == {key: FIGURES[key] for key in scrape.LOG_TOLERANCE} | {"bytes_moved": 1.5 * 2**20}
    assert scrape.parse_log_lines(LINE.replace("97.5%", "n/a"))[0]["hit_rate"] is None


def test_compare_allows_the_lines_rounding_and_nothing_more():
    log = LINE + "\n" + LINE.replace("moved 1.5", "moved 1.5") + "\n"  # two lines: 3 MiB in all
    assert scrape.compare_with_log(FIGURES, log)["mismatches"] == []
    assert scrape.compare_with_log(dict(FIGURES, step_host_ms=0.1104), log)["mismatches"] == []
    assert scrape.compare_with_log(dict(FIGURES, step_host_ms=0.1106), log)["mismatches"] == [
        "step_host_ms: metric 0.1106, log 0.11 (tolerance 0.0005)"
    ]
    moved = scrape.compare_with_log(dict(FIGURES, bytes_moved=3.2 * 2**20), log)["mismatches"]
    assert moved == ["bytes_moved: counter 3.20 MiB, the 2 log lines sum to 3.00 MiB"]
    no_hit_rate = scrape.compare_with_log(dict(FIGURES, hit_rate=None), log)["mismatches"]
    assert no_hit_rate == ["hit_rate: metric None, log 0.975"]
    no_line = scrape.compare_with_log(FIGURES, "no plugin line")["mismatches"]
    assert no_line == ["no 'HiSparse: hit rate' line in the log"]


def test_verify_caps_of_the_log_lines_sum_to_the_counters():
    """With speculative decoding the line ends with the interval's verify caps; their sum over the lines must be
    the cap counters (a line without them, no speculation: nothing to compare)."""
    capped = [LINE + ", verify caps 2 (3 drafts dropped)", LINE + ", verify caps 3 (6 drafts dropped)"]
    lines = scrape.parse_log_lines("\n".join(capped))
    assert [(line["verify_rows_capped"], line["verify_drafts_dropped"]) for line in lines] == [(2, 3), (3, 6)]
    assert "verify_rows_capped" not in scrape.parse_log_lines(LINE)[0]
    log = "\n".join(capped + [LINE]) + "\n"  # three lines: 4.5 MiB moved
    figures = dict(FIGURES, bytes_moved=4.5 * 2**20)
    assert scrape.compare_with_log(figures, log)["mismatches"] == []
    assert scrape.compare_with_log(dict(figures, verify_drafts_dropped_total=8), log)["mismatches"] == [
        "verify_drafts_dropped: counter 8, the 3 log lines sum to 9"
    ]
    one_line = dict(figures, bytes_moved=1.5 * 2**20, verify_rows_capped_total=1)
    assert scrape.compare_with_log(one_line, LINE)["mismatches"] == []



def test_log_line_staging_counts_are_read_when_the_line_has_them():
    (line,) = scrape.parse_log_lines(LINE + ", prefills staged by DMA 12, by kernel 3")
    assert (line["prefills_staged_by_dma"], line["prefills_staged_by_kernel"]) == (12, 3)
    assert "prefills_staged_by_dma" not in scrape.parse_log_lines(LINE)[0]  # an older plugin's line
