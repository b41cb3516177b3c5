"""The declared form of a hook hisparse-sglang installs into SGLang (``hooks.HOOKS``)."""

from __future__ import annotations

import dataclasses
from typing import Callable

from hisparse_sglang.integration.sglang import compat


@dataclasses.dataclass(frozen=True)
class HookSpec:
    target: str
    hook_type: str  # "BEFORE", "AFTER", "AROUND", "REPLACE"
    factory: Callable[[], object]  # returns the hook (a function, or a class for class REPLACE)
    why: str
    upstream: str
    _: dataclasses.KW_ONLY
    # The SGLang release whose source the hook was written from: its target, the target's signature and the
    # in-tree behaviour it corrects were read in that release. Required, so that a new spec states it.
    written_against: str
    scheduler_only: bool = True
    versions: str = compat.SUPPORTED_SGLANG  # the SGLang releases (PEP 440 specifier) it applies to

    def applies_to(self, sglang_version: str) -> bool:
        from packaging.specifiers import SpecifierSet

        return sglang_version in SpecifierSet(self.versions)
