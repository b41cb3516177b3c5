"""Our kernel built from another source tree (``table --against DIR``), driven with this tree's arguments.

The ``swap_in`` binding of sources from before the forward-progress change (issue #27) takes one
more argument, the test hook ``late_copiers_ns`` (right before the stream), and a launch workspace
of three int32 counters per batch row (flags, done, looked) where this tree's has
``SYNC_COUNTERS_PER_ROW``. The ``swap_in_positions`` binding of sources from before the verify's fused
top-k (issue #24) takes no ``resident_rows_given`` (after ``positions_per_group``). :func:`adapt` wraps a
kernel library so that ``CudaOps`` drives either kind unchanged: the first call of one of these two that
tvm-ffi refuses for its argument count (refused before any launch) switches the wrapper to that function's
earlier signature for good (``swap_in``: hook 0, and a zeroed workspace of the earlier layout kept here,
which the earlier kernel also leaves zero after every launch; ``swap_in_positions``: the argument dropped,
and refused where it asks for given rows, which the earlier kernel cannot pass through). Every other
function passes through.
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
        self._earlier: dict[str, bool] = {}  # per adapted function; unknown until its first call
        self._earlier_workspace: torch.Tensor | None = None

    def swap_in(self, *args):
        return self._call("swap_in", args, self._earlier_arguments)

    def swap_in_positions(self, *args):
        return self._call("swap_in_positions", args, self._earlier_positions_arguments)

    def _call(self, name: str, args: tuple, earlier_arguments):
        """``name`` with this tree's ``args``, or with ``earlier_arguments(args)`` once the library refused them."""
        function = getattr(self._module, name)
        if name not in self._earlier:
            try:
                result = function(*args)
            except TypeError as exc:
                if _ARITY_ERROR not in str(exc):
                    raise
                self._earlier[name] = True
            else:
                self._earlier[name] = False
                return result
        return function(*(earlier_arguments(args) if self._earlier[name] else args))

    @staticmethod
    def _earlier_positions_arguments(args: tuple) -> tuple:
        """This tree's ``swap_in_positions`` arguments (..., positions_per_group, resident_rows_given, splits,
        threads, stream) as the binding from before ``resident_rows_given`` takes them."""
        *head, resident_rows_given, splits, threads, stream = args
        if resident_rows_given:
            raise ValueError(
                "swap_in_positions(resident_rows=True): the --against kernel predates given resident rows "
                "(it would translate them as positions); time it with resident_rows=False."
            )
        return (*head, splits, threads, stream)

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
