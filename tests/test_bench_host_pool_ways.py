"""benchmarks/bench_host_pool_ways.py on the CPU: every way makes a region of the asked size ready
(touched or populated; nothing to register without CUDA), cold and then warm."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_host_pool_ways.py"


def load():
    spec = importlib.util.spec_from_file_location("bench_host_pool_ways", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU run; the GPU run registers (section 10a's command)")
def test_every_way_runs_cold_then_warm(monkeypatch, tmp_path):
    monkeypatch.setenv("OUT", str(tmp_path))
    rows = load().main(["--gib", "0.0625", "--threads", "2"])
    ways = ["touch+register", "register-only", "populate+register", "pipelined"]
    assert [(row["phase"], row["way"]) for row in rows] == [("cold", w) for w in ways] + [
        ("warm", w) for w in reversed(ways)]
    assert all(row["gib"] == 0.0625 for row in rows)
    assert not any(row.get("populate_errors") for row in rows), "madvise(MADV_POPULATE_WRITE) failed"
    assert (tmp_path / "bench_host_pool_ways.json").exists()


def resident_bytes() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon in /proc/self/status")


def test_the_populate_way_makes_the_pages_resident_without_touching_them():
    module = load()
    size = 64 << 20
    before = resident_bytes()
    region, parts = module.populate_register(size, module.NoRegistrar(), 2)
    assert parts["populate_errors"] == []
    assert resident_bytes() - before >= 0.9 * size
    assert region.tensor.numel() == size
