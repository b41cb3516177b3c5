"""HiSparseConfig: defaults, model top-k, and actionable errors for malformed input."""

import dataclasses
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hisparse_sglang.config import HiSparseConfig
from hisparse_sglang.errors import HiSparseConfigError


def test_defaults_without_text():
    config = HiSparseConfig.from_json(None)
    assert config.top_k == 2048
    assert config.device_buffer_size == 4096
    assert config.host_to_device_ratio == 2
    assert config.page_size == 64
    assert config.resident_first is True
    assert config.share_host_pool_across_tp is False, "experimental: opt-in"
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
        ' "switch_cooldown_steps": 3, "max_switches_per_step": 2, "share_host_pool_across_tp": true}'
    )
    config = HiSparseConfig.from_json(text)
    assert HiSparseConfig.from_json(config.to_json()) == config
    assert config.resident_first is False and config.swap_in_block_size == 512
    assert config.share_host_pool_across_tp is True


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
    ('{"share_host_pool_across_tp": "no"}', None,
     ["share_host_pool_across_tp must be true or false", "'no'", "write false (the default", "experimental"]),
    ('{"share_host_pool_across_tp": 0}', None, ["share_host_pool_across_tp must be true or false, got 0", "true"]),
    ('{"share_host_pool_across_tp": null}', None, ["share_host_pool_across_tp must be true or false", "write false"]),
    ('{"share_host_pool_accross_tp": true}', None, ["Did you mean 'share_host_pool_across_tp'?"]),
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


# top_k values the swap-in kernel cannot take (json text): the first message states the whole limit
# and a fix; following the fix parses. The largest top_k on sm_90 (4096) and its largest buffer (5760
# at page_size 64) are checked by the parses below, not taken from the code under test.
TOO_LARGE_TOP_K = [
    '{"top_k": 16352}',  # above the binding's 8192 too: once told "<= 8192", then "<= 4096"
    '{"top_k": 8192}',
    '{"top_k": 4097}',  # once ended with "HiSparse cannot serve this top_k", with no value to set
    '{"top_k": 4097, "device_buffer_size": 8192}',
    '{"top_k": 5000, "device_buffer_size": 4096}',  # not "device_buffer_size (4096) must be >= top_k (5000)"
    '{"top_k": 20000, "page_size": 256, "swap_in_block_size": 256}',
    '{"top_k": 1%s}' % ("0" * 20),
]


def suggested(message: str) -> tuple[int, int]:
    """The top_k and device_buffer_size the message tells the user to set at most."""
    import re

    found = re.search(
        r"Set top_k <= (\d+) and remove device_buffer_size \(its default fits\) or set it <= (\d+)", message
    )
    assert found, message
    return int(found.group(1)), int(found.group(2))


@pytest.mark.parametrize("text", TOO_LARGE_TOP_K, ids=[t[:48] for t in TOO_LARGE_TOP_K])
def test_a_top_k_the_kernel_cannot_take_gets_one_message_whose_fix_parses(text):
    import json

    with pytest.raises(HiSparseConfigError) as info:
        HiSparseConfig.from_json(text)
    message = str(info.value)
    assert message.startswith("top_k (") and "is more than the swap-in kernel takes" in message, message
    assert "<= 8192" not in message, message  # the binding's limit is not the one that binds
    assert len(message) <= 500 and message.isascii(), message
    values = json.loads(text)
    page_size, threads = values.get("page_size", 64), values.get("swap_in_block_size", 1024)
    assert f"page_size {page_size} and swap_in_block_size {threads}" in message
    top_k, buffer = suggested(message)
    assert top_k == 4096, message
    # The fix works: the largest top_k with its default buffer and with the largest buffer named ...
    fixed = {**values, "top_k": top_k}
    fixed.pop("device_buffer_size", None)
    assert HiSparseConfig.from_json(json.dumps(fixed)).top_k == top_k
    assert HiSparseConfig.from_json(json.dumps({**fixed, "device_buffer_size": buffer})).device_buffer_size == buffer
    # ... and both are the largest: one more of either is refused.
    for larger in ({**fixed, "top_k": top_k + 1}, {**fixed, "device_buffer_size": buffer + page_size}):
        with pytest.raises(HiSparseConfigError):
            HiSparseConfig.from_json(json.dumps(larger))


def test_a_top_k_too_large_for_the_buffer_set_names_what_that_buffer_takes():
    with pytest.raises(HiSparseConfigError) as info:
        HiSparseConfig.from_json('{"top_k": 4097, "device_buffer_size": 8192}')
    assert "with device_buffer_size 8192, top_k <= 2048." in str(info.value), str(info.value)
    assert HiSparseConfig.from_json('{"top_k": 2048, "device_buffer_size": 8192}').top_k == 2048
    with pytest.raises(HiSparseConfigError, match=r"device_buffer_size \(8192\) is too large"):
        HiSparseConfig.from_json('{"top_k": 2112, "device_buffer_size": 8192}')


@pytest.mark.parametrize("text", ["{}", '{"top_k": 4097}', '{"top_k": 2048}', '{"top_k": 2048, "page_size": 128}'])
def test_a_model_index_topk_the_kernel_cannot_take_says_the_model_cannot_be_served(text):
    """top_k must equal the model's index_topk: "set top_k <= 4096" would be no fix, nor would
    "set it to 4097" when the user's top_k differs from the model's."""
    with pytest.raises(HiSparseConfigError) as info:
        HiSparseConfig.from_json(text, model_index_topk=4097)
    message = str(info.value)
    assert message.startswith("top_k 4097 (the model's index_topk) is more than the swap-in kernel takes"), message
    assert "top_k <= 4096" in message and "serve it without HiSparse" in message, message
    assert "Set top_k" not in message and "set it to 4097" not in message, message
    assert HiSparseConfig.from_json("{}", model_index_topk=4096).top_k == 4096


def test_config_error_is_a_value_error():
    assert issubclass(HiSparseConfigError, ValueError)


def test_non_string_input_is_rejected():
    with pytest.raises(HiSparseConfigError, match="must be a JSON string"):
        HiSparseConfig.from_json(b'{"top_k": 1}')  # type: ignore[arg-type]


def test_direct_construction_validates_too():
    with pytest.raises(HiSparseConfigError, match="device_buffer_size"):
        HiSparseConfig(top_k=4096, device_buffer_size=2048)
    with pytest.raises(HiSparseConfigError, match="share_host_pool_across_tp must be true or false, got 1; write"):
        HiSparseConfig(share_host_pool_across_tp=1)  # type: ignore[arg-type]


# Hostile inputs: (json text, the key the message must name, a fragment of its fix).
HOSTILE = [
    ('{"top_k": 1%s}' % ("0" * 400), "top_k", "[1, 4096]"),
    ('{"pd_quarantine_s": 1%s}' % ("0" * 400), "pd_quarantine_s", "[0, 3600]"),
    ('{"promote_free_fraction": 1%s}' % ("0" * 400), "promote_free_fraction", "[0, 1)"),
    ('{"host_to_device_ratio": %s}' % ("9" * 5000), "host_to_device_ratio", "[1, 1024]"),
    ('{"promote_free_fraction": 1e400}', "promote_free_fraction", "[0, 1)"),
    ('{"device_buffer_size": -1e999}', "device_buffer_size", "[1, 32767]"),
    ('{"promote_free_fraction": NaN}', "promote_free_fraction", "[0, 1)"),
    ('{"pd_quarantine_s": Infinity}', "pd_quarantine_s", "[0, 3600]"),
    ('{"switch_cooldown_steps": -Infinity}', "switch_cooldown_steps", "[0, 1000000]"),
    ('{"top_k": %s2048%s}' % ("[" * 50_000, "]" * 50_000), "top_k", "true, false or null"),
    ('{"top_k": "%s"}' % ("7" * 1_000_000), "top_k", "integer"),
    ('{"%s": 1}' % ("k" * 1_000_000), "unknown key", "Known keys"),
    ('{"top_k": [%s]}' % ",".join(["1"] * 100_000), "top_k", "integer"),
    ('{"resident_first": "%s"}' % ("\u00e9" * 300_000), "resident_first", "true or false"),
    ("\u00a0", "U+00A0", "'{}' for the defaults"),
    ("\u2003\u3000 \t", "U+2003", "'{}' for the defaults"),
    ('\u00a0{"top_k": 2048}', "U+00A0", "Example"),
    ('\ufeff{"top_k": 2048}', "U+FEFF", "remove it"),
    ('{"top_k": 2048}\udcff', "U+DCFF", "Example"),
    ('{"\ud800": 1}', "unknown key", "Known keys"),
    ('{"TOP_K": 2048}', "TOP_K", "Did you mean 'top_k'"),
    ('{"top-k": 2048}', "top-k", "Did you mean 'top_k'"),
    ('{"top_k": 2048, "device_buffer_size": 4096, "top_k": 2048}', "top_k", "keep one"),
    ('{"top_k": 2048.5}', "top_k", "[1, 4096]"),
    ('{"top_k": 1e300}', "top_k", "[1, 4096]"),
    ('{"top_k": "2048"}', "top_k", "without quotes"),
    ('{"resident_first": 0}', "resident_first", "true or false"),
    ('{"share_host_pool_across_tp": "%s"}' % ("\u00e9" * 300_000), "share_host_pool_across_tp", "write false"),
    ('{"promote_free_fraction": true}', "promote_free_fraction", "[0, 1)"),
    ('{"swap_in_block_size": false}', "swap_in_block_size", "256"),
    ('{"max_switches_per_step": null}', "max_switches_per_step", "remove max_switches_per_step"),
    ('{"page_size": {"value": 64}}', "page_size", "integer"),
    ("[" + ",".join(["{}"] * 10_000) + "]", "JSON object", "such as"),
    ('"' + "x" * 1_000_000 + '"', "JSON object", "such as"),
    ("{" * 10_000, "JSON", "Example"),
]


@pytest.mark.parametrize("text,key,fix", HOSTILE, ids=[ascii(h[0][:30]) for h in HOSTILE])
def test_hostile_config_is_rejected_naming_the_key_and_fix_in_a_short_ascii_message(text, key, fix):
    with pytest.raises(HiSparseConfigError) as info:
        HiSparseConfig.from_json(text)
    message = str(info.value)
    assert key in message and fix in message, message
    assert len(message) <= 500, f"{len(message)} characters: {message[:200]}..."
    assert message.isascii(), message


def test_json_whitespace_alone_means_defaults_and_nothing_else_does():
    for blank in ["", " ", "\t\r\n ", None]:
        assert HiSparseConfig.from_json(blank) == HiSparseConfig()
    assert HiSparseConfig.from_json("  {}\n") == HiSparseConfig()


def test_negative_zero_and_integer_floats_for_float_keys_are_plain_numbers():
    config = HiSparseConfig.from_json('{"promote_free_fraction": -0.0, "pd_quarantine_s": 30}')
    assert config.promote_free_fraction == 0.0 and str(config.promote_free_fraction) == "0.0"
    assert config.pd_quarantine_s == 30.0 and isinstance(config.pd_quarantine_s, float)


def test_direct_construction_of_unbounded_values_stays_bounded():
    for kwargs in [dict(top_k=10**400), dict(pd_quarantine_s=10**400), dict(promote_free_fraction=float("nan")),
                   dict(device_buffer_size="x" * 10**6), dict(host_to_device_ratio=[0] * 10**5)]:
        with pytest.raises(HiSparseConfigError) as info:
            HiSparseConfig(**kwargs)
        assert next(iter(kwargs)) in str(info.value) and len(str(info.value)) <= 500


def test_from_dict_rejects_non_objects_and_non_string_keys():
    with pytest.raises(HiSparseConfigError, match="must be a JSON object"):
        HiSparseConfig.from_dict([("top_k", 2048)])  # type: ignore[arg-type]
    with pytest.raises(HiSparseConfigError, match="keys must be strings"):
        HiSparseConfig.from_dict({7: 1})  # type: ignore[dict-item]


def test_messages_do_not_blame_a_key_the_user_left_out():
    with pytest.raises(HiSparseConfigError) as info:
        HiSparseConfig.from_json('{"device_buffer_size": 1024}', model_index_topk=2048)
    assert "top_k is the model's index_topk" in str(info.value)
    # the default buffer follows the user's page size and top_k
    assert HiSparseConfig.from_json('{"page_size": 128, "top_k": 1000}').device_buffer_size == 2048


PAGE_SIZE_CASES = [
    # (hisparse config, SGLang --page-size, fragments the message must hold, fragments it must not)
    ("{}", 32, ["--page-size 32", "remove --page-size or set it to 64"], ["in --hisparse-config"]),
    ('{"page_size": 32}', 64, ["page_size in --hisparse-config (32)", "SGLang's page size (64)"], ["use --page-size"]),
    ('{"page_size": 32}', 128, ["page_size in --hisparse-config (32)", "use --page-size 64"], []),
    ('{"page_size": 32}', 32, ["page_size (32) must be 64", "page_size in --hisparse-config and --page-size"], []),
    ('{"page_size": 32}', None, ["page_size (32) must be 64", "remove page_size in --hisparse-config."], []),
]


@pytest.mark.parametrize("text,server_page,wanted,unwanted", PAGE_SIZE_CASES)
def test_page_size_mismatch_blames_the_setting_the_user_wrote(text, server_page, wanted, unwanted):
    import types

    from hisparse_sglang.integration.sglang.validation import config_from_server_args

    args = types.SimpleNamespace(hisparse_config=text, page_size=server_page)
    with pytest.raises(HiSparseConfigError) as info:
        config_from_server_args(args, model_index_topk=2048)
    message = str(info.value)
    assert all(f in message for f in wanted) and not any(f in message for f in unwanted), message
    assert config_from_server_args(types.SimpleNamespace(hisparse_config="{}", page_size=64)).page_size == 64


json_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20)
)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.text(max_size=8), inner, max_size=3), max_leaves=8)
config_keys = st.sampled_from(HiSparseConfig.known_keys()) | st.text(max_size=12)


@settings(max_examples=int(os.environ.get("HISPARSE_PROPERTY_EXAMPLES", "10000")) // 20 or 1, deadline=None)
@given(values=st.dictionaries(config_keys, json_values, max_size=5), raw=st.text(max_size=40), model_topk=st.none()
       | st.integers(-3, 10_000))
def test_any_object_or_text_gives_a_config_or_a_bounded_config_error(values, raw, model_topk):
    import json

    for text in (json.dumps(values), raw, json.dumps(values)[: len(raw)]):
        try:
            config = HiSparseConfig.from_json(text, model_index_topk=model_topk)
        except HiSparseConfigError as exc:
            assert len(str(exc)) <= 500 and str(exc).isascii(), str(exc)
        else:
            assert config.top_k <= config.device_buffer_size and HiSparseConfig.from_json(config.to_json()) == config


def test_every_reader_of_the_config_gets_the_same_default_with_speculative_decoding(monkeypatch):
    """The verify positions need not fit the buffer together (a step whose positions name more tokens than it
    holds accepts fewer drafts, docs/speculative.md 2.9), so speculative decoding keeps the 2 x top_k default:
    startup validation (the resolved view) and SGLang's parse_hisparse_config with the record (0.5.17, 0.5.18)
    and without one (0.5.19+: the published record) all see 4096 slots; a value the user sets is kept."""
    import types

    from hisparse_sglang.integration.sglang import compat, validation
    from hisparse_sglang.integration.sglang.validation import config_from_server_args

    args = types.SimpleNamespace(hisparse_config=None, page_size=64, speculative_algorithm="EAGLE",
                                 speculative_num_draft_tokens=4)
    monkeypatch.setattr(compat, "published_server_args", lambda: args)
    monkeypatch.setattr(compat, "hisparse_config_json", lambda server_args=None: None)
    with_record = config_from_server_args(args, model_index_topk=2048)
    assert with_record.device_buffer_size == 4096
    assert config_from_server_args(None, model_index_topk=2048) is with_record
    monkeypatch.setattr(compat, "hisparse_config_json", lambda server_args=None: '{"device_buffer_size": 8192}')
    assert config_from_server_args(args, model_index_topk=2048).device_buffer_size == 8192
    validation._parsed.cache_clear()
