"""Request-length limits of a HiSparse scheduler process, the notes that explain them, and the
start-up checks that its pools fit the host and the GPU (section "start-up sizing").

SGLang 0.5.17 sizes every request-length check by the device KV pool (``max_total_num_tokens``).
On a PD **decode** instance with hisparse-sglang a request's KV lives in the logical (host) pool
and only its device buffer needs the GPU, so the decode-side limit is the logical pool less the
tokens SGLang reserves for decoding (:func:`decode_request_capacity`). A **co-located** server
prefills on the GPU, so the device pool stays its limit; the notes say why and what to do.
:func:`decode_request_limits` and :func:`colocated_request_limits` compute, from plain integers, what
the ``get_worker_info`` hook reports (:func:`with_request_limits`), records and logs.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib

from hisparse_sglang.errors import HiSparseMemoryError, UnsupportedSetupError

__all__ = [
    "draft_pool_sizes",
    "count_draft_kv_at_logical_size",
    "decode_request_capacity",
    "RequestLimits",
    "decode_request_limits",
    "colocated_request_limits",
    "with_request_limits",
    "colocated_note",
    "decode_note",
    "HostMemory",
    "host_memory_available",
    "check_host_pool",
    "host_pools_on_host",
    "check_device_pool",
    "HOST_MEMORY_USABLE_FRACTION",
]

logger = logging.getLogger(__name__)


def draft_pool_sizes(sizes, allocator, page_size: int):
    """The draft runner's pool sizes (SGLang's ``_PoolSizes``, 0.5.17 - 0.5.21) when ``allocator`` is
    hisparse-sglang's: the draft pool is indexed by the target's logical locations, so it spans the whole
    logical space (``allocator.size_full``), rounded up to a page; else ``sizes`` unchanged."""
    import msgspec

    from hisparse_sglang.integration.sglang.runtime import runtime_of

    if runtime_of(allocator) is None:
        return sizes
    logical = -(-int(allocator.size_full) // page_size) * page_size
    return msgspec.structs.replace(sizes, max_total_num_tokens=logical)


def count_draft_kv_at_logical_size(pool_configurator, kvc) -> None:
    """Adds to a target's ``DefaultPoolConfigurator`` cell size (bytes per device token) what its EAGLE
    draft layers' KV costs beyond the device size SGLang counted: a draft pool over the logical space holds
    ``host_to_device_ratio`` tokens per device token, so ``draft layers x row bytes x (ratio - 1)`` more.
    Nothing for a draft runner, without EAGLE, or without hisparse-sglang's allocator class in use."""
    from hisparse_sglang.integration.sglang import compat
    from hisparse_sglang.integration.sglang.validation import hisparse_config

    if kvc.is_draft_worker or not kvc.spec_algorithm.is_eagle() or not compat.hisparse_enabled():
        return
    draft_layers = int(kvc.spec_aux_config.eagle_draft_num_layers or 0)
    if draft_layers <= 0:
        return
    ratio = hisparse_config(kvc.server_args, kvc.model_config).host_to_device_ratio
    pool_configurator._cell_size += draft_layers * compat.mla_kv_row_bytes(kvc) * (ratio - 1)


def decode_request_capacity(coordinator, num_reserved_decode_tokens: int) -> int | None:
    """Longest request (prompt + output tokens) a PD decode instance can hold, per rank.

    The logical pool (host rows) less ``num_reserved_decode_tokens`` (SGLang's decode
    preallocation needs that much room beyond the request), rounded down to a whole page.

    Args:
        coordinator: ``model_runner.hisparse_coordinator`` / ``scheduler.hisparse_coordinator``.
        num_reserved_decode_tokens: SGLang's ``--num-reserved-decode-tokens``.
    Returns:
        the capacity in tokens, or None when hisparse-sglang's coordinator is not in use.
    Raises:
        UnsupportedSetupError: the logical pool is not larger than the reserve by a page.
    """
    from hisparse_sglang.integration.sglang.runtime import runtime_of

    runtime = runtime_of(coordinator)
    if runtime is None or not runtime.started:
        return None
    allocator = runtime.coordinator.allocator
    logical_tokens = allocator.size
    page_size = allocator.page_size
    capacity = (logical_tokens - num_reserved_decode_tokens) // page_size * page_size
    if capacity < page_size:
        raise UnsupportedSetupError(
            f"the HiSparse logical KV pool holds {logical_tokens} tokens (device pool {allocator.device_tokens} x "
            f"host_to_device_ratio {allocator.host_to_device_ratio}), which leaves less than a page of "
            f"{page_size} after --num-reserved-decode-tokens ({num_reserved_decode_tokens}); raise "
            f"host_to_device_ratio in --hisparse-config or lower --num-reserved-decode-tokens."
        )
    return capacity


def decode_length_limits(max_req_len: int, max_req_input_len: int, context_len: int, capacity: int) -> tuple[int, int, bool]:
    """A PD decode instance's request-length limits, from SGLang's (set by the device pool).

    Args:
        max_req_len, max_req_input_len: SGLang's limits (items 4 and 5 of ``get_worker_info``); the margin
            between them (room for new tokens) is kept.
        context_len: the model's context length.
        capacity: the logical (host) pool's tokens less the reserved decode tokens
            (:func:`decode_request_capacity`).

    Returns:
        ``(max_req_len, max_req_input_len, pool_bound)``: a request takes at most ``capacity - 1`` tokens
        (no decode context parallelism with HiSparse) or ``context_len - 1``, whichever is smaller;
        ``pool_bound`` says that the pool, not the context length, sets it.
    """
    margin = max_req_len - max_req_input_len
    context_limit = context_len - 1
    pool_limit = capacity - 1
    limit = min(context_limit, pool_limit)
    return limit, limit - margin, pool_limit < context_limit


def colocated_pool_bound(max_req_len: int, context_len: int) -> bool:
    """Whether a co-located server's request limit (SGLang's, set by the GPU KV pool) is below the context's."""
    return max_req_len < context_len - 1


def colocated_note(max_req_input_len: int, device_tokens: int) -> str:
    """Why a co-located HiSparse server rejects a prompt longer than its GPU KV pool."""
    return (
        f"hisparse-sglang: with --enable-hisparse on a co-located server (no --disaggregation-mode) the "
        f"prefill writes the whole prompt into the GPU KV pool, so a prompt must fit it: the GPU KV pool "
        f"holds {device_tokens} tokens, which limits prompts to fewer than {max_req_input_len} tokens. "
        f"Longer prompts need PD disaggregation with hisparse-sglang on the decode instance (its limit "
        f"is the host pool; the prefill instance's GPU pool must still hold the prompt), or a larger GPU "
        f"KV pool (--mem-fraction-static)."
    )


def decode_note(max_req_input_len: int, capacity: int, logical_tokens: int, reserved: int, ratio: int) -> str:
    """Why a PD decode instance with hisparse-sglang rejects a prompt longer than its logical pool allows."""
    return (
        f"hisparse-sglang: on this PD decode instance a request must fit the logical (host) KV pool: "
        f"{logical_tokens} tokens (GPU KV pool x host_to_device_ratio {ratio}) less "
        f"--num-reserved-decode-tokens ({reserved}) leaves {capacity}, which limits prompts to fewer than "
        f"{max_req_input_len} tokens. Raise host_to_device_ratio in --hisparse-config to admit longer prompts."
    )


# The items of TpModelWorker.get_worker_info's tuple that hold the request-length limits (the same in
# every supported release): max_req_len (prompt + new tokens) and max_req_input_len (prompts shorter).
MAX_REQ_LEN_ITEM = 4
MAX_REQ_INPUT_LEN_ITEM = 5


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    """A scheduler process's request-length limits as hisparse-sglang reports them.

    Attributes:
        max_req_len, max_req_input_len: items 4 and 5 of ``get_worker_info``.
        note: when a KV pool (not the context length) sets the limit, what sets it and how to raise it
            (appended to SGLang's rejection message); None otherwise.
        startup_line: the line rank 0 logs at startup; None: nothing to log.
    """

    max_req_len: int
    max_req_input_len: int
    note: str | None = None
    startup_line: str | None = None


def decode_request_limits(
    max_req_len: int, max_req_input_len: int, *, context_len: int, capacity: int, device_tokens: int,
    logical_tokens: int, reserved: int, host_to_device_ratio: int,
) -> RequestLimits:
    """A PD decode instance's limits: the logical (host) pool's ``capacity`` (:func:`decode_request_capacity`
    of ``logical_tokens`` less ``reserved`` decode tokens) or the context length, whichever is smaller
    (:func:`decode_length_limits`); ``device_tokens``: the GPU KV pool, named in the startup line."""
    limit, input_limit, pool_bound = decode_length_limits(max_req_len, max_req_input_len, context_len, capacity)
    note = decode_note(input_limit, capacity, logical_tokens, reserved, host_to_device_ratio) if pool_bound else None
    set_by = (
        f"the logical (host) KV pool: {logical_tokens} tokens less --num-reserved-decode-tokens {reserved}"
        if note else f"the context length ({context_len})"
    )
    line = (
        f"HiSparse PD decode: requests of up to {limit} tokens are admitted (prompts shorter than {input_limit}), "
        f"set by {set_by}. The GPU KV pool ({device_tokens} tokens) holds only device buffers and resident "
        f"requests here; the prefill instance's own KV pool still limits prompts there."
    )
    return RequestLimits(limit, input_limit, note, line)


def colocated_request_limits(max_req_len: int, max_req_input_len: int, *, context_len: int, device_tokens: int) -> RequestLimits:
    """A co-located server's limits: SGLang's (the GPU KV pool of ``device_tokens`` holds the whole prompt),
    with the note when that pool, not the context length, sets them."""
    if colocated_pool_bound(max_req_len, context_len):
        note = colocated_note(max_req_input_len, device_tokens)
        line = (
            f"HiSparse co-located: prompts shorter than {max_req_input_len} tokens are admitted, set by the GPU KV "
            f"pool ({device_tokens} tokens; the prefill writes the whole prompt there). Longer prompts need PD "
            f"disaggregation with hisparse-sglang on the decode instance (docs/pd.md)."
        )
        return RequestLimits(max_req_len, max_req_input_len, note, line)
    line = (
        f"HiSparse co-located: prompts shorter than {max_req_input_len} tokens are admitted, set by the context "
        f"length ({context_len})."
    )
    return RequestLimits(max_req_len, max_req_input_len, None, line)


def with_request_limits(worker_info: tuple, request_limits: RequestLimits) -> tuple:
    """``get_worker_info``'s tuple with its request-length items replaced by ``request_limits``'s; the
    other items (the device pool size in item 0 among them) unchanged."""
    info = list(worker_info)
    info[MAX_REQ_LEN_ITEM] = request_limits.max_req_len
    info[MAX_REQ_INPUT_LEN_ITEM] = request_limits.max_req_input_len
    return tuple(info)


# ------------------------------------------------------------------------------ start-up sizing
# The host pool may take this share of the memory the host (or its cgroup) has available: the rest
# is for the scheduler process itself, SGLang's own pinned buffers and the page cache.
HOST_MEMORY_USABLE_FRACTION = 0.9


@dataclasses.dataclass(frozen=True)
class HostMemory:
    """Memory this process can still take: ``available`` bytes, limited by ``source``."""

    available: int
    source: str


def host_memory_available(root: str = "/") -> HostMemory | None:
    """The smaller of the kernel's MemAvailable and the headroom of every memory cgroup above this
    process (limit less usage, page cache that can be dropped counted free); None where neither can
    be read (not Linux). ``root`` is the file-system root to read from (tests pass a fake tree)."""
    base = pathlib.Path(root)
    candidates = []
    meminfo = _read_meminfo_available(base / "proc" / "meminfo")
    if meminfo is not None:
        candidates.append(HostMemory(meminfo, "MemAvailable of /proc/meminfo"))
    headroom = _cgroup_headroom(base)
    if headroom is not None:
        candidates.append(HostMemory(headroom, "the memory cgroup's limit less its usage"))
    return min(candidates, key=lambda memory: memory.available) if candidates else None


def _read_meminfo_available(path: pathlib.Path) -> int | None:
    try:
        for line in path.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _read_int(path: pathlib.Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _inactive_file(path: pathlib.Path) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name in ("inactive_file", "total_inactive_file"):
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _cgroup_headroom(root: pathlib.Path) -> int | None:
    """Smallest (limit - usage + inactive page cache) over this process's memory cgroups (v2 and v1),
    from its own cgroup up to the mount's root; None when no level has a limit."""
    try:
        lines = (root / "proc" / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None
    headrooms = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":  # cgroup v2
            mount, limit_name, usage_name = root / "sys" / "fs" / "cgroup", "memory.max", "memory.current"
        elif "memory" in controllers.split(","):
            mount, limit_name, usage_name = root / "sys" / "fs" / "cgroup" / "memory", "memory.limit_in_bytes", "memory.usage_in_bytes"
        else:
            continue
        # Inside a container the own cgroup is usually mounted at the root: try the path, else the mount.
        directory = mount / path.strip("/")
        if not directory.is_dir():
            directory = mount
        while True:
            limit = _read_int(directory / limit_name)
            usage = _read_int(directory / usage_name)
            if limit is not None and usage is not None and limit < 2**60:
                headrooms.append(max(0, limit - usage + _inactive_file(directory / "memory.stat")))
            if directory == mount or mount not in directory.parents:
                break
            directory = directory.parent
    return min(headrooms) if headrooms else None


def host_pools_on_host(hostnames: list[str], hostname: str, shared: bool) -> int:
    """Host pools the ranks of a TP group (``hostnames``, one per rank) start on ``hostname``: one per
    rank there, or one for all of them when they share it (docs/shared-host-pool.md)."""
    ranks_here = hostnames.count(hostname)
    return min(ranks_here, 1) if shared else ranks_here


def check_host_pool(
    pool_bytes: int,
    pools_on_host: int,
    bytes_for_ratio,
    host_to_device_ratio: int,
    memory: HostMemory | None,
) -> None:
    """Refuse a host pool that this host cannot pin, before any of it is allocated.

    Args:
        pool_bytes: this scheduler process's host pool.
        pools_on_host: host pools of this size that start on this host (:func:`host_pools_on_host`).
        bytes_for_ratio: host pool bytes of one process for a given host_to_device_ratio.
        host_to_device_ratio: the configured ratio.
        memory: what the host has available (:func:`host_memory_available`); None skips the check.
    Raises:
        HiSparseMemoryError: the pools need more than HOST_MEMORY_USABLE_FRACTION of it; the message
            gives the sizes and the largest host_to_device_ratio that fits.
    """
    if memory is None:
        logger.warning("HiSparse: the host's available memory could not be read; the host pool is not checked.")
        return
    usable = int(memory.available * HOST_MEMORY_USABLE_FRACTION)
    if pool_bytes * pools_on_host <= usable:
        return
    largest = next(
        (ratio for ratio in range(host_to_device_ratio - 1, 0, -1) if bytes_for_ratio(ratio) * pools_on_host <= usable),
        None,
    )
    processes = f" x {pools_on_host} scheduler processes on this host" if pools_on_host > 1 else ""
    fix = (
        f"use host_to_device_ratio <= {largest} in --hisparse-config (now {host_to_device_ratio})"
        if largest is not None
        else "even host_to_device_ratio 1 does not fit: lower --mem-fraction-static (a smaller GPU KV pool, and a "
        "host pool that many times as large) or run fewer ranks on this host"
    )
    raise HiSparseMemoryError(
        f"the HiSparse host pool needs {pool_bytes / 2**30:,.1f} GiB of pinned memory{processes}, more than "
        f"{HOST_MEMORY_USABLE_FRACTION:.0%} of the {memory.available / 2**30:,.1f} GiB available ({memory.source}); "
        f"{fix}."
    )


def check_device_pool(capacity_pages: int, config) -> None:
    """Refuse a GPU KV pool that cannot hold one offloaded request's buffer (device_buffer_size plus
    the page of its newest token): no request longer than the buffer could ever be offloaded, and
    the scheduler would fail on the first one.

    Raises:
        HiSparseMemoryError: naming the pool, the buffer and the largest device_buffer_size that fits.
    """
    page_size = config.page_size
    buffer_pages = config.padded_buffer_size // page_size
    if capacity_pages >= buffer_pages:
        return
    largest = (capacity_pages - 1) * page_size
    smaller = (
        f", or lower device_buffer_size to <= {largest} in --hisparse-config (now {config.device_buffer_size})"
        if largest >= config.top_k
        else ""
    )
    raise HiSparseMemoryError(
        f"the GPU KV pool holds {capacity_pages * page_size} tokens ({capacity_pages} pages of {page_size}), fewer "
        f"than one offloaded request's device buffer needs: device_buffer_size {config.device_buffer_size} + one "
        f"page = {config.padded_buffer_size} rows. Give the KV pool more GPU memory (--mem-fraction-static, or "
        f"fewer --max-running-requests){smaller}."
    )
