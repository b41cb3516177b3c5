"""Everything that depends on the SGLang version, in one place.

Written against sglang 0.5.17. Request fields moved between releases (0.5.23 keeps the request
slot in ``req.kv.req_pool_idx``); accessors here absorb that, and :func:`check_version` says
when the installed SGLang is not the one the hooks were verified against.
"""

from __future__ import annotations

import functools
import logging
from importlib.metadata import PackageNotFoundError, version

logger = logging.getLogger(__name__)

SUPPORTED_SGLANG = "0.5.17"


@functools.cache
def sglang_version() -> str | None:
    try:
        return version("sglang")
    except PackageNotFoundError:
        return None


def check_version() -> bool:
    """True if the installed SGLang is the supported one; logs a warning otherwise."""
    installed = sglang_version()
    if installed != SUPPORTED_SGLANG:
        logger.warning(
            "hisparse-sglang was verified against sglang==%s but sglang %s is installed; its hooks may not "
            "apply (each failed hook is logged by SGLang's HookRegistry).",
            SUPPORTED_SGLANG,
            installed,
        )
        return False
    return True


def req_slot(req) -> int:
    """The request's slot in ReqToTokenPool."""
    slot = getattr(req, "req_pool_idx", None)
    if slot is None and getattr(req, "kv", None) is not None:
        slot = getattr(req.kv, "req_pool_idx", None)
    if slot is None:
        raise ValueError(f"request {getattr(req, 'rid', '?')} has no request-pool slot")
    return int(slot)


def req_kv_allocated_len(req) -> int:
    """Tokens with allocated logical locations (PD direct admission: the transferred prompt)."""
    return int(req.kv.kv_allocated_len)


def req_prefill_len(req) -> int:
    """Tokens computed by the prefill that just finished."""
    return int(req.extend_range.end)


def abort_reason(message: str):
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    return FINISH_ABORT(message)
