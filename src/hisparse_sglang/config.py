"""HiSparse configuration: the `--hisparse-config` JSON, parsed once into a frozen dataclass.

Every key is optional. Whatever the text holds (malformed or hostile JSON included), parsing either
returns a valid :class:`HiSparseConfig` or raises :class:`HiSparseConfigError`, whose message
names the key, the offending value (shortened) and how to fix it, and stays a few hundred
characters long.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import unicodedata
from typing import Any

from hisparse_sglang.errors import HiSparseConfigError
from hisparse_sglang.ops.swap_in_plan import (
    MAX_DEVICE_BUFFER_SIZE,
    MAX_TOP_K,
    SM90_SHARED_MEMORY_PER_BLOCK,
    SWAP_IN_BLOCK_SIZES,
    check_swap_in_fits,
    check_top_k_fits,
    largest_device_buffer_size,
    largest_top_k,
    shared_memory_per_block,
)

__all__ = ["HiSparseConfig", "HiSparseConfigError", "DEFAULT_TOP_K", "DEFAULT_PAGE_SIZE", "parse_config_text"]

DEFAULT_TOP_K = 2048
DEFAULT_PAGE_SIZE = 64  # SGLang's DSA KV cache pages
# Characters of a user's text or value quoted in a message.
_QUOTE_LIMIT = 60
# Integers longer than this are outside every key's range; they are not even converted (a JSON
# number of thousands of digits would otherwise exceed Python's int conversion limit).
_MAX_INT_DIGITS = 30
# JSON allows only these as whitespace (RFC 8259); str.strip() would also remove U+00A0 and others.
_JSON_WHITESPACE = " \t\n\r"
_EXAMPLE = '{"top_k": 2048, "device_buffer_size": 4096, "host_to_device_ratio": 10}'


@dataclasses.dataclass(frozen=True)
class HiSparseConfig:
    """Validated HiSparse settings (README.md, section Configuration, is the user-facing reference).

    Attributes:
        top_k: tokens the sparse indexer selects per layer and decode step; must equal the
            model's ``index_topk`` when the model declares one.
        device_buffer_size: LRU slots per request in the GPU buffer of an offloaded request;
            a multiple of ``page_size`` and at least ``top_k``; the swap-in kernel's shared memory
            bounds it from above (``ops/swap_in_plan.py``).
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
        share_host_pool_across_tp: experimental, off by default. With TP > 1 and DP attention
            off, the TP ranks of a node map one host pool (written by one of them) instead of one
            identical pool each; no effect with DP attention or one rank per node. Proven on the
            CPU only (docs/shared-host-pool.md).
    """

    top_k: int = DEFAULT_TOP_K
    device_buffer_size: int = 2 * DEFAULT_TOP_K
    host_to_device_ratio: int = 2
    page_size: int = DEFAULT_PAGE_SIZE
    swap_in_block_size: int | None = None
    resident_first: bool = True
    promote_free_fraction: float = 0.25
    switch_cooldown_steps: int = 32
    max_switches_per_step: int = 8
    pd_quarantine_s: float = 60.0
    share_host_pool_across_tp: bool = False

    def __post_init__(self) -> None:
        _validate(dataclasses.asdict(self), origins={})

    @property
    def padded_buffer_size(self) -> int:
        """Device rows of one offloaded request: the LRU slots plus one page for the newest token."""
        return self.device_buffer_size + self.page_size

    @classmethod
    def known_keys(cls) -> tuple[str, ...]:
        return tuple(field.name for field in dataclasses.fields(cls))

    @classmethod
    def from_json(
        cls, text: str | None, model_index_topk: int | None = None
    ) -> "HiSparseConfig":
        """Parse the ``--hisparse-config`` JSON object.

        Args:
            text: the JSON text; None, empty or JSON whitespace only means all defaults.
            model_index_topk: the model's ``index_topk`` if it has one. It is the default
                ``top_k``, and an explicit ``top_k`` must agree with it.

        Raises:
            HiSparseConfigError: malformed JSON, unknown key, wrong type or bad value.
        """
        return cls.from_dict(parse_config_text(text), model_index_topk=model_index_topk)

    @classmethod
    def from_dict(
        cls, values: dict[str, Any], model_index_topk: int | None = None
    ) -> "HiSparseConfig":
        """Build from the parsed object; keys not given take their defaults (see from_json)."""
        if not isinstance(values, dict):
            raise HiSparseConfigError(
                f"--hisparse-config must be a JSON object such as '{_EXAMPLE}', got {_shown(values)}."
            )
        known = cls.known_keys()
        for key in values:
            if key not in known:
                raise HiSparseConfigError(_unknown_key_message(key, known))
        origins: dict[str, str] = {}
        if model_index_topk is not None:
            # Only its type and sign here: what the kernel takes is checked with the other values.
            _check_int("model index_topk", model_index_topk, 1, math.inf, "check index_topk in the model's config.json")
        kwargs = {name: _coerce(name, value) for name, value in values.items()}
        if model_index_topk is not None:
            if "top_k" in kwargs and kwargs["top_k"] != model_index_topk:
                # Telling the user to write the model's value is no fix if the kernel cannot take it.
                _check_model_top_k_fits(model_index_topk, kwargs)
                raise HiSparseConfigError(
                    f"top_k ({kwargs['top_k']}) differs from the model's index_topk ({model_index_topk}); "
                    f"the indexer always selects index_topk tokens. Remove top_k or set it to {model_index_topk}."
                )
            kwargs["top_k"] = model_index_topk
            # Equal to the model's or taken from it: top_k is not the user's to lower.
            origins["top_k"] = "the model's index_topk"
        kwargs.setdefault("top_k", DEFAULT_TOP_K)
        kwargs.setdefault("page_size", DEFAULT_PAGE_SIZE)
        if "device_buffer_size" not in kwargs:
            origins["device_buffer_size"] = "its default, 2 x top_k rounded up to a page"
            default = _default_buffer_size(kwargs)
            if default is not None:
                kwargs["device_buffer_size"] = default
        _validate({**_defaults(), **kwargs}, origins)
        return cls(**kwargs)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


# ----------------------------------------------------------------------------------- key specs
# name -> (kind, default); kind "int", "int or null", "bool" or "float".
_KINDS = {
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
    "share_host_pool_across_tp": "bool",
}
# Integer keys: (minimum, maximum, what to do), the one statement of each range. top_k has no
# maximum here: what the swap-in kernel takes depends on page_size and swap_in_block_size, and
# check_top_k_fits states it, with the fix, in one message.
_INT_RANGES = {
    "top_k": (1, None, "remove top_k: it defaults to the model's index_topk"),
    "device_buffer_size": (1, MAX_DEVICE_BUFFER_SIZE, "2 x top_k (4096 for top_k 2048) is a good choice"),
    "host_to_device_ratio": (1, 1024, "size it from host RAM (README.md, Configuration)"),
    "page_size": (1, 4096, "remove page_size: SGLang's DSA backend uses 64"),
    "swap_in_block_size": (min(SWAP_IN_BLOCK_SIZES), max(SWAP_IN_BLOCK_SIZES), "use 256, 512, 1024 or null"),
    "switch_cooldown_steps": (0, 1_000_000, "32 is the default"),
    "max_switches_per_step": (1, 65536, "8 is the default"),
}
# Boolean keys whose fix says more than "write true or false".
_BOOL_FIXES = {
    "share_host_pool_across_tp": (
        "write false (the default: one host pool per TP rank) or true (experimental: one per node, "
        "docs/shared-host-pool.md)"
    ),
}
# Float keys: the range in words (the bounds themselves are checked in _validate).
_FLOAT_RANGES = {
    "promote_free_fraction": "a share of the device pool in [0, 1) (0.25 is the default)",
    "pd_quarantine_s": "seconds in [0, 3600] (60 is the default)",
}


def _check_model_top_k_fits(model_index_topk: int, kwargs: dict[str, Any]) -> None:
    """The kernel's verdict on the model's index_topk, with the user's page_size and
    swap_in_block_size where they are valid (their own checks report them otherwise)."""
    page_size = kwargs.get("page_size", DEFAULT_PAGE_SIZE)
    threads = kwargs.get("swap_in_block_size")
    if not (_is_int(page_size) and 1 <= page_size <= 4096):
        page_size = DEFAULT_PAGE_SIZE
    check_top_k_fits(
        model_index_topk, page_size, threads if threads in SWAP_IN_BLOCK_SIZES else None,
        top_k_origin="the model's index_topk",
    )


@functools.cache
def _sm90_top_k_limit() -> int:
    """The largest top_k the swap-in kernel takes on sm_90 with the default page size and block
    size (4096): the top of top_k's range in messages about its type (the value's own check,
    ``check_top_k_fits``, uses the page and block sizes in force)."""
    return largest_top_k(DEFAULT_PAGE_SIZE, None, SM90_SHARED_MEMORY_PER_BLOCK)


def _defaults() -> dict[str, Any]:
    return {field.name: field.default for field in dataclasses.fields(HiSparseConfig)}


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def _default_buffer_size(values: dict[str, Any]) -> int | None:
    """2 x top_k rounded up to a page, capped at the
    largest buffer the swap-in kernel can run on sm_90 (never below top_k); None while top_k or
    page_size is invalid (their own check reports it)."""
    top_k, page_size = values["top_k"], values["page_size"]
    threads = values.get("swap_in_block_size")
    if not all(_is_int(v) and 1 <= v <= 32768 for v in (top_k, page_size)) or not (
        threads is None or threads in SWAP_IN_BLOCK_SIZES
    ):
        return None
    preferred = min(_round_up(2 * top_k, page_size), MAX_DEVICE_BUFFER_SIZE // page_size * page_size)
    if top_k > MAX_TOP_K:
        return preferred
    largest = largest_device_buffer_size(top_k, page_size, threads, shared_memory_per_block())
    if largest is None:
        return preferred  # top_k itself does not fit: the kernel check names top_k
    return max(min(preferred, largest), _round_up(top_k, page_size))


# ----------------------------------------------------------------------------------- parsing
class _Unrepresentable:
    """A JSON number that is no usable value: NaN, +-Infinity, one that overflows a float, or an
    integer with more than _MAX_INT_DIGITS digits. Kept as its text until a key's check names it."""

    def __init__(self, text: str, why: str) -> None:
        self.text = text
        self.why = why


def _parse_int(text: str) -> int | _Unrepresentable:
    if len(text.lstrip("-")) > _MAX_INT_DIGITS:
        return _Unrepresentable(text, f"an integer of {len(text.lstrip('-'))} digits")
    return int(text)


def _parse_float(text: str) -> float | _Unrepresentable:
    value = float(text)
    if not math.isfinite(value):
        return _Unrepresentable(text, "a number too large for a float")
    return value


def _parse_constant(text: str) -> _Unrepresentable:
    return _Unrepresentable(text, "not a finite number")


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise HiSparseConfigError(
                f"key {_quoted(key)} appears twice in --hisparse-config; keep one of the two values."
            )
        result[key] = value
    return result


def parse_config_text(text: Any) -> dict[str, Any]:
    """The ``--hisparse-config`` text as a JSON object (raw values; keys are checked by from_dict).

    None, the empty string and JSON whitespace alone mean all defaults ({}).

    Raises:
        HiSparseConfigError: not a string, not JSON, not an object, or nested too deeply.
    """
    if text is None:
        return {}
    if not isinstance(text, str):
        raise HiSparseConfigError(f"--hisparse-config must be a JSON string, got {_shown(text)}; pass the JSON text.")
    if not text.strip(_JSON_WHITESPACE):
        return {}
    if text.startswith("\ufeff"):
        raise HiSparseConfigError(
            "--hisparse-config starts with a byte-order mark (U+FEFF), which JSON does not allow; remove it "
            "(e.g. save the file as UTF-8 without BOM)."
        )
    if not text.strip():
        raise HiSparseConfigError(
            f"--hisparse-config holds only whitespace, including {_character_name(_first_non_json_space(text))}, "
            f"which JSON does not allow; pass nothing or '{{}}' for the defaults, or an object such as '{_EXAMPLE}'."
        )
    try:
        value = json.loads(
            text,
            object_pairs_hook=_reject_duplicates,
            parse_int=_parse_int,
            parse_float=_parse_float,
            parse_constant=_parse_constant,
        )
    except json.JSONDecodeError as exc:
        raise HiSparseConfigError(
            f"--hisparse-config is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}"
            f"{_character_at(text, exc.pos)}): {_excerpt(text, exc.pos)}. Example: '{_EXAMPLE}'."
        ) from None
    except RecursionError:
        raise HiSparseConfigError(
            f"--hisparse-config nests arrays or objects too deeply{_deep_key_text(text)}; every value is a "
            f"number, true, false or null. Example: '{_EXAMPLE}'."
        ) from None
    if not isinstance(value, dict):
        raise HiSparseConfigError(
            f"--hisparse-config must be a JSON object such as '{_EXAMPLE}', got {_shown(value)}."
        )
    return value


def _first_non_json_space(text: str) -> str:
    return next(char for char in text if char not in _JSON_WHITESPACE)


def _character_name(char: str) -> str:
    return f"U+{ord(char):04X} ({unicodedata.name(char, 'unnamed character')})"


def _character_at(text: str, position: int) -> str:
    """', at U+00A0 (NO-BREAK SPACE)' when the offending character is not plain ASCII."""
    if 0 <= position < len(text) and not (32 <= ord(text[position]) < 127):
        return f", at {_character_name(text[position])}"
    return ""


def _excerpt(text: str, position: int) -> str:
    """Up to 40 characters around ``position``, escaped to ASCII."""
    start = max(0, position - 20)
    part = ascii(text[start : position + 20])
    return ("..." if start else "") + part + ("..." if position + 20 < len(text) else "")


def _deep_key_text(text: str) -> str:
    """' in the value of "top_k"': the top-level key whose value nests deepest (a linear scan, no
    recursion), or '' when none is found."""
    depth = 0
    in_string = escaped = False
    key_start = -1
    last_key = None
    for index, char in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
                if depth == 1 and key_start >= 0:
                    last_key = text[key_start : index + 1]
            continue
        if char == '"':
            in_string = True
            key_start = index if depth == 1 else -1
        elif char in "[{":
            depth += 1
            if depth > 64 and last_key is not None:
                try:
                    return f" in the value of {_quoted(json.loads(last_key))}"
                except (ValueError, RecursionError):
                    return ""
        elif char in "]}":
            depth -= 1
    return ""


# ----------------------------------------------------------------------------------- messages
def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _quoted(text: str) -> str:
    """A user's string, escaped to ASCII and shortened: safe to print whatever it holds."""
    shown = ascii(text[:_QUOTE_LIMIT])
    return shown + (f"... ({len(text)} characters)" if len(text) > _QUOTE_LIMIT else "")


def _shown(value: Any) -> str:
    """A JSON value as a message shows it: its JSON spelling, shortened."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, _Unrepresentable):
        return f"{_quoted(value.text)} ({value.why})"
    if isinstance(value, int):
        digits = len(str(abs(value))) if abs(value) < 10**_MAX_INT_DIGITS else None
        return str(value) if digits is not None else f"an integer of more than {_MAX_INT_DIGITS} digits"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        return f"the string {_quoted(value)}"
    if isinstance(value, list):
        return f"an array (list) of {len(value)} item{'s' if len(value) != 1 else ''}"
    if isinstance(value, dict):
        return f"an object of {len(value)} key{'s' if len(value) != 1 else ''}"
    return f"a {type(value).__name__}"


def _unknown_key_message(key: Any, known: tuple[str, ...]) -> str:
    if not isinstance(key, str):
        return f"--hisparse-config keys must be strings, got {_shown(key)}. Known keys: {', '.join(known)}."
    normalized = key.strip().lower().replace("-", "_").replace(" ", "_")
    close = [normalized] if normalized in known else []
    if not close and len(key) <= 64:
        close = difflib.get_close_matches(normalized, known, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return f"unknown key {_quoted(key)} in --hisparse-config.{hint} Known keys: {', '.join(known)}."


def _not_a_bool(name: str, value: Any) -> str:
    return f"{name} must be true or false, got {_shown(value)}; {_BOOL_FIXES.get(name, 'write true or false')}."


def _coerce(name: str, value: Any) -> Any:
    """Type-check one raw JSON value; range checks happen in _validate."""
    kind = _KINDS[name]
    if isinstance(value, _Unrepresentable):
        expected = "true or false" if kind == "bool" else _range_text(name)
        raise HiSparseConfigError(f"{name} is {_shown(value)}; use {expected}.")
    if kind == "bool":
        if not isinstance(value, bool):
            raise HiSparseConfigError(_not_a_bool(name, value))
        return value
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise HiSparseConfigError(f"{name} must be a number, got {_shown(value)}; use {_range_text(name)}.")
        return float(value) + 0.0  # -0.0 becomes 0.0
    if value is None and kind == "int or null":
        return None
    if not _is_int(value):
        if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
            hint = f"write {int(value)}"
        elif isinstance(value, str) and value.strip().lstrip("-").isdigit() and len(value) <= _MAX_INT_DIGITS:
            hint = f"write {value.strip()} without quotes"
        elif value is None:
            hint = f"remove {name} to use its default"
        else:
            hint = f"use {_range_text(name)}"
        raise HiSparseConfigError(f"{name} must be an integer, got {_shown(value)}; {hint}.")
    return value


def _range_text(name: str) -> str:
    if name == "top_k":
        return f"an integer in [1, {_sm90_top_k_limit()}] (the swap-in kernel's limit on an H100/H200)"
    if name in _INT_RANGES:
        minimum, maximum, _ = _INT_RANGES[name]
        return f"an integer in [{minimum}, {maximum}]"
    return _FLOAT_RANGES[name]


def _origin_note(name: str, origin: str | None) -> str:
    """' (top_k is the model's index_topk)' for a value the user did not set, else ''."""
    return f" ({name} is {origin})" if origin else ""


def _check_int(name: str, value: Any, minimum: int, maximum: float, fix: str, origin: str | None = None) -> None:
    shown_name = f"{name} ({_shown(value)}){_origin_note(name, origin)}"
    if not _is_int(value):
        raise HiSparseConfigError(f"{name} must be an integer, got {_shown(value)}; {fix}.")
    if value < minimum:
        raise HiSparseConfigError(f"{shown_name} must be >= {minimum}; {fix}.")
    if value > maximum:
        raise HiSparseConfigError(f"{shown_name} must be <= {maximum}; {fix}.")


def _check_number(name: str, value: Any, low: float, high: float, high_open: bool, why: str) -> None:
    """A finite number in [low, high) or [low, high]; ``why`` explains the range in the message."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise HiSparseConfigError(f"{name} must be a finite number, got {_shown(value)}; use {_range_text(name)}.")
    if isinstance(value, int) and abs(value) >= 10**_MAX_INT_DIGITS:
        shown = _shown(value)
    else:
        value = float(value)
        shown = _shown(value)
        if not math.isfinite(value):
            raise HiSparseConfigError(f"{name} must be a finite number, got {shown}; use {_range_text(name)}.")
        if (low <= value < high) if high_open else (low <= value <= high):
            return
    interval = f"[{low:g}, {high:g}{')' if high_open else ']'}"
    raise HiSparseConfigError(f"{name} ({shown}) must be in {interval}{why}")


# ----------------------------------------------------------------------------------- validation
def _validate(values: dict[str, Any], origins: dict[str, str]) -> None:
    """Check every value; ``origins`` says where a value came from when the user did not set it,
    so that a message never blames a key the user left out without saying so."""

    def check(name: str, extra_fix: str | None = None) -> None:
        minimum, maximum, fix = _INT_RANGES[name]
        _check_int(name, values[name], minimum, maximum, extra_fix or fix, origins.get(name))

    top_k_minimum, _, top_k_fix = _INT_RANGES["top_k"]
    # No upper bound here: check_top_k_fits states the kernel's whole limit in one message.
    _check_int("top_k", values["top_k"], top_k_minimum, math.inf, top_k_fix, origins.get("top_k"))
    check("page_size")
    page_size = values["page_size"]
    if page_size & (page_size - 1):
        raise HiSparseConfigError(
            f"page_size ({page_size}) must be a power of two; remove page_size (SGLang's DSA backend uses 64)."
        )
    threads = values["swap_in_block_size"]
    if threads is not None and threads not in SWAP_IN_BLOCK_SIZES:
        raise HiSparseConfigError(
            f"swap_in_block_size ({_shown(threads)}) must be one of {SWAP_IN_BLOCK_SIZES} or null (automatic)."
        )
    top_k = values["top_k"]
    top_k_origin = origins.get("top_k")
    buffer = values["device_buffer_size"]
    user_buffer = None if "device_buffer_size" in origins or not _is_int(buffer) else buffer
    check_top_k_fits(top_k, page_size, threads, user_buffer, top_k_origin=top_k_origin)
    check("device_buffer_size")
    if buffer < top_k:
        raise HiSparseConfigError(
            f"device_buffer_size ({buffer}) must be >= top_k ({top_k}){_origin_note('top_k', top_k_origin)}: every "
            f"selected token needs a slot. Use at least {_round_up(top_k, page_size)} (2 x top_k = "
            f"{_round_up(2 * top_k, page_size)} is a good choice)."
        )
    if buffer % page_size:
        raise HiSparseConfigError(
            f"device_buffer_size ({buffer}){_origin_note('device_buffer_size', origins.get('device_buffer_size'))} "
            f"must be a multiple of page_size ({page_size}); use {_round_up(buffer, page_size)}."
        )
    check_swap_in_fits(top_k, buffer, page_size, threads, top_k_origin=top_k_origin)
    check("host_to_device_ratio")
    for name in ("resident_first", "share_host_pool_across_tp"):
        if not isinstance(values[name], bool):
            raise HiSparseConfigError(_not_a_bool(name, values[name]))
    _check_number(
        "promote_free_fraction", values["promote_free_fraction"], 0.0, 1.0, True,
        ": it is the share of the device pool that must stay free after a promotion (0.25 is the default).",
    )
    check("switch_cooldown_steps")
    check("max_switches_per_step")
    _check_number(
        "pd_quarantine_s", values["pd_quarantine_s"], 0.0, 3600.0, False,
        " seconds; it should outlast the prefill instance's transfer timeout (Mooncake: MC_TRANSFER_TIMEOUT, "
        "30 s by default).",
    )
