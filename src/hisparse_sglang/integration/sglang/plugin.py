"""SGLang plugin entry point (group ``sglang.srt.plugins``, name ``hisparse``).

SGLang calls :func:`register` with no arguments in every process that loads plugins: the main
process (server-argument validation runs there, before any model load) and each scheduler
process (the coordinator, pool, allocator and scheduler hooks run there).
"""

from __future__ import annotations

import logging
import multiprocessing

logger = logging.getLogger(__name__)


def register() -> None:
    """Register hisparse-sglang's hooks with SGLang's HookRegistry (applied by load_plugins)."""
    from hisparse_sglang import __version__
    from hisparse_sglang.integration.sglang import compat
    from hisparse_sglang.integration.sglang.hooks import register_all

    compat.check_version()
    scheduler_process = multiprocessing.parent_process() is not None
    targets = register_all(scheduler_process=scheduler_process)
    logger.info(
        "hisparse-sglang %s: registered %d hooks (%s process)",
        __version__, len(targets), "scheduler" if scheduler_process else "main",
    )
