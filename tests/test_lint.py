"""The house's lint: ``ruff check`` with the configuration in pyproject.toml ([tool.ruff]) over the whole tree.

ruff is in the ``test`` extra, so the README's test command (and CI) runs it; a checkout without it skips
with the way to get it.
"""

import pathlib
import shutil
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


def _ruff() -> list[str] | None:
    beside = pathlib.Path(sys.executable).with_name("ruff")
    if beside.exists():
        return [str(beside)]
    found = shutil.which("ruff")
    return [found] if found else None


def test_ruff_check_passes():
    ruff = _ruff()
    if ruff is None:
        pytest.skip("ruff is not installed: pip install -e '.[test]'")
    result = subprocess.run([*ruff, "check", "--no-cache", "--output-format", "concise", str(REPO)],
                            capture_output=True, text=True, cwd=REPO, timeout=300)
    assert result.returncode == 0, f"ruff check found problems (fix them or `ruff check --fix`):\n{result.stdout}{result.stderr}"


def test_ruff_check_fails_on_an_unused_import(tmp_path):
    """The check can fail: the same configuration rejects a file with an unused import."""
    ruff = _ruff()
    if ruff is None:
        pytest.skip("ruff is not installed: pip install -e '.[test]'")
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n")
    result = subprocess.run([*ruff, "check", "--no-cache", "--config", str(REPO / "pyproject.toml"), str(bad)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "F401" in result.stdout
