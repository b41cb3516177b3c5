"""HiSparse for SGLang: the full MLA KV cache in pinned host memory, a small GPU buffer per request.

Importing this package is free of side effects: it imports no sglang, initialises no CUDA and
compiles nothing. SGLang loads the plugin through the ``sglang.srt.plugins`` entry point
(``hisparse_sglang.integration.sglang.plugin:register``).
"""

__version__ = "0.1.0"

from hisparse_sglang.config import HiSparseConfig
from hisparse_sglang.errors import HiSparseConfigError, HiSparseError

__all__ = ["HiSparseConfig", "HiSparseConfigError", "HiSparseError", "__version__"]
