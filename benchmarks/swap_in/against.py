"""Our kernel built from another source tree (``table --against DIR``), driven with this tree's arguments.

The ``swap_in`` binding of sources from before the forward-progress change (issue #27) takes one
more argument, the test hook ``late_copiers_ns`` (right before the stream), and a launch workspace
of three int32 counters per batch row (flags, done, looked) where this tree's has
``SYNC_COUNTERS_PER_ROW``. :func:`adapt` wraps a kernel library so that ``CudaOps`` drives either
kind unchanged: the first ``swap_in`` that tvm-ffi refuses for its argument count switches the
wrapper to the earlier signature for good (hook 0, and a zeroed workspace of the earlier layout
kept here, which the earlier kernel also leaves zero after every launch). Every other function
passes through.
"""

from __future__ import annotations

import torch

from hisparse_sglang.ops.swap_in_plan import SYNC_COUNTERS_PER_ROW

__all__ = ["adapt", "AgainstModule"]

_EARLIER_COUNTERS_PER_ROW = 3  # flags, done, looked
_ARITY_ERROR = "Mismatched number of arguments"  # tvm-ffi's TypeError for a call of the wrong arity


class AgainstModule:
    """A kernel library whose ``swap_in`` takes this tree's arguments, whichever signature it was built with."""

    def __init__(self, module) -> None:
        self._module = module
        self._earlier: bool | None = None  # unknown until the first swap_in
        self._earlier_workspace: torch.Tensor | None = None

    def swap_in(self, *args):
        if self._earlier is None:
            try:
                result = self._module.swap_in(*args)
            except TypeError as exc:
                if _ARITY_ERROR not in str(exc):
                    raise
                self._earlier = True
            else:
                self._earlier = False
                return result
        return self._module.swap_in(*(self._earlier_arguments(args) if self._earlier else args))

    def _earlier_arguments(self, args: tuple) -> tuple:
        """This tree's arguments (..., out, counters, workspace, plan, splits, threads, stream) as the
        earlier binding takes them."""
        *head, workspace, plan, splits, threads, stream = args
        entries = workspace.numel() // SYNC_COUNTERS_PER_ROW * _EARLIER_COUNTERS_PER_ROW
        if self._earlier_workspace is None or self._earlier_workspace.numel() < entries:
            self._earlier_workspace = torch.zeros(entries, dtype=torch.int32, device=workspace.device)
        return (*head, self._earlier_workspace, plan, splits, threads, 0, stream)

    def __getattr__(self, name: str):
        return getattr(self._module, name)


def adapt(module) -> AgainstModule:
    """``module`` (a ``jit.load_module(..., sources=DIR)`` library) behind :class:`AgainstModule`."""
    return AgainstModule(module)
