"""HiSparseConfig: defaults, model top-k, and actionable errors for malformed input."""

import dataclasses

import pytest

from hisparse_sglang.config import HiSparseConfig
from hisparse_sglang.errors import HiSparseConfigError


def test_defaults_without_text():
    config = HiSparseConfig.from_json(None)
    assert config.top_k == 2048
    assert config.device_buffer_size == 4096
    assert config.host_to_device_ratio == 2
    assert config.page_size == 64
    assert config.resident_first is True
    assert config.padded_buffer_size == 4096 + 64
    assert HiSparseConfig.from_json("  ") == config


def test_issue_example_parses():
    config = HiSparseConfig.from_json('{"top_k": 2048, "device_buffer_size": 4096, "host_to_device_ratio": 10}')
    assert (config.top_k, config.device_buffer_size, config.host_to_device_ratio) == (2048, 4096, 10)


def test_top_k_defaults_to_model_index_topk_and_scales_buffer():
    config = HiSparseConfig.from_json("{}", model_index_topk=512)
    assert config.top_k == 512
    assert config.device_buffer_size == 1024


def test_default_buffer_rounds_up_to_a_page():
    config = HiSparseConfig.from_json('{"top_k": 1000}')
    assert config.device_buffer_size == 2048  # 2 x 1000 rounded up to a multiple of 64


def test_all_knobs_round_trip():
    text = (
        '{"top_k": 1024, "device_buffer_size": 6144, "host_to_device_ratio": 4, "page_size": 64,'
        ' "swap_in_block_size": 512, "resident_first": false, "promote_free_fraction": 0.5,'
        ' "switch_cooldown_steps": 3, "max_switches_per_step": 2}'
    )
    config = HiSparseConfig.from_json(text)
    assert HiSparseConfig.from_json(config.to_json()) == config
    assert config.resident_first is False and config.swap_in_block_size == 512


def test_config_is_frozen():
    config = HiSparseConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.top_k = 1  # type: ignore[misc]


# (json text, model index_topk, fragments the message must contain)
MALFORMED = [
    ("{", None, ["not valid JSON", "Example"]),
    ("[1, 2]", None, ["must be a JSON object", "list"]),
    ('"top_k"', None, ["must be a JSON object", "str"]),
    ("42", None, ["must be a JSON object"]),
    ('{"top_k": 2048, "top_k": 1024}', None, ["appears twice"]),
    ('{"topk": 2048}', None, ["unknown key 'topk'", "Did you mean 'top_k'", "Known keys"]),
    ('{"device_buffer": 4096}', None, ["unknown key 'device_buffer'", "device_buffer_size"]),
    ('{"completely_unrelated": 1}', None, ["unknown key", "Known keys"]),
    ('{"top_k": "2048"}', None, ["top_k must be an integer", "str"]),
    ('{"top_k": 2048.0}', None, ["top_k must be an integer", "write 2048"]),
    ('{"top_k": true}', None, ["top_k must be an integer"]),
    ('{"top_k": 0}', None, ["top_k (0) must be >= 1"]),
    ('{"top_k": -5}', None, ["top_k (-5) must be >= 1"]),
    ('{"top_k": null}', None, ["top_k must be an integer"]),
    ('{"top_k": 1024}', 2048, ["differs from the model's index_topk (2048)", "set it to 2048"]),
    ('{"top_k": 2048, "device_buffer_size": 1024}', None, ["device_buffer_size (1024) must be >= top_k (2048)"]),
    ('{"device_buffer_size": 4000}', None, ["multiple of page_size (64)", "use 4032"]),
    ('{"device_buffer_size": 40960}', None, ["device_buffer_size (40960) must be <= 32767"]),
    ('{"device_buffer_size": [4096]}', None, ["device_buffer_size must be an integer", "list"]),
    ('{"host_to_device_ratio": 0}', None, ["host_to_device_ratio (0) must be >= 1"]),
    ('{"host_to_device_ratio": 2.5}', None, ["host_to_device_ratio must be an integer"]),
    ('{"host_to_device_ratio": "10"}', None, ["host_to_device_ratio must be an integer", "str"]),
    ('{"page_size": 48}', None, ["page_size (48) must be a power of two"]),
    ('{"swap_in_block_size": 960}', None, ["swap_in_block_size (960) must be one of"]),
    ('{"swap_in_block_size": 0}', None, ["swap_in_block_size (0) must be one of"]),
    ('{"swap_in_block_size": 128}', None, ["swap_in_block_size (128) must be one of", "(256, 512, 1024)"]),
    ('{"resident_first": "yes"}', None, ["resident_first must be true or false"]),
    ('{"resident_first": 1}', None, ["resident_first must be true or false"]),
    ('{"promote_free_fraction": 1.5}', None, ["promote_free_fraction (1.5) must be in [0, 1)"]),
    ('{"promote_free_fraction": -0.1}', None, ["promote_free_fraction (-0.1) must be in [0, 1)"]),
    ('{"promote_free_fraction": NaN}', None, ["NaN", "finite number"]),
    ('{"promote_free_fraction": "0.5"}', None, ["promote_free_fraction must be a number"]),
    ('{"pd_quarantine_s": -1}', None, ["pd_quarantine_s (-1.0) must be in [0, 3600]", "MC_TRANSFER_TIMEOUT"]),
    ('{"pd_quarantine_s": 1e9}', None, ["pd_quarantine_s (1000000000.0) must be in [0, 3600]"]),
    ('{"pd_quarantine_s": "60"}', None, ["pd_quarantine_s must be a number"]),
    ('{"switch_cooldown_steps": -1}', None, ["switch_cooldown_steps (-1) must be >= 0"]),
    ('{"max_switches_per_step": 0}', None, ["max_switches_per_step (0) must be >= 1"]),
    ("{}", 0, ["model index_topk (0) must be >= 1"]),
]


@pytest.mark.parametrize("text,model_topk,fragments", MALFORMED, ids=[m[0][:40] for m in MALFORMED])
def test_malformed_config_names_value_and_fix(text, model_topk, fragments):
    with pytest.raises(HiSparseConfigError) as info:
        HiSparseConfig.from_json(text, model_index_topk=model_topk)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


def test_config_error_is_a_value_error():
    assert issubclass(HiSparseConfigError, ValueError)


def test_non_string_input_is_rejected():
    with pytest.raises(HiSparseConfigError, match="must be a JSON string"):
        HiSparseConfig.from_json(b'{"top_k": 1}')  # type: ignore[arg-type]


def test_direct_construction_validates_too():
    with pytest.raises(HiSparseConfigError, match="device_buffer_size"):
        HiSparseConfig(top_k=4096, device_buffer_size=2048)
