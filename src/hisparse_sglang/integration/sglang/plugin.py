"""SGLang plugin entry point (group ``sglang.srt.plugins``, name ``hisparse``).

SGLang calls :func:`register` with no arguments in every process that loads plugins: the main
process (server-argument validation runs there, before any model load), each scheduler process (the
coordinator, pool, allocator and scheduler hooks run there) and, from 0.5.22, the data-parallel
controller and the detokenizer, which hold no KV memory: there the plugin registers nothing and
imports nothing of SGLang's.

On an SGLang release outside ``compat.SUPPORTED_SGLANG`` the plugin does not install its hooks. It
logs an error naming the installed release and the supported range, and registers one guard: a
server started with ``--enable-hisparse`` stops at argument validation, in the main process, with
the same message (:class:`~hisparse_sglang.errors.UnsupportedSGLangError`). Raising from
:func:`register` itself would not stop anything: SGLang's ``load_plugins()`` logs a plugin's
exception and goes on without it.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def register() -> None:
    """Register hisparse-sglang's hooks with SGLang's HookRegistry (applied by load_plugins)."""
    from hisparse_sglang import __version__
    from hisparse_sglang.integration.sglang import compat
    from hisparse_sglang.integration.sglang.hooks import register_all

    role = compat.process_role()
    if role == "light":
        logger.debug("hisparse-sglang %s: nothing to register in %s", __version__, compat.process_title())
        return
    installed = compat.sglang_version()
    if not compat.is_supported(installed):
        logger.error("%s --enable-hisparse will be refused at startup.", compat.unsupported_message(installed))
    targets = register_all(role, installed)
    logger.info("hisparse-sglang %s: registered %d hooks (%s process)", __version__, len(targets), role)
