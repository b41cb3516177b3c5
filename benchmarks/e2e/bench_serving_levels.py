"""Run ``python -m sglang.bench_serving`` for several argument lists in one Python process.

    python bench_serving_levels.py PLAN.json STATUS.jsonl

PLAN.json is a list of ``{"argv": [...], "log": "path"}``: for each, in order, the module
``sglang.bench_serving`` is executed as ``python -m sglang.bench_serving <argv>`` executes it
(``runpy.run_module`` as ``__main__``, ``sys.argv`` set to the argv), its stdout and stderr going to
``log``; then ``{"index", "rc", "wall_s"}`` is appended to STATUS.jsonl. Python caches the modules the
first run imports (SGLang, transformers: ~30 s on the GPU machine), so the later levels start in a
second or two; each run parses its own argv and writes its own ``--output-file``. Used by
bench_serving_phase.run_bench_serving(one_process=True); nothing of SGLang is copied here.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import time
import traceback


def run_one(argv: list[str], log_path: str) -> int:
    """One bench_serving run with fds 1 and 2 sent to ``log_path``; its exit code."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(log_path, "wb") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        sys.argv = ["sglang.bench_serving", *argv]
        try:
            runpy.run_module("sglang.bench_serving", run_name="__main__", alter_sys=True)
            rc = 0
        except SystemExit as exc:
            rc = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException:  # noqa: BLE001 - a failed level must not stop the next one
            traceback.print_exc()
            rc = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
    for fd in saved:
        os.close(fd)
    return rc


def main() -> int:
    plan_path, status_path = sys.argv[1:3]
    with open(plan_path) as f:
        plan = json.load(f)
    worst = 0
    for index, item in enumerate(plan):
        started = time.monotonic()
        rc = run_one(item["argv"], item["log"])
        worst = worst or rc
        with open(status_path, "a") as status:
            status.write(json.dumps({"index": index, "rc": rc, "wall_s": round(time.monotonic() - started, 1)}) + "\n")
        print(f"level {index}: rc {rc} in {time.monotonic() - started:.1f} s", flush=True)
    return 0 if worst == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
