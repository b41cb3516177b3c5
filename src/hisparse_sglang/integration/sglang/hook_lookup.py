"""What the hook bodies of ``hooks_*.py`` look up on the SGLang objects they receive: the HiSparse
runtime behind one, and its started coordinator. ``runtime`` is imported when a hook first runs, in the
process that runs it, so that importing the hook modules imports nothing beyond them; the scheduler's
hooks then look up about ten times a speculative step, so the lookup is bound once, not imported per call."""

from __future__ import annotations

_lookup = None


def runtime_of(sglang_object):
    """:func:`runtime.runtime_of`, imported in the process that runs the hook (at its first call)."""
    global _lookup
    if _lookup is None:
        from hisparse_sglang.integration.sglang.runtime import runtime_of as lookup

        _lookup = lookup
    return _lookup(sglang_object)


def coordinator_of(sglang_object):
    """The started coordinator of the runtime behind ``sglang_object`` (:func:`runtime.runtime_of`), else None."""
    runtime = runtime_of(sglang_object)
    return runtime.coordinator if runtime is not None else None
