"""The TP ranks that share a host pool check that they took the same allocation decisions.

A shared pool is safe only while every rank hands the same logical locations (= host rows) to the
same requests: the writer fills row ``r`` with the KV of the request its allocator gave ``r`` to, and
every reader reads ``r`` for the request its own allocator gave it to. The allocators are
deterministic (a stack free list, counts kept on the CPU, no randomness, no clock; the quarantine of
PD rows aside, see docs/shared-host-pool.md) and SGLang's scheduler makes the same calls on every
TP rank, so their states stay equal. :class:`RankStateCheck` verifies it every ``every_steps`` decode
steps: one all-gather of a few integers (free-page counts, a digest of each free list, request and
token counts) over the TP CPU group, and one wait for the GPU to compute the digests.
"""

from __future__ import annotations

from typing import Callable

import torch

from hisparse_sglang.errors import RankDivergenceError
from hisparse_sglang.memory.allocator import KVAllocator
from hisparse_sglang.memory.paged import PagedAllocator

__all__ = ["RankStateCheck", "CHECK_EVERY_STEPS", "free_list_digest", "allocator_fingerprint", "gather_ints"]

# Decode steps between two checks: at ~30 ms a step, about every 8 s. Each check waits for the GPU
# once (the digests), which costs the overlap of one step; rare enough to be lost in the noise, often
# enough to stop a diverged server before much KV is mixed up.
CHECK_EVERY_STEPS = 256
# The digest's modulus: a product of two residues stays below 2**62, a sum of 2**32 residues below 2**63.
_DIGEST_MODULUS = 2**31 - 1


def free_list_digest(allocator: PagedAllocator) -> int:
    """A digest of the free pages *in stack order* (the order decides which page is handed out next)."""
    free = allocator.free_list()
    if free.numel() == 0:
        return 0
    weights = torch.arange(1, free.numel() + 1, dtype=torch.int64, device=free.device) % _DIGEST_MODULUS
    terms = weights * ((free + 1) % _DIGEST_MODULUS) % _DIGEST_MODULUS
    return int(terms.sum()) % _DIGEST_MODULUS


def allocator_fingerprint(allocator: KVAllocator) -> dict[str, int]:
    """Named integers that differ when two ranks' logical or device allocations differ."""
    return {
        "logical free pages": allocator.logical.free_pages,
        "logical free-list digest": free_list_digest(allocator.logical),
        "device free pages": allocator.device_rows.free_pages,
        "device free-list digest": free_list_digest(allocator.device_rows),
    }


def gather_ints(group) -> Callable[[list[int]], list[list[int]]]:
    """All-gather of an integer list over a ``torch.distributed`` (CPU) group: one list per rank."""

    def gather(values: list[int]) -> list[list[int]]:
        mine = torch.tensor(values, dtype=torch.int64)
        everyone = [torch.empty_like(mine) for _ in range(torch.distributed.get_world_size(group=group))]
        torch.distributed.all_gather(everyone, mine, group=group)
        return [tensor.tolist() for tensor in everyone]

    return gather


class RankStateCheck:
    """Compares named integers across the ranks every ``every_steps`` steps.

    Args:
        gather: all-gather of an integer list (:func:`gather_ints`); every rank must call
            :meth:`check` at the same steps with the same field names.
        every_steps: steps between checks.
    """

    def __init__(self, gather: Callable[[list[int]], list[list[int]]], every_steps: int = CHECK_EVERY_STEPS) -> None:
        if every_steps < 1:
            raise ValueError(f"every_steps must be >= 1, got {every_steps}")
        self.gather = gather
        self.every_steps = every_steps
        self.checks = 0

    def due(self, step: int) -> bool:
        return step % self.every_steps == 0

    def check(self, step: int, fields: dict[str, int]) -> None:
        """Raises RankDivergenceError, on every rank, when any field differs between ranks."""
        names = list(fields)
        rows = self.gather([int(fields[name]) for name in names])
        self.checks += 1
        differ = [
            f"{name} (per rank: {[row[index] for row in rows][:8]})"
            for index, name in enumerate(names)
            if len({row[index] for row in rows}) > 1
        ]
        if differ:
            raise RankDivergenceError(
                f"at decode step {step} the TP ranks that share the host pool disagree on {'; '.join(differ)}: they "
                f"would write and read different requests' KV in the same host rows, so the server stops. This is a "
                f"bug (please report it with this message); meanwhile set \"share_host_pool_across_tp\": false in "
                f"--hisparse-config to give every rank its own pool."
            )
