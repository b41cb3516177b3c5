"""The GPU end-to-end harness's CPU self-test (tools/e2e-selftest/selftest.py) passes.

It runs in a process of its own, as documented (docs/gpu-e2e.md, section 5): the harness's unit checks,
the bundle builder's .deb and ELF checks (tools/gpu-bundle/), and whole runs of benchmarks/e2e/run_e2e.py
against a fake SGLang server that runs under this interpreter (incl. the serving phase and its /metrics
check, with SGLang's own bench_serving where this interpreter has it). About 3 minutes with this suite's
Python on a 2-core machine (the fake server then also runs the weight-init fixture with torch).
"""

import pathlib
import re
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
SELFTEST = REPO / "tools" / "e2e-selftest" / "selftest.py"


def test_the_harness_self_test_passes():
    result = subprocess.run([sys.executable, str(SELFTEST)], capture_output=True, text=True, timeout=900, cwd=REPO)
    failures = [line for line in result.stdout.splitlines() if line.startswith(("FAIL:", "  FAILED:"))]
    summary = re.search(r"^(\d+) passed, (\d+) failed$", result.stdout, re.MULTILINE)
    assert result.returncode == 0 and summary and summary.group(2) == "0", (
        f"{SELFTEST.relative_to(REPO)} exited {result.returncode}: {summary.group(0) if summary else 'no summary'}\n"
        + "\n".join(failures[:20])
        + f"\n--- stdout tail\n{result.stdout[-3000:]}\n--- stderr tail\n{result.stderr[-3000:]}"
    )
    assert int(summary.group(1)) > 0, "the self-test ran no check"
