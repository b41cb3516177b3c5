"""Start-up sizing: a host pool the host cannot pin, or a GPU KV pool smaller than one buffer, is
refused before anything is allocated, with the numbers and the fix (CPU; fake /proc and cgroup trees)."""

import logging

import pytest

from hisparse_sglang.config import HiSparseConfig
from hisparse_sglang.errors import HiSparseMemoryError
from hisparse_sglang.integration.sglang import limits
from hisparse_sglang.integration.sglang.limits import (
    HostMemory,
    check_device_pool,
    check_host_pool,
    host_memory_available,
    host_pools_on_host,
)

GiB = 2**30


def fake_host(tmp_path, meminfo_kib=None, cgroup_lines=(), files=None):
    """A file-system root with /proc/meminfo, /proc/self/cgroup and cgroup files."""
    (tmp_path / "proc" / "self").mkdir(parents=True)
    if meminfo_kib is not None:
        (tmp_path / "proc" / "meminfo").write_text(f"MemTotal: {2 * meminfo_kib} kB\nMemAvailable: {meminfo_kib} kB\n")
    (tmp_path / "proc" / "self" / "cgroup").write_text("".join(line + "\n" for line in cgroup_lines))
    for path, text in (files or {}).items():
        target = tmp_path / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    return str(tmp_path)


def test_meminfo_alone(tmp_path):
    memory = host_memory_available(fake_host(tmp_path, meminfo_kib=100 * 2**20))
    assert memory == HostMemory(100 * GiB, "MemAvailable of /proc/meminfo")


def test_cgroup_v2_limits_of_the_process_and_its_parents_count_page_cache_as_free(tmp_path):
    root = fake_host(
        tmp_path, meminfo_kib=500 * 2**20, cgroup_lines=["0::/pods/rank3"],
        files={
            "sys/fs/cgroup/pods/rank3/memory.max": "max\n",
            "sys/fs/cgroup/pods/rank3/memory.current": f"{10 * GiB}\n",
            "sys/fs/cgroup/pods/memory.max": f"{64 * GiB}\n",
            "sys/fs/cgroup/pods/memory.current": f"{40 * GiB}\n",
            "sys/fs/cgroup/pods/memory.stat": f"anon 1\ninactive_file {6 * GiB}\n",
        },
    )
    assert host_memory_available(root) == HostMemory(30 * GiB, "the memory cgroup's limit less its usage")


def test_cgroup_v1_mounted_at_its_own_root_and_unlimited_cgroups(tmp_path):
    root = fake_host(
        tmp_path, meminfo_kib=500 * 2**20, cgroup_lines=["4:memory:/process_api/abc", "0::/"],
        files={
            "sys/fs/cgroup/memory/memory.limit_in_bytes": f"{32 * GiB}\n",
            "sys/fs/cgroup/memory/memory.usage_in_bytes": f"{2 * GiB}\n",
            "sys/fs/cgroup/memory.max": "max\n",
        },
    )
    assert host_memory_available(root).available == 30 * GiB
    unlimited = fake_host(
        tmp_path / "other", meminfo_kib=8 * 2**20, cgroup_lines=["4:memory:/"],
        files={"sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712\n",
               "sys/fs/cgroup/memory/memory.usage_in_bytes": "1\n"},
    )
    assert host_memory_available(unlimited) == HostMemory(8 * GiB, "MemAvailable of /proc/meminfo")


def test_nothing_readable_means_unknown(tmp_path):
    assert host_memory_available(fake_host(tmp_path)) is None


def per_ratio(ratio):
    """A 61-layer bf16 rank with a 100,000-token GPU pool: host pool bytes for a ratio."""
    return 61 * 1152 * (100_000 * ratio // 64 + 1) * 64


def test_host_pool_that_fits_passes_and_one_that_does_not_names_sizes_and_the_largest_ratio():
    check_host_pool(per_ratio(10), 1, per_ratio, 10, HostMemory(100 * GiB, "MemAvailable"))
    with pytest.raises(HiSparseMemoryError) as info:
        check_host_pool(per_ratio(10), 8, per_ratio, 10, HostMemory(300 * GiB, "MemAvailable"))
    message = str(info.value)
    largest = max(r for r in range(1, 10) if 8 * per_ratio(r) <= 0.9 * 300 * GiB)
    for fragment in (f"{per_ratio(10) / GiB:,.1f} GiB", "x 8 scheduler processes", "300.0 GiB available",
                     "MemAvailable", f"host_to_device_ratio <= {largest}", "(now 10)"):
        assert fragment in message, message
    check_host_pool(per_ratio(largest), 8, per_ratio, largest, HostMemory(300 * GiB, "MemAvailable"))


def test_a_host_pool_shared_by_the_tp_ranks_of_a_host_counts_once():
    hosts = ["a", "a", "a", "a", "b", "b", "b", "b"]  # TP 8 over two hosts
    assert host_pools_on_host(hosts, "a", shared=False) == 4 and host_pools_on_host(hosts, "a", shared=True) == 1
    assert host_pools_on_host(["a"], "a", shared=True) == 1
    # 8 private pools do not fit 300 GiB; the one they share does
    with pytest.raises(HiSparseMemoryError):
        check_host_pool(per_ratio(10), host_pools_on_host(["a"] * 8, "a", False), per_ratio, 10,
                        HostMemory(300 * GiB, "MemAvailable"))
    check_host_pool(per_ratio(10), host_pools_on_host(["a"] * 8, "a", True), per_ratio, 10,
                    HostMemory(300 * GiB, "MemAvailable"))


def test_host_pool_that_no_ratio_fits_says_what_else_to_do(caplog):
    with pytest.raises(HiSparseMemoryError, match="even host_to_device_ratio 1 does not fit: lower --mem-fraction-static"):
        check_host_pool(per_ratio(4), 1, per_ratio, 4, HostMemory(GiB, "the memory cgroup's limit less its usage"))
    with caplog.at_level(logging.WARNING):
        check_host_pool(per_ratio(4), 1, per_ratio, 4, None)
    assert "could not be read" in caplog.text


def test_gpu_pool_smaller_than_one_buffer_is_refused_with_the_largest_buffer_that_fits():
    config = HiSparseConfig(top_k=2048, device_buffer_size=4096)  # buffer: 4096 + 64 rows = 65 pages
    check_device_pool(65, config)
    with pytest.raises(HiSparseMemoryError) as info:
        check_device_pool(50, config)
    message = str(info.value)
    for fragment in ("holds 3200 tokens (50 pages of 64)", "4096 + one page = 4160 rows", "--mem-fraction-static",
                     "device_buffer_size to <= 3136"):
        assert fragment in message, message
    with pytest.raises(HiSparseMemoryError) as info:
        check_device_pool(20, config)  # no buffer >= top_k fits: only the pool can grow
    assert "device_buffer_size to" not in str(info.value)


# ------------------------------------------------------------------ request-length limits (get_worker_info)
@pytest.mark.parametrize(
    "sglang_limits, context_len, capacity, expected",
    [
        # the logical pool is shorter than the context: it sets both limits, SGLang's margin kept
        ((40_959, 40_955), 65_536, 327_680 - 65_536, (65_535, 65_531, False)),
        ((40_959, 40_955), 65_536, 32_768, (32_767, 32_763, True)),
        ((40_959, 40_951), 200_000, 131_072, (131_071, 131_063, True)),
        # equal limits: the context length is the bound, not the pool
        ((1_000, 990), 4_097, 4_097, (4_096, 4_086, False)),
        ((1_000, 990), 4_097, 4_096, (4_095, 4_085, True)),
    ],
)
def test_decode_length_limits(sglang_limits, context_len, capacity, expected):
    assert limits.decode_length_limits(*sglang_limits, context_len, capacity) == expected


@pytest.mark.parametrize(
    "max_req_len, context_len, bound", [(40_959, 65_536, True), (65_535, 65_536, False), (70_000, 65_536, False)]
)
def test_colocated_pool_bound(max_req_len, context_len, bound):
    assert limits.colocated_pool_bound(max_req_len, context_len) is bound
