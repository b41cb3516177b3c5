"""HiSparse configuration: the `--hisparse-config` JSON, parsed once into a frozen dataclass.

Every key is optional. Unknown keys, wrong types and out-of-range values raise
:class:`HiSparseConfigError`, whose message names the offending value and how to fix it.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
from typing import Any

from hisparse_sglang.errors import HiSparseConfigError

__all__ = ["HiSparseConfig", "HiSparseConfigError", "DEFAULT_TOP_K"]

DEFAULT_TOP_K = 2048
# LRU order entries are int16, so a slot index must fit in 15 bits.
MAX_DEVICE_BUFFER_SIZE = 32767
# Thread counts the swap-in kernel is instantiated for (csrc/swap_in_binding.cu).
SWAP_IN_BLOCK_SIZES = (256, 512, 1024)


@dataclasses.dataclass(frozen=True)
class HiSparseConfig:
    """Validated HiSparse settings (README.md, section Configuration, is the user-facing reference).

    Attributes:
        top_k: tokens the sparse indexer selects per layer and decode step; must equal the
            model's ``index_topk`` when the model declares one.
        device_buffer_size: LRU slots per request in the GPU buffer of an offloaded request;
            a multiple of ``page_size`` and at least ``top_k``.
        host_to_device_ratio: the host pool (and SGLang's logical token space) holds this many
            times the device KV pool's tokens.
        page_size: tokens per KV page; SGLang's DSA backend requires 64.
        swap_in_block_size: CUDA threads per block of the swap-in kernel (256, 512 or 1024), or
            None for the op's default (1024).
        resident_first: keep a request's whole KV on the GPU while the device pool can hold
            it and demote it to the small buffer only under memory pressure. False reproduces
            SGLang's in-tree behaviour (every long request offloaded from its first step).
        promote_free_fraction: an offloaded request is promoted back to resident only if at
            least this fraction of the device pool stays free afterwards (hysteresis).
        switch_cooldown_steps: decode steps a request stays in a mode before it may switch
            back (hysteresis).
        pd_quarantine_s: PD decode only: seconds the host rows of a request whose KV transfer
            did not complete (failed, timed out or aborted) are held back before reuse, so that a
            late write from the prefill instance cannot land in another request's KV.
        max_switches_per_step: most promotions the coordinator starts in one scheduler step
            (bounds the copies added to any step; demotions copy nothing and happen only as
            far as memory pressure requires).
    """

    top_k: int = DEFAULT_TOP_K
    device_buffer_size: int = 2 * DEFAULT_TOP_K
    host_to_device_ratio: int = 2
    page_size: int = 64
    swap_in_block_size: int | None = None
    resident_first: bool = True
    promote_free_fraction: float = 0.25
    switch_cooldown_steps: int = 32
    max_switches_per_step: int = 8
    pd_quarantine_s: float = 60.0

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def padded_buffer_size(self) -> int:
        """Device rows of one offloaded request: the LRU slots plus one page for the newest token."""
        return self.device_buffer_size + self.page_size

    @classmethod
    def known_keys(cls) -> tuple[str, ...]:
        return tuple(field.name for field in dataclasses.fields(cls))

    @classmethod
    def from_json(cls, text: str | None, model_index_topk: int | None = None) -> "HiSparseConfig":
        """Parse the ``--hisparse-config`` JSON object.

        Args:
            text: the JSON text; None or blank means all defaults.
            model_index_topk: the model's ``index_topk`` if it has one. It is the default
                ``top_k``, and an explicit ``top_k`` must agree with it.

        Raises:
            HiSparseConfigError: malformed JSON, unknown key, wrong type or bad value.
        """
        values = _parse_object(text)
        return cls.from_dict(values, model_index_topk=model_index_topk)

    @classmethod
    def from_dict(cls, values: dict[str, Any], model_index_topk: int | None = None) -> "HiSparseConfig":
        known = cls.known_keys()
        for key in values:
            if key not in known:
                close = difflib.get_close_matches(key, known, n=1)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                raise HiSparseConfigError(
                    f"unknown key {key!r} in --hisparse-config.{hint} Known keys: {', '.join(known)}."
                )
        if model_index_topk is not None:
            _check_int("model index_topk", model_index_topk, minimum=1)
        kwargs: dict[str, Any] = {}
        for field in dataclasses.fields(cls):
            if field.name in values:
                kwargs[field.name] = _coerce(field.name, values[field.name])

        if "top_k" in kwargs and model_index_topk is not None and kwargs["top_k"] != model_index_topk:
            raise HiSparseConfigError(
                f"top_k ({kwargs['top_k']}) differs from the model's index_topk ({model_index_topk}); "
                f"the indexer always selects index_topk tokens. Remove top_k or set it to {model_index_topk}."
            )
        top_k = kwargs.setdefault("top_k", model_index_topk if model_index_topk is not None else DEFAULT_TOP_K)
        page_size = kwargs.setdefault("page_size", 64)
        if "device_buffer_size" not in kwargs and isinstance(top_k, int) and isinstance(page_size, int):
            if top_k >= 1 and page_size >= 1:
                kwargs["device_buffer_size"] = _round_up(2 * top_k, page_size)
        return cls(**kwargs)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


_EXPECTED_TYPES: dict[str, str] = {
    "top_k": "int",
    "device_buffer_size": "int",
    "host_to_device_ratio": "int",
    "page_size": "int",
    "swap_in_block_size": "int or null",
    "resident_first": "bool",
    "promote_free_fraction": "float",
    "switch_cooldown_steps": "int",
    "max_switches_per_step": "int",
    "pd_quarantine_s": "float",
}


def _parse_object(text: str | None) -> dict[str, Any]:
    if text is None or (isinstance(text, str) and not text.strip()):
        return {}
    if not isinstance(text, str):
        raise HiSparseConfigError(
            f"--hisparse-config must be a JSON string, got {type(text).__name__} ({text!r})."
        )

    def reject_constant(name: str) -> None:
        raise HiSparseConfigError(
            f"--hisparse-config contains {name}, which is not a valid number; use a finite number."
        )

    def reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        result: dict[str, Any] = {}
        for key, value in pairs:
            if key in result:
                raise HiSparseConfigError(
                    f"key {key!r} appears twice in --hisparse-config; keep one of the two values."
                )
            result[key] = value
        return result

    try:
        value = json.loads(text, object_pairs_hook=reject_duplicates, parse_constant=reject_constant)
    except json.JSONDecodeError as exc:
        raise HiSparseConfigError(
            f"--hisparse-config is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}): "
            f"{text!r}. Example: '{{\"top_k\": 2048, \"device_buffer_size\": 4096, \"host_to_device_ratio\": 10}}'."
        ) from None
    if not isinstance(value, dict):
        raise HiSparseConfigError(
            f"--hisparse-config must be a JSON object such as '{{\"top_k\": 2048}}', got {type(value).__name__}: {text!r}."
        )
    return value


def _coerce(name: str, value: Any) -> Any:
    """Type-check one raw JSON value; range checks happen in _validate."""
    expected = _EXPECTED_TYPES[name]
    if expected == "bool":
        if not isinstance(value, bool):
            raise HiSparseConfigError(f"{name} must be true or false, got {value!r}.")
        return value
    if expected == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise HiSparseConfigError(f"{name} must be a number, got {type(value).__name__} {value!r}.")
        return float(value)
    if value is None and expected == "int or null":
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            raise HiSparseConfigError(f"{name} must be an integer, got {value!r}; write {int(value)}.")
        raise HiSparseConfigError(f"{name} must be an integer, got {type(value).__name__} {value!r}.")
    return value


def _check_int(name: str, value: Any, minimum: int, maximum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise HiSparseConfigError(f"{name} must be an integer, got {type(value).__name__} {value!r}.")
    if value < minimum:
        raise HiSparseConfigError(f"{name} ({value}) must be >= {minimum}.")
    if maximum is not None and value > maximum:
        raise HiSparseConfigError(f"{name} ({value}) must be <= {maximum}.")


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def _validate(config: HiSparseConfig) -> None:
    _check_int("top_k", config.top_k, minimum=1, maximum=MAX_DEVICE_BUFFER_SIZE)
    _check_int("page_size", config.page_size, minimum=1, maximum=4096)
    if config.page_size & (config.page_size - 1):
        raise HiSparseConfigError(
            f"page_size ({config.page_size}) must be a power of two; SGLang's DSA backend uses 64."
        )
    _check_int("device_buffer_size", config.device_buffer_size, minimum=1, maximum=MAX_DEVICE_BUFFER_SIZE)
    if config.device_buffer_size < config.top_k:
        raise HiSparseConfigError(
            f"device_buffer_size ({config.device_buffer_size}) must be >= top_k ({config.top_k}): every "
            f"selected token needs a slot. Use at least {_round_up(config.top_k, config.page_size)} "
            f"(2 x top_k = {_round_up(2 * config.top_k, config.page_size)} is a good default)."
        )
    if config.device_buffer_size % config.page_size:
        raise HiSparseConfigError(
            f"device_buffer_size ({config.device_buffer_size}) must be a multiple of page_size "
            f"({config.page_size}); use {_round_up(config.device_buffer_size, config.page_size)}."
        )
    _check_int("host_to_device_ratio", config.host_to_device_ratio, minimum=1, maximum=1024)
    if config.swap_in_block_size is not None and config.swap_in_block_size not in SWAP_IN_BLOCK_SIZES:
        raise HiSparseConfigError(
            f"swap_in_block_size ({config.swap_in_block_size!r}) must be one of {SWAP_IN_BLOCK_SIZES} "
            f"or null (automatic)."
        )
    if not isinstance(config.resident_first, bool):
        raise HiSparseConfigError(f"resident_first must be true or false, got {config.resident_first!r}.")
    fraction = config.promote_free_fraction
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not math.isfinite(fraction):
        raise HiSparseConfigError(f"promote_free_fraction must be a finite number, got {fraction!r}.")
    if not 0.0 <= fraction < 1.0:
        raise HiSparseConfigError(
            f"promote_free_fraction ({fraction}) must be in [0, 1): it is the share of the device pool "
            f"that must stay free after a promotion (0.25 is the default)."
        )
    _check_int("switch_cooldown_steps", config.switch_cooldown_steps, minimum=0, maximum=1_000_000)
    _check_int("max_switches_per_step", config.max_switches_per_step, minimum=1, maximum=65536)
    quarantine = config.pd_quarantine_s
    if isinstance(quarantine, bool) or not isinstance(quarantine, (int, float)) or not math.isfinite(quarantine):
        raise HiSparseConfigError(f"pd_quarantine_s must be a finite number of seconds, got {quarantine!r}.")
    if not 0.0 <= quarantine <= 3600.0:
        raise HiSparseConfigError(
            f"pd_quarantine_s ({quarantine}) must be in [0, 3600] seconds; it should outlast the prefill "
            f"instance's transfer timeout (Mooncake: MC_TRANSFER_TIMEOUT, 30 s by default)."
        )
