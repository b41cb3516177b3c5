"""hisparse-plan's arithmetic against what the tiny models got on the GPU (the e2e runs' server commands and
reports, extracted into tests/data/e2e_runs.json from benchmarks/results/e2e_*.json of the commit its header names:
SGLang's token capacity and KV memory per arm, the most requests running at once), and its use of the package's own
start-up checks. SGLang's own sizing code is compared in tests/sglang/test_plan_sglang.py."""

from __future__ import annotations

import dataclasses
import json
import shlex
from pathlib import Path

import pytest

from hisparse_sglang import plan

REPO = Path(__file__).resolve().parents[1]
RUNS = REPO / "tests" / "data" / "e2e_runs.json"  # tests/test_data_files.py checks it against git
ARMS_WITH_HISPARSE = {"b", "c", "d", "pd-b", "pd-c"}


def recorded_arms():
    """(file, arm, its server command, what SGLang reported, the capacity phase) of every e2e run of the extract
    whose server reported its memory use (of a PD arm: the decode instance, which the harness asks)."""
    for name, run in sorted(json.loads(RUNS.read_text())["files"].items()):
        for arm, result in run["arms"].items():
            usage = ((result or {}).get("server_internal") or {}).get("memory_usage")
            cmd = (result or {}).get("cmd")
            cmd = cmd.get("decode") if isinstance(cmd, dict) else cmd
            if usage and isinstance(cmd, str):
                yield pytest.param(name, arm, cmd, usage, result.get("capacity"), id=f"{Path(name).stem}-{arm}")


def spec_of(cmd: str, **overrides) -> plan.PlanInput:
    """The plan input of a recorded server command (the tiny model, its pool cap, HiSparse config, KV dtype)."""
    argv = shlex.split(cmd)

    def flag(name, default=None):
        return argv[argv.index(name) + 1] if name in argv else default

    model = Path(flag("--model-path"))
    model = REPO / "benchmarks" / "models" / model.name
    values = dict(
        model=plan.model_shape(str(model)), gpu_mem_gib=80, host_mem_gib=1000, tp=1,
        kv_dtype="fp8" if flag("--kv-cache-dtype", "bfloat16").startswith("fp8") else "bf16",
        mem_fraction_static=float(flag("--mem-fraction-static")), context_length=int(flag("--context-length")),
        max_total_tokens=int(flag("--max-total-tokens")), hisparse_config=flag("--hisparse-config", ""),
        pd_decode=flag("--disaggregation-mode") == "decode",
    )
    values.update(overrides)
    return plan.PlanInput(**values)


RECORDED = list(recorded_arms())


def test_the_results_hold_every_kind_of_arm():
    arms = {param.values[1] for param in RECORDED}
    assert {"a", "c", "pd-c"} <= arms and len(RECORDED) >= 10


@pytest.mark.parametrize("name, arm, cmd, usage, capacity", RECORDED)
def test_gpu_pool_and_kv_memory_equal_what_sglang_allocated(name, arm, cmd, usage, capacity):
    result = plan.plan(spec_of(cmd))
    hisparse = arm in ARMS_WITH_HISPARSE and "--enable-hisparse" in cmd
    tokens = result.device_tokens_with if hisparse else result.device_tokens_without
    per_token = result.bytes_per_token_with if hisparse else result.bytes_per_token_without
    assert tokens == usage["token_capacity"]
    # SGLang reports the KV pool (KV rows + indexer keys of the logical pool) in GiB, to 3 decimals
    assert round(tokens * per_token / 2**30, 3) == usage["kvcache"]


@pytest.mark.parametrize("name, arm, cmd, usage, capacity", [p for p in RECORDED if p.values[4]])
def test_concurrency_matches_the_capacity_runs(name, arm, cmd, usage, capacity):
    result = plan.plan(spec_of(cmd, prompt_len=capacity["input_len"], output_len=capacity["output_len"]))
    measured = capacity["max_running_loads"]  # /v1/loads, polled every 0.5 s
    if "--enable-hisparse" not in cmd:
        assert measured == result.concurrent_without
    elif arm in ("c", "d"):
        # an upper bound from the pools; at 16K its binding bound (31 GPU buffers) was reached within 2
        assert measured <= result.concurrent_with
        if capacity["input_len"] == 16384:
            assert result.concurrency_bounds["gpu_buffers"] == result.concurrent_with
            assert measured >= result.concurrent_with - 2


def test_pd_decode_serves_the_long_prompt_the_gpu_pool_cannot_hold():
    (param,) = [p for p in RECORDED if p.values[1] == "pd-c"]
    result = plan.plan(spec_of(param.values[2], prompt_len=49152, output_len=256))
    assert result.longest_request_with >= 49152 + 256 > result.longest_request_without == 40960
    assert result.logical_tokens == 40960 * 8 and not result.errors


def test_host_pool_rows_and_pinning_time():
    (param,) = [p for p in RECORDED if p.values[0].startswith("e2e_H100_2026-11-22") and p.values[1] == "c"]
    result = plan.plan(spec_of(param.values[2]))
    assert result.logical_tokens == 131072 * 8 and result.host_rows == 131072 * 8 + 64  # page 0 reserved
    assert result.host_pool_gib == pytest.approx(1_048_640 * 4 * 1152 / 2**30)
    assert result.pin_seconds == pytest.approx(result.host_pool_gib / 15.3)
    # 16 GiB pinned in 1.05 s (benchmarks/bench_host_pool.py, docs/lab-notes/gpu-e2e-2026-11-24.md)
    assert plan.PIN_RATE_GIB_S * 1.05 == pytest.approx(16, rel=0.01)


def test_known_models_and_their_row_sizes():
    deepseek, glm = plan.model_shape("DeepSeek-V3.2"), plan.model_shape("glm-5")
    assert (deepseek.layers, glm.layers) == (61, 78)
    assert plan.bytes_per_device_token(deepseek, "bf16", 1) - 61 * 132 == 61 * 1152 == 70272  # docs/pd.md
    assert plan.bytes_per_device_token(deepseek, "fp8", 1) - 61 * 132 == 40016
    assert plan.bytes_per_device_token(glm, "bf16", 8) == 78 * (1152 + 8 * 132)


def test_a_ratio_the_buffers_cannot_use_is_called_wasteful_and_a_smaller_one_suggested():
    (param,) = [p for p in RECORDED if p.values[0].startswith("e2e_H100_2026-11-22") and p.values[1] == "c"]
    result = plan.plan(spec_of(param.values[2], prompt_len=16384, output_len=4096))
    assert result.suggested_ratio == 5 and '"host_to_device_ratio": 5' in result.hisparse_config_json
    assert any("host_to_device_ratio 8 gives 31" in text and "5 gives 31 with less host memory" in text
               for text in result.warnings)


def test_host_memory_too_small_is_refused_by_the_packages_own_check():
    (param,) = [p for p in RECORDED if p.values[0].startswith("e2e_H100_2026-11-22") and p.values[1] == "c"]
    result = plan.plan(spec_of(param.values[2], host_mem_gib=3.0))
    (error,) = [text for text in result.errors if text.startswith("host memory")]
    assert "use host_to_device_ratio <= 4 in --hisparse-config (now 8)" in error  # limits.check_host_pool
    shared = plan.plan(spec_of(param.values[2], host_mem_gib=30.0, gpus_per_node=8, tp=8))
    assert shared.host_pools_per_node == 8 and any(text.startswith("host memory") for text in shared.errors)


def test_gpu_pool_smaller_than_a_buffer_and_bad_configs_cannot_start():
    (param,) = [p for p in RECORDED if p.values[0].startswith("e2e_H100_2026-11-22") and p.values[1] == "c"]
    small = plan.plan(spec_of(param.values[2], max_total_tokens=4096))
    assert any("fewer than one offloaded request's device buffer needs" in text for text in small.errors)
    bad = plan.plan(spec_of(param.values[2], hisparse_config='{"top_k": 1024}'))
    assert any("differs from the model's index_topk (2048)" in text for text in bad.errors)
    too_big = plan.plan(spec_of(param.values[2], hisparse_config='{"device_buffer_size": 16384}'))
    assert any("device_buffer_size" in text for text in too_big.errors)


def test_weights_that_leave_no_kv_memory():
    spec = plan.PlanInput(model=plan.model_shape("GLM-5"), gpu_mem_gib=80, host_mem_gib=1000, tp=8)
    result = plan.plan(spec)
    assert result.weights_gib == pytest.approx(744e9 / 8 / 2**30)
    assert any("leave no KV memory" in text for text in result.errors) and result.device_tokens_with == 0


def test_cli_help_and_exit_codes(capsys):
    with pytest.raises(SystemExit) as exited:
        plan.main(["--help"])
    assert exited.value.code == 0
    text = capsys.readouterr().out
    for words in ("--gpu-mem-gib", "--host-mem-gib", "--hisparse-config", "--kv-dtype", "--pd-decode", "examples:"):
        assert words in text
    assert plan.main(["DeepSeek-V3.2", "--gpu-mem-gib", "140", "--host-mem-gib", "1800"]) == 0
    assert "Config to use:" in capsys.readouterr().out
    assert plan.main(["GLM-5", "--gpu-mem-gib", "80", "--host-mem-gib", "1000", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["errors"]
    assert plan.main(["no-such-model", "--gpu-mem-gib", "80", "--host-mem-gib", "100"]) == 2
    assert "neither a known name" in capsys.readouterr().err


def test_speculative_decoding_sizes_the_nextn_layers_and_the_verify_buffer():
    """--speculative-num-draft-tokens T: the draft's NextN layer keeps KV row and indexer key of every logical
    token on the GPU (host_to_device_ratio per GPU token) and no host rows; the default buffer stays 2 x top_k
    slots, as the plugin's own config keeps it. (tests/sglang/test_plan_sglang.py checks the bytes against
    SGLang's budget with the plugin's draft hook.)"""
    spec = plan.PlanInput(model=plan.model_shape("DeepSeek-V3.2"), gpu_mem_gib=139.8, host_mem_gib=1800, tp=8)
    plain = plan.plan(spec)
    mtp3 = plan.plan(dataclasses.replace(spec, speculative_num_draft_tokens=4))
    mtp1 = plan.plan(dataclasses.replace(spec, speculative_num_draft_tokens=2))
    assert not (plain.errors or mtp3.errors or mtp1.errors)
    assert (plain.config.device_buffer_size, mtp1.config.device_buffer_size, mtp3.config.device_buffer_size) == (
        4096, 4096, 4096)
    ratio = plain.config.host_to_device_ratio
    assert mtp3.bytes_per_token_with == plain.bytes_per_token_with + (1152 + 132) * ratio == 88944
    assert mtp3.bytes_per_token_without == plain.bytes_per_token_without + 1152 + 132
    assert mtp3.device_tokens_with < plain.device_tokens_with
    assert mtp3.host_pool_gib / mtp3.host_rows == pytest.approx(plain.host_pool_gib / plain.host_rows)
    assert '"device_buffer_size": 4096' in mtp3.hisparse_config_json


def test_speculative_decoding_needs_a_nextn_layer_and_at_most_four_positions(tmp_path, capsys):
    config = {"num_hidden_layers": 4, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "index_topk": 2048,
              "index_head_dim": 128, "max_position_embeddings": 65536, "num_nextn_predict_layers": 0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = plan.PlanInput(model=plan.model_shape(str(tmp_path)), gpu_mem_gib=80, host_mem_gib=1000, tp=1,
                          weights_gib=1.0, speculative_num_draft_tokens=2)
    with pytest.raises(plan.HiSparseConfigError, match="num_nextn_predict_layers 0"):
        plan.plan(spec)
    config["num_nextn_predict_layers"] = 1
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert plan.model_shape(str(tmp_path)).nextn_layers == 1
    assert not plan.plan(dataclasses.replace(spec, model=plan.model_shape(str(tmp_path)))).errors
    argv = ["DeepSeek-V3.2", "--gpu-mem-gib", "140", "--host-mem-gib", "1800", "--speculative-num-draft-tokens", "5"]
    assert plan.main(argv) == 2
    assert "1 to 4 positions" in capsys.readouterr().err
