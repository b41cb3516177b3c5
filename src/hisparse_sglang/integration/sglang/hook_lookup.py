"""What the hook bodies of ``hooks_*.py`` look up on the SGLang objects they receive: the HiSparse
runtime behind one, and its started coordinator. ``runtime`` is imported when a hook runs, in the
process that runs it, so that importing the hook modules imports nothing beyond them."""

from __future__ import annotations


def runtime_of(sglang_object):
    """:func:`runtime.runtime_of`, imported in the process that runs the hook."""
    from hisparse_sglang.integration.sglang.runtime import runtime_of as lookup

    return lookup(sglang_object)


def coordinator_of(sglang_object):
    """The started coordinator of the runtime behind ``sglang_object`` (:func:`runtime.runtime_of`), else None."""
    runtime = runtime_of(sglang_object)
    return runtime.coordinator if runtime is not None else None
