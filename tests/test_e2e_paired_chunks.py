"""benchmarks/e2e/paired_decode.py with ``--steady``: each arm's pace per streamed chunk (one verify step of a
speculative server) and its tokens per chunk, apart, beside SGLang's accept length."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

E2E = Path(__file__).resolve().parents[1] / "benchmarks" / "e2e"
sys.path.insert(0, str(E2E))

import paired_decode  # noqa: E402
import stats  # noqa: E402


def arrivals(step_s: float, tokens: list[int], start: float = 100.0) -> list[tuple[float, int]]:
    """One chunk every ``step_s`` seconds carrying ``tokens[i]`` tokens (cumulative counts, as read_stream keeps)."""
    out, total = [], 0
    for i, n in enumerate(tokens):
        total += n
        out.append((start + i * step_s, total))
    return out


def test_a_chunk_is_timed_apart_from_the_tokens_it_brings():
    # 3 ms per step: 4 tokens then 2 alternately -> 3 tokens per chunk, 1 ms per token.
    trace = arrivals(0.003, [1, 4, 2, 4, 2, 4, 2])
    seconds, tokens = stats.window_chunks(trace, (100.0, 200.0))
    assert seconds == pytest.approx(0.003) and tokens == pytest.approx(3.0)
    assert stats.window_tpot(trace, (100.0, 200.0)) == pytest.approx(0.001)
    # Only the chunks inside the window count: the last three (100.012 .. 100.018).
    seconds, tokens = stats.window_chunks(trace, (100.0115, 200.0))
    assert seconds == pytest.approx(0.003) and tokens == pytest.approx(3.0)
    assert stats.window_chunks(trace, (100.0175, 200.0)) is None  # one chunk: no pace


def test_each_level_records_the_chunk_pace_and_accept_length_of_its_requests(monkeypatch):
    row = {"tpot_ms_per_request": [1.0, 1.2], "errors": [], "steady_tpot_ms_per_request": [1.1, 1.3],
           "steady_chunk_ms_per_request": [3.0, 4.0], "steady_tokens_per_chunk_per_request": [3.0, 2.5],
           "speculative": {"accept_length": 2.75, "verify_steps": 100},
           "arrivals": [[[0.5, 1], [0.51, 4]], [[0.6, 1], [0.61, 3]]], "steady_window": [0.6, 0.61]}
    monkeypatch.setattr(paired_decode, "run_level", lambda *args, **kwargs: row)
    out = paired_decode.decode_level(None, [[1], [2]], 16, steady=True)
    assert out == {"tpot_ms": 1.1, "accept_length": 2.75, "steady_ms": 1.2, "chunk_ms": 3.5, "tokens_per_chunk": 2.75,
                   "arrivals": {"requests": row["arrivals"], "steady_window": [0.6, 0.61]}}
    # A request whose chunks gave no pace: no chunk figures for the level (an average of some requests is no level's).
    row["steady_chunk_ms_per_request"], row["steady_tokens_per_chunk_per_request"] = [3.0], [3.0]
    assert "chunk_ms" not in paired_decode.decode_level(None, [[1], [2]], 16, steady=True)


def test_the_chunk_table_compares_the_arms_per_round_and_shows_the_tokens_per_chunk():
    variants = ["a+mtp", "c+mtp"]
    rounds = []
    for r, (a, c) in enumerate([(3.0, 3.3), (4.0, 4.0), (3.0, 3.6)]):
        rounds.append({"round": r, "cpu": 2, "order": variants, "tpot_ms": {v: {"1": 1.0} for v in variants},
                       "chunk_ms": {"a+mtp": {"1": a}, "c+mtp": {"1": c}},
                       "tokens_per_chunk": {"a+mtp": {"1": 3.0}, "c+mtp": {"1": 2.5 + r / 4}},
                       "accept_length": {"a+mtp": {"1": 3.0}, "c+mtp": {"1": 2.9}}})
    chunks = paired_decode.summarize(variants, [1], rounds, 0.05, metric="chunk_ms")
    assert chunks["1"]["ratio"]["c+mtp / a+mtp"]["median"] == pytest.approx(1.1)
    meta = {"rounds": 3, "cpus": [2], "park_cpu": 1, "client_cpu": 0, "input_len": 8, "output_len": 4, "within": 0.05}
    summary = paired_decode.summarize(variants, [1], rounds, 0.05)
    text = paired_decode.render(variants, summary, meta, rounds, chunks=chunks)
    assert "a+mtp ms per chunk, median" in text and "**1.100**" in text
    assert "| 1 | 3.0 / 3.0 | 2.75 / 2.9 |" in text  # tokens per chunk / accept length, medians over the rounds


def test_a_level_keeps_each_requests_arrivals_on_the_levels_clock(tmp_path, monkeypatch):
    """Every chunk's arrival, in seconds since the level was sent, and the window on the same clock: where in a
    request its steps slowed (a stall after the last prefill, a slow step every page), which a mean hides."""
    import phases

    clock = iter([50.0, 50.2])  # the level's start, then its end (time.perf_counter in run_level)
    monkeypatch.setattr(phases.time, "perf_counter", lambda: next(clock))
    traces = {1: arrivals(0.01, [1, 3, 3, 3], start=50.10), 2: arrivals(0.01, [1, 3, 3], start=50.12)}

    class Endpoint:
        def generate_stream(self, ids, out_len, timeout, trace):
            assert trace
            a = traces[ids[0]]
            return {"tokens": a[-1][1], "e2e_s": a[-1][0] - 50.0, "ttft_s": a[0][0] - 50.0,
                    "tpot_s": (a[-1][0] - a[0][0]) / (a[-1][1] - 1), "t0": 50.0, "arrivals": a}

    log = tmp_path / "server.log"
    log.write_text("")
    target = type("Target", (), {"endpoint": Endpoint(), "log_path": log})()
    row = phases.run_level(target, [[1], [2]], 16, timeout=5, steady=True)
    assert row["arrivals"][0] == [[0.1, 1], [0.11, 4], [0.12, 7], [0.13, 10]]
    assert row["arrivals"][1] == [[0.12, 1], [0.13, 4], [0.14, 7]]
    assert row["steady_window"] == [0.12, 0.13]  # the last request's first chunk .. the first request's last


def test_the_usual_step_and_a_held_up_step_are_told_apart():
    # Two requests at 10 ms per step; the second is held up once by 25 ms (a 35 ms step).
    first = arrivals(0.010, [1, 3, 3, 3, 3, 3])
    second = [(100.0, 1), (100.01, 4), (100.02, 7), (100.055, 10), (100.065, 13), (100.075, 16)]
    median, stall = stats.window_pace([first, second], (100.0, 200.0))
    assert median == pytest.approx(0.010) and stall == pytest.approx(0.025 / 2)  # per request
    # The pace ignores a slower step that is not held up (under twice the median): no stall.
    assert stats.window_pace([arrivals(0.010, [1, 3, 3]), arrivals(0.019, [1, 3, 3])], (100.0, 200.0))[1] == 0
    assert stats.window_pace([first], (300.0, 400.0)) is None


def test_each_round_gets_the_pace_and_stall_of_its_arms_from_the_arrivals():
    rounds = [{"arrivals": {"c+mtp": {"2": {"requests": [[[0.1, 1], [0.11, 4], [0.12, 7], [0.16, 10], [0.17, 13]]],
                                            "steady_window": [0.1, 0.2]},
                                      "4": {"requests": [[[0.1, 1]]], "steady_window": None}}}},
              {"round": 1}]  # a run written before arrivals were kept
    paired_decode.add_pace(rounds)
    assert rounds[0]["pace_ms"] == {"c+mtp": {"2": 10.0}} and rounds[0]["stall_ms"] == {"c+mtp": {"2": 30.0}}
    assert "pace_ms" not in rounds[1]
