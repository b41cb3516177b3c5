"""The GPU harness's reader of a streamed /generate response (benchmarks/e2e/client.py), which the
throughput, storm and chaos phases share: data lines up to [DONE], token counts, and an error event."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "e2e"))
import client  # noqa: E402


def _sse(*events) -> list[bytes]:
    lines = [b": keep-alive\n"]
    for event in events:
        lines.append(b"data: " + (event if isinstance(event, bytes) else json.dumps(event).encode()) + b"\n")
        lines.append(b"\n")
    return lines


def test_events_stop_at_done_and_skip_other_lines():
    chunk = {"meta_info": {"completion_tokens": 1}}
    assert list(client.stream_events(_sse(chunk, b"[DONE]", {"after": "done"}))) == [chunk]


def test_read_stream_counts_tokens_and_the_finish():
    events = [{"meta_info": {"completion_tokens": n}} for n in (1, 2, 3)]
    events[-1]["meta_info"]["finish_reason"] = {"type": "length"}
    out = client.read_stream(_sse(*events, b"[DONE]"), time.perf_counter())
    assert out["tokens"] == 3 and out["finish"] == {"type": "length"} and out["tpot_s"] is not None


def test_read_stream_reports_an_error_event():
    events = [{"meta_info": {"completion_tokens": 1}}, {"error": {"message": "aborted"}}]
    assert client.read_stream(_sse(*events), time.perf_counter()) == {"error": str({"message": "aborted"})}
