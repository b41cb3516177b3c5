"""Every result file the docs cite exists, and every file in benchmarks/results/ is cited by one of them
(docs: README.md and docs/**/*.md; STYLE.md: a result file is committed only when a doc states a figure
from it). benchmarks/results/ holds at most MAX_RESULT_FILES files (issue #29): a new run replaces the files
whose figures it supersedes, and the prose that quoted them moves to a lab note that cites them from git
history (below); tests read their GPU data from tests/data/, not from there.

What counts as a citation, anywhere in a doc's text:

* a name containing an underscore and a date, ``swap_in_H100_2026-11-23.md`` (how result files are named;
  lab notes are named with hyphens, ``gpu-e2e-2026-11-22.md``, and are not matched), or any path under
  ``benchmarks/results/``;
* brace groups expand, ``e2e_H200_2026-11-24.{md,json}``; a name ending in ``/`` cites a folder and every file
  in it; ``*`` globs; a name without an extension cites every file of that stem;
* a path under ``img/`` is a plot drawn from a result (``benchmarks/plots.py``, checked by tests/test_plots.py),
  not a citation;
* ``<commit>:benchmarks/results/<name>`` cites a file as committed in that commit (lab notes cite superseded
  runs, removed from the tree, this way): it is not looked for in the tree, and git checks that the commit holds
  it.

``python tests/test_docs_results.py [ROOT]`` prints what is dangling or uncited in another checkout (a copy
with files deleted, say), and whether its results hold too many files, and exits 1 if anything is wrong.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path("benchmarks") / "results"
MAX_RESULT_FILES = 25  # issue #29: the files a doc quotes, not every run ever made

_NAME = r"[\w.{},*/+-]"
CITATION = re.compile(
    r"(?:(?<![\w/])(?P<commit>[0-9a-f]{7,40}):)?"
    rf"(?P<name>benchmarks/results/{_NAME}+|{_NAME}*_\d{{4}}-\d{{2}}-\d{{2}}{_NAME}*)"
)


@dataclasses.dataclass(frozen=True)
class Citation:
    doc: str  # path of the doc, relative to the root
    line: int
    name: str  # relative to benchmarks/results/, braces expanded
    commit: str | None  # set for a citation of a file as committed in that commit

    def __str__(self) -> str:
        where = f"{self.commit}:{RESULTS.as_posix()}/" if self.commit else ""
        return f"{self.doc}:{self.line}: {where}{self.name}"


@dataclasses.dataclass
class Report:
    dangling: list[Citation]  # cited in the tree, no such file
    uncited: list[str]  # in benchmarks/results/, relative to it, cited by no doc
    history: list[Citation]  # cited as committed in a commit (checked against git, not the tree)


def expand_braces(name: str) -> list[str]:
    group = re.search(r"\{([^{}]*)\}", name)
    if group is None:
        return [name]
    return [expanded for choice in group.group(1).split(",")
            for expanded in expand_braces(name[:group.start()] + choice + name[group.end():])]


def doc_files(root: Path) -> list[Path]:
    docs = [root / "README.md"] if (root / "README.md").is_file() else []
    return docs + sorted((root / "docs").rglob("*.md"))


def citations(root: Path) -> list[Citation]:
    found = []
    for doc in doc_files(root):
        for number, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), start=1):
            for match in CITATION.finditer(line):
                raw = match.group("name").rstrip(".,:;")
                if raw.startswith(("img/", "docs/img/")):
                    continue  # a plot of a result (docs/img/, drawn by benchmarks/plots.py), not a result file
                if raw.startswith(f"{RESULTS.as_posix()}/"):
                    raw = raw[len(RESULTS.as_posix()) + 1:]
                if not raw:  # the folder itself, "benchmarks/results/"
                    continue
                for name in expand_braces(raw):
                    found.append(Citation(doc.relative_to(root).as_posix(), number, name, match.group("commit")))
    return found


def cited_files(results: Path, name: str) -> list[Path]:
    """The files of results/ that a citation names; empty when it names none."""
    if "*" in name:
        return sorted(path for path in results.glob(name) if path.is_file())
    path = results / name
    if path.is_dir():
        return sorted(child for child in path.rglob("*") if child.is_file())
    if path.is_file():
        return [path]
    if not name.endswith("/") and Path(name).suffix == "":  # a stem: every format of that result
        return sorted(path.parent.glob(f"{path.name}.*"))
    return []


def result_files(root: Path) -> list[Path]:
    results = root / RESULTS
    return sorted(path for path in results.rglob("*") if path.is_file()) if results.is_dir() else []


def too_many_files(root: Path) -> str | None:
    """Why benchmarks/results/ holds too many files, or None."""
    count = len(result_files(root))
    if count <= MAX_RESULT_FILES:
        return None
    return (f"{RESULTS.as_posix()}/ holds {count} files, at most {MAX_RESULT_FILES}: remove those whose figures a "
            f"newer run supersedes, and move the prose that quotes them into a lab note that cites them as "
            f"<commit>:{RESULTS.as_posix()}/<name>")


def check(root: Path) -> Report:
    results = root / RESULTS
    dangling, history, cited = [], [], set()
    for citation in citations(root):
        if citation.commit:
            history.append(citation)
            continue
        files = cited_files(results, citation.name)
        if not files:
            dangling.append(citation)
        cited.update(files)
    uncited = [path.relative_to(results).as_posix() for path in result_files(root) if path not in cited]
    return Report(dangling, uncited, history)


def missing_from_history(root: Path, history: list[Citation]) -> list[Citation]:
    """The history citations whose commit does not hold the named file (or folder)."""
    missing = []
    for citation in history:
        spec = f"{citation.commit}:{RESULTS.as_posix()}/{citation.name.rstrip('/')}"
        done = subprocess.run(["git", "-C", str(root), "cat-file", "-e", spec], check=False, capture_output=True)
        if done.returncode != 0:
            missing.append(citation)
    return missing


# --- the repository ----------------------------------------------------------------------------------

def test_every_cited_result_file_exists():
    dangling = check(REPO).dangling
    assert not dangling, "cited, but not in benchmarks/results/:\n" + "\n".join(map(str, dangling))


def test_every_result_file_is_cited():
    uncited = check(REPO).uncited
    assert not uncited, (
        "in benchmarks/results/ but cited by no doc (README.md, docs/**/*.md): state a figure from it, or "
        "delete it:\n" + "\n".join(uncited)
    )


def test_results_hold_at_most_the_files_allowed():
    reason = too_many_files(REPO)
    assert reason is None, reason


def _full_history() -> str | None:
    """None if git can read this checkout's full history, else why not."""
    if shutil.which("git") is None:
        return "git is not installed"
    done = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--is-shallow-repository"],
                          check=False, capture_output=True, text=True)
    if done.returncode != 0:
        return "not a git checkout"
    if done.stdout.strip() != "false":
        return "a shallow clone lacks the commits that history citations name"
    return None


def test_files_cited_from_git_history_are_in_those_commits():
    reason = _full_history()
    if reason:
        pytest.skip(reason)
    missing = missing_from_history(REPO, check(REPO).history)
    assert not missing, "no such file in the commit cited:\n" + "\n".join(map(str, missing))


# --- the check itself, on small trees ------------------------------------------------------------------

def make_tree(root: Path, docs: dict[str, str], results: list[str]) -> Path:
    for name, text in docs.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    for name in results:
        (root / RESULTS / name).parent.mkdir(parents=True, exist_ok=True)
        (root / RESULTS / name).write_text("x\n")
    (root / "docs").mkdir(exist_ok=True)
    return root


def test_a_citation_of_a_missing_file_is_dangling(tmp_path):
    root = make_tree(tmp_path, {"README.md": "Proof: `benchmarks/results/e2e_H100_2026-01-02.{md,json}`.\n"},
                     ["e2e_H100_2026-01-02.md"])
    report = check(root)
    assert [str(c) for c in report.dangling] == ["README.md:1: e2e_H100_2026-01-02.json"]
    assert report.uncited == []


def test_a_file_no_doc_cites_is_uncited(tmp_path):
    root = make_tree(tmp_path, {"docs/kernels.md": "See swap_in_H100_2026-01-02.md, and nothing else.\n"},
                     ["swap_in_H100_2026-01-02.md", "swap_in_H100_2026-01-02.json", "old_H100_2026-01-01.log"])
    report = check(root)
    assert report.dangling == []
    assert report.uncited == ["old_H100_2026-01-01.log", "swap_in_H100_2026-01-02.json"]


def test_citation_forms(tmp_path):
    docs = {
        "README.md": "`sanitizer_{memcheck,racecheck}_H100_2026-01-02.log`; a stem: e2e_fp8_H100_2026-01-02.\n",
        "docs/a.md": "folder `ncu_H100_2026-01-02/`, glob `benchmarks/results/sweep_*_2026-01-03.md`\n",
        "docs/lab-notes/b-2026-01-04.md": "(`0123abc:benchmarks/results/gone_H100_2026-01-01.{md,json}`), "
                                          "[notes](lab-notes/b-2026-01-04.md), `benchmarks/results/`\n",
    }
    results = ["sanitizer_memcheck_H100_2026-01-02.log", "sanitizer_racecheck_H100_2026-01-02.log",
               "e2e_fp8_H100_2026-01-02.md", "e2e_fp8_H100_2026-01-02.json", "ncu_H100_2026-01-02/b1.txt",
               "ncu_H100_2026-01-02/b8.txt", "sweep_H100_2026-01-03.md", "sweep_H200_2026-01-03.md"]
    report = check(make_tree(tmp_path, docs, results))
    assert report.dangling == [] and report.uncited == []
    assert [str(c) for c in report.history] == [
        "docs/lab-notes/b-2026-01-04.md:1: 0123abc:benchmarks/results/gone_H100_2026-01-01.md",
        "docs/lab-notes/b-2026-01-04.md:1: 0123abc:benchmarks/results/gone_H100_2026-01-01.json",
    ]


def test_a_glob_or_stem_that_matches_nothing_is_dangling(tmp_path):
    root = make_tree(tmp_path, {"README.md": "`sweep_*_2026-01-03.md` and e2e_fp8_H100_2026-01-02\n"}, [])
    assert [c.name for c in check(root).dangling] == ["sweep_*_2026-01-03.md", "e2e_fp8_H100_2026-01-02"]


def test_one_file_over_the_limit_is_too_many(tmp_path):
    names = [f"run{number:02d}_H100_2026-01-02.md" for number in range(MAX_RESULT_FILES + 1)]
    root = make_tree(tmp_path, {"README.md": "`benchmarks/results/run*_H100_2026-01-02.md`\n"}, names)
    assert check(root).uncited == []  # all cited: the limit alone refuses them
    assert f"holds {MAX_RESULT_FILES + 1} files, at most {MAX_RESULT_FILES}:" in too_many_files(root)
    (root / RESULTS / names[-1]).unlink()
    assert too_many_files(root) is None


def main(argv: list[str]) -> int:
    root = Path(argv[1]).resolve() if len(argv) > 1 else REPO
    report = check(root)
    for citation in report.dangling:
        print(f"dangling: {citation}")
    for name in report.uncited:
        print(f"uncited: {RESULTS.as_posix()}/{name}")
    too_many = too_many_files(root)
    if too_many:
        print(too_many)
    print(f"{root}: {len(report.dangling)} dangling, {len(report.uncited)} uncited, "
          f"{len(report.history)} cited from git history, {len(result_files(root))} result files")
    return 1 if report.dangling or report.uncited or too_many else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
