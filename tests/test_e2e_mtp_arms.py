"""The GPU harness's speculative arms (benchmarks/e2e: arms.py, options.py, logs.py, client.py): what an
"<arm>+mtp" server runs, the refusals before anything starts, weights compared model by model, and the accept
lengths read from SGLang's per-request meta_info; where their server logs and ports go (report.py, servers.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

E2E = Path(__file__).resolve().parents[1] / "benchmarks" / "e2e"
sys.path.insert(0, str(E2E))

import arms  # noqa: E402
import client  # noqa: E402
import logs  # noqa: E402
import options  # noqa: E402


def spec_of(arm: str, argv: list[str], tmp_path) -> tuple[list[str], dict]:
    args = options.parse_args(["--state-dir", str(tmp_path), *argv])
    common, plugin, _ = arms.prepare_pyext(tmp_path, args)
    return arms.arm_spec(arm, args, {}, common, plugin, 30000)


def flag(cmd: list[str], name: str) -> str | None:
    return cmd[cmd.index(name) + 1] if name in cmd else None


def test_an_mtp_arm_is_its_arm_with_linear_eagle_on_the_nextn_model(tmp_path):
    plain, _ = spec_of("c", [], tmp_path)
    cmd, env = spec_of("c+mtp", ["--mtp-steps", "2"], tmp_path)
    assert flag(cmd, "--model-path") == str(tmp_path / "model-mtp")
    assert (flag(cmd, "--speculative-algorithm"), flag(cmd, "--speculative-num-steps"),
            flag(cmd, "--speculative-eagle-topk"), flag(cmd, "--speculative-num-draft-tokens")) == ("EAGLE", "2", "1", "3")
    speculative = {"--speculative-algorithm", "--speculative-num-steps", "--speculative-eagle-topk",
                   "--speculative-num-draft-tokens"}
    stripped = [x for i, x in enumerate(cmd) if x not in speculative and (i == 0 or cmd[i - 1] not in speculative)]
    assert stripped[:3] + stripped[5:] == plain[:3] + plain[5:]  # all but --model-path as arm c's
    assert "SGLANG_SIMULATE_ACC_LEN" not in env
    assert "--speculative-algorithm" not in plain


def test_the_mtp_arms_keep_their_arms_hisparse_settings(tmp_path):
    a_cmd, _ = spec_of("a+mtp", [], tmp_path)
    assert "--enable-hisparse" not in a_cmd
    d_cmd, d_env = spec_of("d+mtp", [], tmp_path)
    assert json.loads(flag(d_cmd, "--hisparse-config"))["resident_first"] is False
    assert "pyext-plugin" in d_env["PYTHONPATH"]
    b_cmd, b_env = spec_of("b+mtp", ["--plugin-hisparse-config", '{"device_buffer_size": 8192}'], tmp_path)
    assert json.loads(flag(b_cmd, "--hisparse-config"))["device_buffer_size"] == 4096
    assert "pyext-plugin" not in b_env["PYTHONPATH"]


def test_the_corrupting_mtp_arm_is_d_mtp_on_the_corrupting_kernel_build(tmp_path):
    d_cmd, d_env = spec_of("d+mtp", [], tmp_path)
    dx_cmd, dx_env = spec_of("dx+mtp", [], tmp_path)
    assert dx_env["HISPARSE_E2E_KERNEL_DEFINES"] == arms.CORRUPT_DEFINES
    assert "HISPARSE_E2E_KERNEL_DEFINES" not in d_env
    assert dx_env["PYTHONPATH"] == d_env["PYTHONPATH"]
    port = dx_cmd.index("--port")
    assert dx_cmd[:port] + dx_cmd[port + 2:] == d_cmd[:port] + d_cmd[port + 2:]  # every flag as d+mtp's
    assert len(set(arms.port_offsets())) == len(arms.port_offsets())
    with pytest.raises(SystemExit):
        options.parse_args(["--state-dir", str(tmp_path), "--arms", "dx+mtp", "--plugin-no-enable-hisparse"])


def test_simulated_acceptance_is_sglangs_own_with_the_drafts_tokens(tmp_path):
    _, env = spec_of("a+mtp", ["--mtp-steps", "3", "--mtp-accept-len", "3"], tmp_path)
    assert env["SGLANG_SIMULATE_ACC_LEN"] == "3.0"
    assert env["SGLANG_SIMULATE_ACC_TOKEN_MODE"] == "real-draft-token"
    assert env["SGLANG_SIMULATE_ACC_METHOD"] == "match-expected"


def test_the_mtp_model_declares_one_nextn_layer_and_links_the_rest(tmp_path):
    args = options.parse_args(["--state-dir", str(tmp_path)])
    model = arms.prepare_mtp_model(args)
    source = Path(args.model_dir)
    config = json.loads((model / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1
    assert {k: v for k, v in config.items() if k != "num_nextn_predict_layers"} == {
        k: v for k, v in json.loads((source / "config.json").read_text()).items() if k != "num_nextn_predict_layers"}
    others = [f for f in source.iterdir() if f.name != "config.json"]
    assert others and all((model / f.name).resolve() == f.resolve() for f in others)


def test_model_layers_serve_every_arm_a_deeper_copy_of_the_model(tmp_path):
    """--model-layers N: every arm, the MTP arms' draft model included, serves a copy of the model declaring N
    decoder layers; nothing else in its config changes and every other file links to the original's."""
    args = options.parse_args(["--state-dir", str(tmp_path), "--model-layers", "16"])
    source = Path(args.model_dir)
    layered = arms.prepare_layered_model(args)
    assert layered == tmp_path / f"{source.name}-L16" and Path(args.model_dir) == layered
    original = json.loads((source / "config.json").read_text())
    config = json.loads((layered / "config.json").read_text())
    assert config["num_hidden_layers"] == 16 != original["num_hidden_layers"]
    assert {k: v for k, v in config.items() if k != "num_hidden_layers"} == {
        k: v for k, v in original.items() if k != "num_hidden_layers"}
    others = [f for f in source.iterdir() if f.name != "config.json"]
    assert others and all((layered / f.name).resolve() == f.resolve() for f in others)
    mtp = json.loads((arms.prepare_mtp_model(args) / "config.json").read_text())
    assert (mtp["num_hidden_layers"], mtp["num_nextn_predict_layers"]) == (16, 1)
    common, plugin, _ = arms.prepare_pyext(tmp_path, args)
    for arm in ("a", "c", "d"):
        assert flag(arms.arm_spec(arm, args, {}, common, plugin, 30000)[0], "--model-path") == str(layered)
    plain = options.parse_args(["--state-dir", str(tmp_path / "plain")])
    assert arms.prepare_layered_model(plain) == plain.model_dir == source and not (tmp_path / "plain").exists()


@pytest.mark.parametrize("argv, message", [
    (["--arms", "a+mtp", "--mtp-accept-len", "3"], "--mtp-accept-len 3.0 must be 0 or within 1 .. --mtp-steps + 1 = 2"),
    (["--model-layers", "-1"], "--model-layers must be >= 1, or 0 for the model as it is (got -1)"),
])
def test_what_the_servers_would_refuse_is_refused_before_starting(tmp_path, argv, message, capsys):
    with pytest.raises(SystemExit):
        options.parse_args(["--state-dir", str(tmp_path), *argv])
    assert message in capsys.readouterr().err


def test_every_number_of_draft_steps_runs_with_the_default_buffer(tmp_path):
    """The verify positions need not fit the buffer together (a step whose positions name more tokens than it
    holds accepts fewer drafts), so 3 draft steps start with the plugin's default 4096 slots, or with more."""
    for arms_text in ("a+mtp,c+mtp,d+mtp", "pd-c+mtp"):
        options.parse_args(["--state-dir", str(tmp_path), "--arms", arms_text, "--mtp-steps", "3"])
    options.parse_args(["--state-dir", str(tmp_path), "--arms", "a+mtp,c+mtp,d+mtp", "--mtp-steps", "3",
                        "--plugin-hisparse-config", '{"device_buffer_size": 8192}'])
    options.parse_args(["--state-dir", str(tmp_path), "--arms", "b+mtp", "--mtp-steps", "3"])  # the in-tree's rules


def test_pd_with_mtp_runs_speculation_on_both_instances_and_the_plugin_on_the_decode(tmp_path):
    args = options.parse_args(["--state-dir", str(tmp_path), "--arms", "pd-c+mtp", "--mtp-steps", "2",
                               "--plugin-hisparse-config", '{"device_buffer_size": 6144}'])
    common, plugin, _ = arms.prepare_pyext(tmp_path, args)
    prefill, decode = arms.arm_servers("pd-c+mtp", args, {}, {}, common, plugin)
    assert (prefill.role, decode.role) == ("prefill", "decode")
    assert (prefill.port, decode.port) == (args.port_base + 110, args.port_base + 111)
    for server in (prefill, decode):
        assert flag(server.cmd, "--model-path") == str(tmp_path / "model-mtp")
        assert (flag(server.cmd, "--speculative-num-steps"), flag(server.cmd, "--speculative-num-draft-tokens")) == ("2", "3")
    assert flag(prefill.cmd, "--disaggregation-mode") == "prefill" and "--enable-hisparse" not in prefill.cmd
    assert flag(prefill.cmd, "--disaggregation-bootstrap-port") == str(args.port_base + 112)
    assert str(plugin) not in prefill.env["PYTHONPATH"]
    assert flag(decode.cmd, "--disaggregation-mode") == "decode"
    assert json.loads(flag(decode.cmd, "--hisparse-config"))["device_buffer_size"] == 6144
    assert decode.env["PYTHONPATH"].startswith(str(plugin))
    assert args.preflight_mooncake  # a PD arm checks Mooncake before starting


TARGET = "DeepseekV32ForCausalLM:2.7e+04/1.0e+06"
DRAFT = "DeepseekV3ForCausalLMNextN:1.2e+04/8.9e+05"


def test_weights_are_compared_model_by_model():
    assert logs.same_weights([TARGET], [TARGET, DRAFT]) is True  # a against a+mtp: the target agrees
    assert logs.same_weights([TARGET, DRAFT], [TARGET, DRAFT]) is True
    assert logs.same_weights([TARGET, DRAFT], [TARGET, DRAFT.replace("1.2e+04", "1.3e+04")]) is False
    assert logs.same_weights([TARGET], [TARGET.replace("2.7e+04", "2.8e+04")]) is False
    assert logs.same_weights([TARGET], [DRAFT]) is False  # nothing in common
    assert logs.same_weights([TARGET, TARGET.replace("2.7", "2.9")], [TARGET]) is False  # one server, two targets
    assert logs.same_weights(None, [TARGET]) is None
    assert logs.same_weights(["1.0e+00/2.0e+00"], ["1.0e+00/2.0e+00"]) is True  # an older fixture's line


def test_accept_lengths_are_summed_over_requests():
    metas = [{"spec_verify_ct": 10, "spec_num_correct_drafts": 12, "spec_accept_histogram": [2, 4, 4]},
             {"spec_verify_ct": 5, "spec_num_correct_drafts": 0, "spec_accept_histogram": [5]},
             {}]
    summary = client.spec_summary(metas)
    assert summary == {"requests": 2, "verify_steps": 15, "accept_length": round(1 + 12 / 15, 3),
                       "drafts_accepted_histogram": [7, 4, 4]}
    assert client.spec_summary([{}, {"completion_tokens": 3}]) is None
    assert client.spec_meta({"spec_verify_ct": 3, "finish_reason": "length", "spec_accept_rate": 0.5}) == {
        "spec_verify_ct": 3}


def test_an_mtp_arms_server_log_reaches_out_under_a_name_the_device_tool_brings_back(tmp_path):
    import report

    state, out = tmp_path / "state", tmp_path / "out"
    state.mkdir()
    out.mkdir()
    (state / "server-c+mtp.log").write_text("HiSparse: hit rate 50.0%\n")
    (state / "server-c.log").write_text("plain\n")
    report.Outputs(state, out, [], arms=["c+mtp", "c"]).publish()
    logs_out = sorted(p.name for p in out.glob("server-*.log"))
    assert logs_out == ["server-c.log", "server-c_mtp.log"]
    assert (out / "server-c_mtp.log").read_text() == "HiSparse: hit rate 50.0%\n"


def test_probed_port_bases_stay_out_of_the_ephemeral_ports(tmp_path, monkeypatch):
    import servers

    ranges = tmp_path / "ip_local_port_range"
    ranges.write_text("32768\t60999\n")
    assert servers.ephemeral_port_range(str(ranges)) == (32768, 60999)
    assert servers.ephemeral_port_range(str(tmp_path / "missing")) == (32768, 60999)
    monkeypatch.setattr(servers, "ephemeral_port_range", lambda: (32768, 60999))
    monkeypatch.setattr(servers, "port_free", lambda port: port != 32610)  # something listens at 32600 + 10
    bases = servers.free_port_bases(40, (0, 10, 95), start=32000)
    assert bases == [32000, 32100, 32200, 32300, 32400, 32500] + list(range(61000, 61000 + 34 * 100, 100)), bases
    assert all(not (32768 <= b + k <= 60999) for b in bases for k in (0, 10, 95))


def test_the_port_offsets_are_every_port_an_arm_listens_on(tmp_path):
    """The ports in every arm's server command lines (--port, --disaggregation-bootstrap-port)."""
    args = options.parse_args(["--state-dir", str(tmp_path)])
    common, plugin_dir, _ = arms.prepare_pyext(tmp_path, args)
    listened = set()
    for arm in arms.ALL_ARMS:
        for server in arms.arm_servers(arm, args, {}, {}, common, plugin_dir):
            for flag in ("--port", "--disaggregation-bootstrap-port"):
                if flag in server.cmd:
                    listened.add(int(server.cmd[server.cmd.index(flag) + 1]) - args.port_base)
    assert set(arms.port_offsets()) == listened and 112 in listened
