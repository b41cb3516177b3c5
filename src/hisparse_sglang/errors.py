"""Typed errors raised by hisparse_sglang. Messages name the offending value and the fix."""

from __future__ import annotations

__all__ = [
    "HiSparseError",
    "HiSparseConfigError",
    "HiSparseMemoryError",
    "PoolExhaustedError",
    "SharedHostPoolError",
    "RankDivergenceError",
    "KernelBuildError",
    "UnsupportedSetupError",
    "MooncakeRegistrationError",
    "UnsupportedSGLangError",
]


class HiSparseError(Exception):
    """Base class of every error this package raises on purpose."""


class HiSparseConfigError(HiSparseError, ValueError):
    """The --hisparse-config JSON (or a value derived from it) is invalid."""


class HiSparseMemoryError(HiSparseError, RuntimeError):
    """A memory-pool operation broke an invariant (double free, foreign row, wrong size)."""


class PoolExhaustedError(HiSparseMemoryError):
    """A pool has fewer free rows than an operation needs; callers check capacity first."""


class SharedHostPoolError(HiSparseMemoryError):
    """The TP ranks of a node could not share one host pool (memory/shared_host_pool.py)."""


class RankDivergenceError(HiSparseMemoryError):
    """TP ranks that share a host pool disagree on their allocation state: they would write and read
    different requests' KV in the same rows (memory/consistency.py)."""


class KernelBuildError(HiSparseError, RuntimeError):
    """A CUDA kernel could not be compiled or loaded."""


class UnsupportedSetupError(HiSparseError, ValueError):
    """The serving setup (model, backend, dtype, flags) cannot run HiSparse."""


class MooncakeRegistrationError(HiSparseError, RuntimeError):
    """Mooncake could not register the host KV pool that a PD prefill instance writes into."""


class UnsupportedSGLangError(UnsupportedSetupError):
    """The installed SGLang release is outside the range hisparse-sglang supports."""
