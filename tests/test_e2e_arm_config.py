"""The HiSparse config each arm's server gets (benchmarks/e2e/arms.py): the common --hisparse-config for every
HiSparse arm, --plugin-hisparse-config merged into the plugin's arms only (so ours can run with another buffer
size than SGLang's in-tree arm in the same invocation), arm d's resident_first false last; bad JSON is refused
at parse time."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

E2E = Path(__file__).resolve().parents[1] / "benchmarks" / "e2e"
sys.path.insert(0, str(E2E))

import arms  # noqa: E402
import options  # noqa: E402


def server_config(arm: str, argv: list[str], tmp_path) -> dict | None:
    args = options.parse_args(["--state-dir", str(tmp_path), *argv])
    common, plugin, _ = arms.prepare_pyext(tmp_path, args)
    cmd = arms.arm_spec(arm, args, {}, common, plugin, 30000)[0]
    return json.loads(cmd[cmd.index("--hisparse-config") + 1]) if "--hisparse-config" in cmd else None


def test_plugin_config_reaches_the_plugin_arms_only(tmp_path):
    argv = ["--hisparse-config", '{"top_k":2048,"device_buffer_size":4096,"host_to_device_ratio":8}',
            "--plugin-hisparse-config", '{"device_buffer_size": 3072}']
    assert server_config("a", argv, tmp_path) is None
    assert server_config("b", argv, tmp_path)["device_buffer_size"] == 4096
    assert server_config("c", argv, tmp_path) == {"top_k": 2048, "device_buffer_size": 3072, "host_to_device_ratio": 8}
    assert server_config("d", argv, tmp_path) == {"top_k": 2048, "device_buffer_size": 3072, "host_to_device_ratio": 8,
                                                   "resident_first": False}


def test_arm_d_keeps_its_own_override(tmp_path):
    """resident_first false is what arm d is: a plugin config cannot turn it back on."""
    argv = ["--plugin-hisparse-config", '{"resident_first": true}']
    assert server_config("d", argv, tmp_path)["resident_first"] is False
    assert server_config("c", argv, tmp_path)["resident_first"] is True


@pytest.mark.parametrize("value", ["[1]", "{bad", "3072"])
def test_bad_plugin_config_is_refused_at_parse_time(tmp_path, value, capsys):
    with pytest.raises(SystemExit):
        options.parse_args(["--state-dir", str(tmp_path), "--plugin-hisparse-config", value])
    assert "--plugin-hisparse-config" in capsys.readouterr().err
