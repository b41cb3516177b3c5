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
           "speculative": {"accept_length": 2.75, "verify_steps": 100}}
    monkeypatch.setattr(paired_decode, "run_level", lambda *args, **kwargs: row)
    out = paired_decode.decode_level(None, [[1], [2]], 16, steady=True)
    assert out == {"tpot_ms": 1.1, "accept_length": 2.75, "steady_ms": 1.2, "chunk_ms": 3.5, "tokens_per_chunk": 2.75}
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
