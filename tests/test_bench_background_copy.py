"""benchmarks/bench_background_copy.py on the CPU: its command line (the timed part needs a GPU)."""

from __future__ import annotations

import pathlib
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_background_copy  # noqa: E402


def test_the_defaults_copy_one_16k_prompt_of_61_bf16_layers_at_several_caps_and_by_dma():
    args = bench_background_copy.parse_args([])
    assert (args.tokens, args.layers, args.row_bytes, args.direction) == (16384, 61, 1152, "d2h")
    assert args.blocks == [0, 64, 32, 16, 8, "dma"]
    assert bench_background_copy.parse_args(["--blocks", "dma,4"]).blocks == ["dma", 4]
    assert bench_background_copy.parse_args(["--blocks", "dma/16,0"]).blocks == ["dma/16", 0]
    assert bench_background_copy.parse_args(["--blocks", "runs/1,runs/16"]).blocks == ["runs/1", "runs/16"]
    for bad in ("dma/0", "dma/x", "dma16", "-1", "runs", "runs/0", "runs/x"):
        with pytest.raises(SystemExit):
            bench_background_copy.parse_args(["--blocks", bad])


def test_a_run_entry_copies_runs_of_its_pages():
    # runs/16 is 16 pages of 64 rows (976 copies of a 16K prompt of 61 layers), not a slice of its spelling
    assert [bench_background_copy.run_rows(b) for b in ("runs/16", "runs/4", "runs/1", "dma/16", "runs/128")] == [
        1024, 256, 64, 1024, 8192]


@pytest.mark.parametrize("bad", [["--blocks", "16,x"], ["--blocks", "-1"], ["--row-bytes", "100"], ["--layers", "0"]])
def test_bad_arguments_are_refused_by_name(bad, capsys):
    with pytest.raises(SystemExit):
        bench_background_copy.parse_args(bad)
    assert bad[0] in capsys.readouterr().err


@pytest.mark.skipif(bench_background_copy.torch.cuda.is_available(), reason="checks the message without a GPU")
def test_without_a_gpu_it_says_so(capsys):
    assert bench_background_copy.main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
