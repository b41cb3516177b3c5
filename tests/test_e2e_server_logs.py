"""A server's log as the GPU harness keeps it (benchmarks/e2e: servers.py, logs.py): logs append across the
server lives of a state directory (a warm machine reuses it), and what a tool summarizes of a server is its own
life only."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

E2E = Path(__file__).resolve().parents[1] / "benchmarks" / "e2e"
sys.path.insert(0, str(E2E))

import logs  # noqa: E402
from servers import Server  # noqa: E402


def plugin_line(resident: int) -> str:
    """The plugin's periodic log line as a server on an H200 wrote it."""
    return (f"[2026-11-27 20:43:26] HiSparse: hit rate n/a, moved 0.0 MiB, resident {resident}, offloaded 0 "
            f"(promoting 0), demotions 0.0/min, promotions 0.0/min, device rows 66048/131072, host rows "
            f"66048/1048576 (quarantined 0), switch work max 0.00 ms/step, step host work 0.063 ms (max 0.42), "
            f"verify caps 0 (0 drafts dropped)")


def two_lives(path: Path, earlier: int, later: int) -> None:
    path.write_text(f"\n{logs.START_MARK}c+mtp start 1 =====\n" + (plugin_line(earlier) + "\n") * 3
                    + f"\n{logs.START_MARK}c+mtp start 2 =====\n" + (plugin_line(later) + "\n") * 2)


def test_a_servers_summary_reads_only_its_own_life(tmp_path):
    log = tmp_path / "server-profile-c-mtp.log"
    two_lives(log, earlier=4, later=1)  # a concurrency-4 run, then a concurrency-1 run on the same machine
    summary = logs.summarize_hisparse(logs.log_since_start(log))
    assert summary["lines"] == 2 and summary["resident_max"] == 1


def test_a_log_without_a_start_mark_is_read_whole(tmp_path):
    log = tmp_path / "server.log"
    log.write_text(plugin_line(2) + "\n")
    assert logs.log_since_start(log) == plugin_line(2) + "\n"
    assert logs.log_since_start(tmp_path / "absent.log") == ""


def test_each_start_of_a_server_marks_its_life_in_the_appended_log(tmp_path):
    log = tmp_path / "server-x.log"
    two_lives(log, earlier=4, later=3)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = Server("x", [sys.executable, "-c", f"print({plugin_line(1)!r})"], {}, log, port, tmp_path, print)
    server.start()
    server.proc.wait(timeout=60)
    server.logf.close()
    text = logs.log_since_start(log)
    assert text.startswith(f"{logs.START_MARK}x start ")
    assert logs.summarize_hisparse(text)["resident_max"] == 1
    assert "resident 4" in log.read_text()  # the earlier lives stay in the file
