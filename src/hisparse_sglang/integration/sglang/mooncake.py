"""Where hisparse-sglang's serving code meets Mooncake: the registration of our host KV pool.

On a PD decode instance SGLang's ``MooncakeKVManager`` registers the regions that
``coordinator.mem_pool_host.get_contiguous_buf_infos()`` hands it (our pinned host pool, one region
per layer) with its Mooncake engine. SGLang drops the engine's return code (it logs a failure at
debug level only; every release from 0.5.17 to 0.5.23), so a pool Mooncake could not register (a
memlock limit, an RDMA device that cannot map that much memory) let the decode start and fail every
transfer later with "Failed to get kvcache from prefill instance, it might be dead". Here a failed
registration of our regions stops the decode instance at startup with
:class:`~hisparse_sglang.errors.MooncakeRegistrationError`.

This is the only module that reads Mooncake's integer codes; nothing else in the package needs them
(transfer failures reach us as SGLang's abort messages).
"""

from __future__ import annotations

import logging

from hisparse_sglang.errors import MooncakeRegistrationError

__all__ = ["HostRegionAddress", "HostRegions", "check_host_pool_registration"]

logger = logging.getLogger(__name__)

# Codes of Mooncake's transfer engine (its error.h) that a memory registration can return.
_REGISTRATION_ERRORS = {
    -1: ("ERR_INVALID_ARGUMENT", "a region's address or length was refused"),
    -6: ("ERR_DEVICE_NOT_FOUND", "no such RDMA device: check --disaggregation-ib-device against `ibv_devices`"),
    -7: ("ERR_ADDRESS_OVERLAPPED", "a region overlaps memory registered already with this engine"),
    -202: ("ERR_CONTEXT", "the RDMA context could not map the memory: check `ulimit -l` and the NIC driver"),
    -302: ("ERR_MEMORY", "the transfer engine ran out of memory"),
}


class HostRegionAddress(int):
    """The base address of one region of the host pool. The type marks it: SGLang may register our
    addresses in a list of its own, beside its other buffers (``compat.host_pool_regions``), and the
    registration hook picks ours out by their type."""


class HostRegions(list):
    """Base addresses of the host pool's per-layer regions (each a :class:`HostRegionAddress`), as
    handed to SGLang's KV manager."""

    def __init__(self, addresses=()) -> None:
        super().__init__(HostRegionAddress(address) for address in addresses)


def check_host_pool_registration(code: int, pointers: list[int], lengths: list[int]) -> None:
    """Raise if Mooncake did not register the host pool's regions (``code`` != 0).

    Raises:
        MooncakeRegistrationError: names the code, the regions' sizes and the fixes.
    """
    total = sum(int(length) for length in lengths)
    if code == 0:
        logger.info(
            "HiSparse: host KV pool registered with Mooncake (%d regions, %.2f GiB in all).", len(pointers), total / 2**30
        )
        return
    name, meaning = _REGISTRATION_ERRORS.get(code, ("unknown code", "see the transfer engine's log on stderr"))
    raise MooncakeRegistrationError(
        f"Mooncake could not register the HiSparse host KV pool ({len(pointers)} regions, {total / 2**30:.2f} GiB "
        f"of pinned host memory): return code {code} ({name}: {meaning}). The prefill instance writes KV straight "
        f"into these regions, so no transfer could succeed. Allow the decode process to lock that much memory "
        f"(`ulimit -l unlimited`, or LimitMEMLOCK=infinity / docker --ulimit memlock=-1), check the RDMA device, "
        f"or shrink the pool with a lower host_to_device_ratio in --hisparse-config."
    )
