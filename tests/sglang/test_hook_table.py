"""docs/sglang-versions.md's hook table is the one tools/hook_table.py renders from ``HOOKS``."""

import dataclasses
import importlib.util
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[2]


def _tool():
    spec = importlib.util.spec_from_file_location("hook_table", REPO / "tools" / "hook_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_docs_hook_table_is_the_registrys():
    from hisparse_sglang.integration.sglang.hooks import HOOKS

    tool = _tool()
    documented = tool.doc_table(tool.DOC.read_text())
    assert documented == tool.render(HOOKS), (
        "docs/sglang-versions.md's hook table differs from HOOKS: run `PYTHONPATH=src python tools/hook_table.py --write`"
    )


def test_a_hook_added_changed_or_dropped_changes_the_table():
    """The comparison above can fail: each kind of drift renders another table."""
    from hisparse_sglang.integration.sglang.hooks import HOOKS

    tool = _tool()
    table = tool.render(HOOKS)
    assert tool.render(HOOKS[:-1]) != table
    assert tool.render((*HOOKS, HOOKS[0])) != table
    assert tool.render((dataclasses.replace(HOOKS[0], versions=">=0.5.17,<0.5.20"), *HOOKS[1:])) != table
    assert tool.render((dataclasses.replace(HOOKS[0], written_against="0.5.23"), *HOOKS[1:])) != table
    assert tool.render((dataclasses.replace(HOOKS[0], target=HOOKS[0].target + "_renamed"), *HOOKS[1:])) != table
    assert all(spec.target.removeprefix("sglang.srt.") in table for spec in HOOKS)
