"""Request-length limits of a HiSparse scheduler process, and the notes that explain them.

SGLang 0.5.17 sizes every request-length check by the device KV pool (``max_total_num_tokens``).
On a PD **decode** instance with hisparse-sglang a request's KV lives in the logical (host) pool
and only its device buffer needs the GPU, so the decode-side limit is the logical pool less the
tokens SGLang reserves for decoding (:func:`decode_request_capacity`). A **co-located** server
prefills on the GPU, so the device pool stays its limit; the notes say why and what to do.
"""

from __future__ import annotations

import dataclasses
import logging

from hisparse_sglang.errors import UnsupportedSetupError

__all__ = [
    "our_coordinator",
    "decode_request_capacity",
    "RequestLengthLimit",
    "record_limit",
    "explain_rejection",
    "colocated_note",
    "decode_note",
]

logger = logging.getLogger(__name__)


def our_coordinator(coordinator):
    """``coordinator`` if it is hisparse-sglang's (SGLang's in-tree one, or None, is not)."""
    from hisparse_sglang.integration.sglang.coordinator import SGLangHiSparseCoordinator

    return coordinator if isinstance(coordinator, SGLangHiSparseCoordinator) else None


def decode_request_capacity(coordinator, num_reserved_decode_tokens: int) -> int | None:
    """Longest request (prompt + output tokens) a PD decode instance can hold, per rank.

    The logical pool (host rows) less ``num_reserved_decode_tokens`` (SGLang's decode
    preallocation needs that much room beyond the request), rounded down to a whole page.

    Args:
        coordinator: ``model_runner.hisparse_coordinator`` / ``scheduler.hisparse_coordinator``.
        num_reserved_decode_tokens: SGLang's ``--num-reserved-decode-tokens``.
    Returns:
        the capacity in tokens, or None when hisparse-sglang's coordinator is not in use.
    Raises:
        UnsupportedSetupError: the logical pool is not larger than the reserve by a page.
    """
    coordinator = our_coordinator(coordinator)
    if coordinator is None:
        return None
    allocator = coordinator.allocator
    logical_tokens = allocator.size
    page_size = allocator.page_size
    capacity = (logical_tokens - num_reserved_decode_tokens) // page_size * page_size
    if capacity < page_size:
        raise UnsupportedSetupError(
            f"the HiSparse logical KV pool holds {logical_tokens} tokens (device pool {allocator.device_tokens} x "
            f"host_to_device_ratio {allocator.host_to_device_ratio}), which leaves less than a page of "
            f"{page_size} after --num-reserved-decode-tokens ({num_reserved_decode_tokens}); raise "
            f"host_to_device_ratio in --hisparse-config or lower --num-reserved-decode-tokens."
        )
    return capacity


@dataclasses.dataclass(frozen=True)
class RequestLengthLimit:
    """The prompt limit of this scheduler process when a KV pool (not the context length) sets it.

    Attributes:
        max_req_input_len: prompts of this many tokens or more are rejected (SGLang's value).
        note: what sets the limit and how to raise it, appended to SGLang's rejection message.
    """

    max_req_input_len: int
    note: str


# Set once per scheduler process, by the get_worker_info hook at startup (SGLang computes its
# limits there); read when SGLang's validate_input_length rejects a prompt.
_pool_limit: RequestLengthLimit | None = None


def record_limit(limit: RequestLengthLimit | None) -> None:
    """Remember this process's pool-set prompt limit (None: the context length sets it)."""
    global _pool_limit
    _pool_limit = limit


def explain_rejection(error_msg: str | None, max_req_input_len: int) -> str | None:
    """SGLang's rejection message with this process's note appended, when the limit it names is
    the one a KV pool sets (another limit, or no rejection, is returned unchanged)."""
    limit = _pool_limit
    if not error_msg or limit is None or limit.max_req_input_len != max_req_input_len:
        return error_msg
    return f"{error_msg} {limit.note}"


def colocated_note(max_req_input_len: int, device_tokens: int) -> str:
    """Why a co-located HiSparse server rejects a prompt longer than its GPU KV pool."""
    return (
        f"hisparse-sglang: with --enable-hisparse on a co-located server (no --disaggregation-mode) the "
        f"prefill writes the whole prompt into the GPU KV pool, so a prompt must fit it: the GPU KV pool "
        f"holds {device_tokens} tokens, which limits prompts to fewer than {max_req_input_len} tokens. "
        f"Longer prompts need PD disaggregation with hisparse-sglang on the decode instance (its limit "
        f"is the host pool; the prefill instance's GPU pool must still hold the prompt), or a larger GPU "
        f"KV pool (--mem-fraction-static)."
    )


def decode_note(max_req_input_len: int, capacity: int, logical_tokens: int, reserved: int, ratio: int) -> str:
    """Why a PD decode instance with hisparse-sglang rejects a prompt longer than its logical pool allows."""
    return (
        f"hisparse-sglang: on this PD decode instance a request must fit the logical (host) KV pool: "
        f"{logical_tokens} tokens (GPU KV pool x host_to_device_ratio {ratio}) less "
        f"--num-reserved-decode-tokens ({reserved}) leaves {capacity}, which limits prompts to fewer than "
        f"{max_req_input_len} tokens. Raise host_to_device_ratio in --hisparse-config to admit longer prompts."
    )
