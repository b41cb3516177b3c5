"""Plumbing every module of the e2e harness shares: paths, the run log, the deadline, atomic writes."""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
HOST = "127.0.0.1"


class Deadline:
    """The wall-clock budget of one invocation."""

    def __init__(self, seconds: float):
        self.t0 = time.monotonic()
        self.seconds = seconds

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.t0)

    def elapsed(self) -> float:
        return time.monotonic() - self.t0


class Log:
    """Timestamped lines to stdout and to every file given (appended, line-buffered).

    One object per run, passed to whatever logs; ``Log([])`` prints only."""

    def __init__(self, paths: list[Path]):
        self.files = []
        for p in paths:
            p.parent.mkdir(parents=True, exist_ok=True)
            self.files.append(open(p, "a", buffering=1))
        self.t0 = time.monotonic()
        self.lock = threading.Lock()

    def __call__(self, msg: str) -> None:
        line = f"[e2e {time.monotonic() - self.t0:7.1f}s] {msg}"
        with self.lock:
            print(line, flush=True)
            for f in self.files:
                f.write(line + "\n")


def atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


@dataclasses.dataclass
class Run:
    """What every phase of one invocation needs: the options, the model's vocabulary, the deadline, the
    log, and when the invocation started (ISO time; it tells results of one invocation apart)."""

    args: object
    vocab: int
    deadline: Deadline
    log: Log
    started: str = ""
