"""The decode-step benchmark's setup on the CPU (reference ops): every mode it times builds, and the
mixed mode demotes half of the requests, so a change of the coordinator cannot leave the GPU
benchmark broken until the next GPU run."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_decode_step", REPO / "benchmarks" / "bench_decode_step.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("mode,expected", [("resident", (4, 0)), ("offloaded", (0, 4)), ("mixed", (2, 2))])
def test_every_mode_builds_and_steps_with_the_reference_ops(bench, mode, expected):
    from hisparse_sglang.ops import reference

    server = bench.build(4, mode, reference, device="cpu")
    prepare_us, alloc_us, modes = bench.time_step_work(server, 2)
    assert (modes["resident"], modes["offloaded"]) == expected
    assert prepare_us > 0 and alloc_us > 0
