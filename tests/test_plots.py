"""benchmarks/plots.py: the series it reads from e2e results (GPU runs, extracted into tests/data/e2e_runs.json,
which tests/test_data_files.py checks against git), and the PNGs it draws of the committed results."""

from __future__ import annotations

import importlib.util
import json
import struct
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import plots  # noqa: E402


def load(name: str) -> dict:
    """The extract of one e2e result file, as tests/data/e2e_runs.json keeps it."""
    return json.loads((REPO / "tests" / "data" / "e2e_runs.json").read_text())["files"][name]


def test_throughput_levels_per_arm():
    series = plots.level_series(load("e2e_bcd_H100_2026-11-22.json"))
    assert sorted(series) == ["b", "c", "d"]
    c = series["c"]
    assert (c["phase"], c["input_len"], c["output_len"]) == ("throughput", 16384, 256)
    # docs/lab-notes/gpu-e2e-2026-11-22.md: c at concurrency 1 and 8: 411.1 tok/s, 2.12 ms; 1526.7 tok/s, 3.86 ms (median TPOT)
    assert c["points"][:2] == [(1, [411.1], [2.122]), (8, [1526.7], [3.861])]
    assert [point[0] for point in c["points"]] == [1, 8, 32, 36]


def test_repeated_levels_keep_every_run():
    series = plots.level_series(load("e2e_saturation_cd_H100_2026-11-22.json"))
    levels = {level: throughput for level, throughput, _ in series["c"]["points"]}
    assert sorted(levels) == [8, 35] and all(len(runs) == 2 for runs in levels.values())
    assert sorted(levels[8]) == pytest.approx([2244, 2301], abs=1)  # docs/lab-notes/gpu-e2e-2026-11-22.md
    lowload = plots.level_series(load("e2e_H200_2026-11-24.json"))
    assert sorted(lowload) == ["a", "b", "c", "d"] and lowload["a"]["phase"] == "lowload"
    assert all(len(runs) == 3 for _, runs, _ in lowload["a"]["points"])  # 3 repeats per level


def test_ticks_leave_out_crowded_levels():
    assert plots.readable_ticks([1, 8, 31, 32, 35, 36]) == [1, 8, 31]
    assert plots.readable_ticks([1, 2, 4, 8]) == [1, 2, 4, 8]


def test_every_result_with_levels_has_its_committed_png():
    expected = {f"{path.stem}.png" for path in sorted(plots.RESULTS.glob("e2e_*.json"))
                if plots.level_series(json.loads(path.read_text()))}
    expected.add(plots.HIT_RATE_PNG)
    assert expected and expected == {path.name for path in (REPO / "docs" / "img").glob("*.png")}


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="needs matplotlib (pip install '.[plots]')")
def test_the_command_draws_small_pngs(tmp_path):
    assert plots.main(["--out", str(tmp_path)]) == 0
    pngs = sorted(tmp_path.glob("*.png"))
    with_levels = [path for path in plots.RESULTS.glob("e2e_*.json") if plots.level_series(json.loads(path.read_text()))]
    assert with_levels and len(pngs) == len(with_levels) + 1  # and the hit rate against buffer size
    for png in pngs:
        data = png.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) < plots.MAX_PNG_BYTES
        width, height = struct.unpack(">II", data[16:24])
        assert (width, height) == (int(plots.FIGURE_SIZE[0] * plots.DPI), int(plots.FIGURE_SIZE[1] * plots.DPI))


def test_the_title_names_a_replaced_top_k_workload():
    """A run whose indexer top-k the workload model replaced (run_e2e.py --topk-profile) says so in its plot's title:
    its figures are not comparable with the tiny model's own indexer's."""
    assert plots.workload_note({"meta": {"args": {"topk_profile": "calibrated"}}}) == ", top-k workload calibrated"
    assert plots.workload_note({"meta": {"args": {"topk_profile": "off"}}}) == ""
    assert plots.workload_note({"meta": {"args": {}}}) == ""



def test_hit_rate_curves_rise_with_the_buffer_and_order_the_profiles():
    """The hit-rate plot's data: every profile's hit rate grows with the slots; high locality above calibrated above
    low locality above random at every size; calibrated at 2k slots near its fitted 70-74 % (docs/workload.md)."""
    curves = plots.hit_rate_curves()
    assert set(curves) == {"random", "calibrated", "high-locality", "low-locality"}
    for curve in curves.values():
        rates = [curve[s] for s in sorted(curve)]
        assert rates == sorted(rates) and sorted(curve) == [2048, 3072, 4096, 6144, 8192]
    for slots in curves["random"]:
        order = [curves[name][slots] for name in ("high-locality", "calibrated", "low-locality", "random")]
        assert order == sorted(order, reverse=True)
    assert 0.70 <= curves["calibrated"][2048] <= 0.74
