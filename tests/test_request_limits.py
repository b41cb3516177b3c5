"""The request-length limits the get_worker_info hook reports, records and logs, from plain integers
(limits.decode_request_limits, colocated_request_limits, with_request_limits); every expected value is
worked out by hand in the case's comment."""

import pytest

from hisparse_sglang.integration.sglang import limits
from hisparse_sglang.integration.sglang.limits import (
    RequestLimits,
    colocated_request_limits,
    decode_request_limits,
    with_request_limits,
)

# A PD decode instance: GPU KV pool 4096 tokens, host_to_device_ratio 8 -> logical pool 32768 tokens; SGLang's
# --num-reserved-decode-tokens 512 -> capacity 32768 - 512 = 32256 (504 whole pages of 64). SGLang's own limits
# come from the GPU pool: max_req_len 4095, max_req_input_len 4091 (a margin of 4 for new tokens).
DECODE = dict(capacity=32_256, device_tokens=4_096, logical_tokens=32_768, reserved=512, host_to_device_ratio=8)
GPU_TAIL = ("The GPU KV pool (4096 tokens) holds only device buffers and resident requests here; the prefill "
            "instance's own KV pool still limits prompts there.")


def test_decode_limits_set_by_the_logical_pool():
    # context 65536 -> 65535; the pool: 32256 - 1 = 32255 < 65535, so the pool sets it; 32255 - 4 = 32251
    got = decode_request_limits(4_095, 4_091, context_len=65_536, **DECODE)
    assert (got.max_req_len, got.max_req_input_len) == (32_255, 32_251)
    assert got.startup_line == (
        "HiSparse PD decode: requests of up to 32255 tokens are admitted (prompts shorter than 32251), set by the "
        "logical (host) KV pool: 32768 tokens less --num-reserved-decode-tokens 512. " + GPU_TAIL
    )
    assert got.note == (
        "hisparse-sglang: on this PD decode instance a request must fit the logical (host) KV pool: 32768 tokens "
        "(GPU KV pool x host_to_device_ratio 8) less --num-reserved-decode-tokens (512) leaves 32256, which limits "
        "prompts to fewer than 32251 tokens. Raise host_to_device_ratio in --hisparse-config to admit longer prompts."
    )


@pytest.mark.parametrize(
    "context_len, expected",
    [
        (16_384, (16_383, 16_379)),  # 16383 < 32255: the context sets it, margin 4 kept
        (32_256, (32_255, 32_251)),  # 32255 == 32255: a tie is the context's, no note
    ],
)
def test_decode_limits_set_by_the_context(context_len, expected):
    got = decode_request_limits(4_095, 4_091, context_len=context_len, **DECODE)
    assert (got.max_req_len, got.max_req_input_len, got.note) == (*expected, None)
    assert got.startup_line == (
        f"HiSparse PD decode: requests of up to {expected[0]} tokens are admitted (prompts shorter than "
        f"{expected[1]}), set by the context length ({context_len}). " + GPU_TAIL
    )


def test_colocated_limits_set_by_the_gpu_pool():
    # SGLang's 4095 < 65536 - 1: the GPU pool sets it; SGLang's limits stand
    got = colocated_request_limits(4_095, 4_091, context_len=65_536, device_tokens=4_096)
    assert (got.max_req_len, got.max_req_input_len) == (4_095, 4_091)
    assert got.startup_line == (
        "HiSparse co-located: prompts shorter than 4091 tokens are admitted, set by the GPU KV pool (4096 tokens; "
        "the prefill writes the whole prompt there). Longer prompts need PD disaggregation with hisparse-sglang on "
        "the decode instance (docs/pd.md)."
    )
    assert "the GPU KV pool holds 4096 tokens, which limits prompts to fewer than 4091 tokens." in got.note


@pytest.mark.parametrize("max_req_len", [65_535, 70_000])  # at or above 65536 - 1: the context sets it
def test_colocated_limits_set_by_the_context(max_req_len):
    got = colocated_request_limits(max_req_len, max_req_len - 4, context_len=65_536, device_tokens=4_096)
    assert got == RequestLimits(
        max_req_len, max_req_len - 4, None,
        f"HiSparse co-located: prompts shorter than {max_req_len - 4} tokens are admitted, set by the context "
        "length (65536).",
    )


def test_with_request_limits_replaces_items_4_and_5_only():
    info = (4_096, 8, 2_048, 1, 4_095, 4_091, 7, None)  # item 0: the device pool, kept
    assert with_request_limits(info, RequestLimits(32_255, 32_251)) == (4_096, 8, 2_048, 1, 32_255, 32_251, 7, None)
    assert (limits.MAX_REQ_LEN_ITEM, limits.MAX_REQ_INPUT_LEN_ITEM) == (4, 5)


def test_a_prefill_instance_keeps_sglangs_limits_without_a_note_or_line():
    assert RequestLimits(4_095, 4_091) == RequestLimits(4_095, 4_091, note=None, startup_line=None)
