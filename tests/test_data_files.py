"""tests/data/ holds what the GPU wrote: extracts of result files as one commit held them, for the tests that
check code against GPU runs (tests/test_plan.py, tests/test_plots.py, tests/test_bench_cli.py).

benchmarks/results/ keeps only what a doc quotes (tests/test_docs_results.py), so those tests do not read it.
Each extract names its commit in its header (``source``); the tests below rebuild it from that commit with git
and require the committed file to be exactly that, so a hand edit or a wrong provenance fails.

``python tests/test_data_files.py COMMIT`` writes both extracts from COMMIT's benchmarks/results/.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "data"
RESULTS = "benchmarks/results"

# Per arm of an e2e_*.json, what the tests read (a dict keeps its keys, of each element of a list; None keeps all):
# the server command and SGLang's memory report (hisparse-plan against SGLang's pools), the capacity phase's sizes
# and measured concurrency, and the throughput and low-load levels that benchmarks/plots.py draws.
E2E_ARM = {
    "cmd": None,
    "server_internal": {"memory_usage": None},
    "capacity": {"input_len": None, "output_len": None, "max_running_loads": None},
    "throughput": {"input_len": None, "output_len": None,
                   "levels": {"concurrency": None, "ok": None, "output_tok_s": None, "tpot_ms_median": None}},
    "lowload": {"settings": {"input_len": None, "output_len": None},
                "runs": {"level": None, "output_tok_s": None, "tpot_ms_median": None}},
}
# Of a swap-in benchmark's JSON, what benchmarks/swap_in/report.py's markdown() takes.
SWAP_IN_RUN = {"gpu": None, "date": None, "memcpy_gbps": None, "gather_gbps": None, "results": None}
SWAP_IN_TABLES = ["swap_in_H100_2026-11-23", "swap_in_H200_2026-11-23", "swap_in_against_f5438cc_H100_2026-11-24"]


def pick(value, spec):
    """The parts of ``value`` that ``spec`` names (see E2E_ARM)."""
    if spec is None or value is None:
        return value
    if isinstance(value, list):
        return [pick(item, spec) for item in value]
    return {key: pick(value[key], sub) for key, sub in spec.items() if key in value}


def git_show(commit: str, name: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), "show", f"{commit}:{RESULTS}/{name}"], check=True,
                          capture_output=True, text=True).stdout


def e2e_runs(commit: str) -> dict:
    """Every benchmarks/results/e2e_*.json of ``commit``, reduced to E2E_ARM per arm."""
    listing = subprocess.run(["git", "-C", str(REPO), "ls-tree", "--name-only", commit, f"{RESULTS}/"], check=True,
                             capture_output=True, text=True).stdout.split()
    names = sorted(Path(path).name for path in listing if Path(path).name.startswith("e2e_")
                   and path.endswith(".json"))
    files = {}
    for name in names:
        arms = json.loads(git_show(commit, name)).get("arms", {})
        files[name] = {"arms": {arm: pick(result, E2E_ARM) for arm, result in arms.items()}}
    return {
        "source": {"commit": commit, "files": [f"{RESULTS}/{name}" for name in names],
                   "kept": "per arm: the server command, SGLang's memory report, the capacity phase's sizes and "
                           "most running requests, the throughput and low-load levels (tests/test_data_files.py, "
                           "E2E_ARM)",
                   "read_by": ["tests/test_plan.py", "tests/test_plots.py"]},
        "files": files,
    }


def swap_in_tables(commit: str) -> dict:
    """The swap-in runs whose tables tests/test_bench_cli.py renders: their records and committed markdown."""
    tables = {stem: {"run": pick(json.loads(git_show(commit, f"{stem}.json")), SWAP_IN_RUN),
                     "markdown": git_show(commit, f"{stem}.md")} for stem in SWAP_IN_TABLES}
    return {
        "source": {"commit": commit, "files": [f"{RESULTS}/{stem}.{{json,md}}" for stem in SWAP_IN_TABLES],
                   "kept": "of each JSON what report.markdown() takes, and the .md as committed",
                   "read_by": ["tests/test_bench_cli.py"]},
        "tables": tables,
    }


EXTRACTS = {"e2e_runs.json": e2e_runs, "swap_in_tables.json": swap_in_tables}


def dump(data: dict) -> str:
    return json.dumps(data, indent=1, ensure_ascii=False) + "\n"


def load(name: str) -> dict:
    """A committed extract of tests/data/."""
    return json.loads((DATA / name).read_text(encoding="utf-8"))


@pytest.mark.parametrize("name", sorted(EXTRACTS))
def test_the_extract_is_what_its_commit_holds(name):
    commit = load(name)["source"]["commit"]
    found = subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", f"{commit}^{{commit}}"], check=False,
                           capture_output=True)
    if found.returncode != 0:
        pytest.skip(f"this checkout cannot read commit {commit} (not a git checkout, or a shallow clone)")
    assert (DATA / name).read_text(encoding="utf-8") == dump(EXTRACTS[name](commit)), (
        f"tests/data/{name} differs from its source; rebuild it: python tests/test_data_files.py {commit}")


def test_pick_keeps_the_named_keys_of_every_element():
    value = {"a": 1, "b": [{"x": 1, "y": 2}, {"x": 3}], "c": None, "d": {"e": 5}}
    assert pick(value, {"b": {"x": None}, "c": {"z": None}, "d": None, "missing": None}) == {
        "b": [{"x": 1}, {"x": 3}], "c": None, "d": {"e": 5}}


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[-1])
        return 2
    for name, build in EXTRACTS.items():
        (DATA / name).write_text(dump(build(argv[1])), encoding="utf-8")
        print(f"wrote {DATA / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
