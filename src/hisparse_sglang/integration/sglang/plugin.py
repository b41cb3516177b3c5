"""SGLang plugin entry point (group ``sglang.srt.plugins``, name ``hisparse``).

SGLang calls :func:`register` with no arguments in every process that loads plugins.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def register() -> None:
    """Register HiSparse's hooks with SGLang's HookRegistry.

    The SGLang wiring is not part of this release yet: nothing is registered, so SGLang runs
    unchanged (and its in-tree HiSparse serves --enable-hisparse).
    """
    logger.debug("hisparse-sglang %s loaded; SGLang integration not wired in this release", _version())


def _version() -> str:
    from hisparse_sglang import __version__

    return __version__
