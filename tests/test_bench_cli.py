"""The swap-in benchmark's command line and its GPU-free parts, on the CPU.

``benchmarks/bench_swap_in.py`` is run as a script (its own directory on ``sys.path``, as on the GPU
machine); its package ``benchmarks/swap_in`` is imported here through pytest's ``syspath_prepend``.
The timed code itself needs a GPU (tests/gpu and the benchmark runs of docs/kernels.md).
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
ENTRY = REPO / "benchmarks" / "bench_swap_in.py"
RESULTS = REPO / "benchmarks" / "results"


@pytest.fixture(scope="module")
def bench():
    """The ``swap_in`` benchmark package (cli, report, trace), imported from benchmarks/."""
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(REPO / "benchmarks"))
        from swap_in import cli, report, trace

        yield type("Bench", (), {"cli": cli, "report": report, "trace": trace})


def run_entry(*args: str, **env: str) -> subprocess.CompletedProcess:
    environment = {**os.environ, "PYTHONPATH": str(REPO / "src"), **env}
    return subprocess.run([sys.executable, str(ENTRY), *args], capture_output=True, text=True, env=environment,
                          timeout=120)


# --- the command line -------------------------------------------------------------------------------

def test_help_lists_every_subcommand(bench):
    result = run_entry("--help")
    assert result.returncode == 0, result.stderr
    for name in bench.cli.SUBCOMMANDS:
        assert name in result.stdout


@pytest.mark.parametrize("name", ["table", "sweep", "trace", "diagnose", "latency", "profile", "build-baseline",
                                  "check-baseline"])
def test_every_subcommand_has_help(name):
    result = run_entry(name, "--help")
    assert result.returncode == 0, result.stderr
    assert f"bench_swap_in.py {name}" in result.stdout


def test_every_subcommand_module_imports_and_runs_through_run(bench):
    import importlib

    for name, (module, _) in bench.cli.SUBCOMMANDS.items():
        assert callable(importlib.import_module(f"swap_in.{module}").run), name


def test_no_subcommand_is_the_table_with_its_defaults(bench):
    for argv in ([], ["table"]):
        args = bench.cli.parse(argv)
        assert args.command == "table" and args.module == "swap_in.table"
        assert args.batch == [1, 8, 32, 64, 128] and args.miss == [0, 5, 20, 50, 100] and args.rows == [1152, 656]
        assert (args.reps, args.rounds, args.sweep, args.define, args.tag) == (20, 5, False, [], "")


def test_options_without_subcommand_go_to_the_table(bench):
    """The README's and docs' commands (``bench_swap_in.py --sweep``, ``--batch ... --rounds 3``) keep working."""
    args = bench.cli.parse(["--batch", "1", "8", "64", "--miss", "0", "20", "--rows", "1152", "--rounds", "3"])
    assert args.command == "table"
    assert (args.batch, args.miss, args.rows, args.rounds) == ([1, 8, 64], [0.0, 20.0], [1152], 3)
    assert bench.cli.parse(["--sweep"]).sweep is True


def test_sweep_is_the_table_with_variants(bench):
    args = bench.cli.parse(["sweep", "--batch", "32", "--tag", "_s"])
    assert (args.module, args.sweep, args.batch, args.tag) == ("swap_in.table", True, [32], "_s")


def test_out_defaults_to_the_environment(bench, monkeypatch, tmp_path):
    monkeypatch.setenv("OUT", str(tmp_path))
    assert bench.cli.parse([]).out == str(tmp_path)
    monkeypatch.delenv("OUT")
    assert pathlib.Path(bench.cli.parse([]).out) == RESULTS


def test_defines_are_checked_when_parsed(bench, capsys):
    defines = ["HISPARSE_TRACE", "SPLIT_LIMIT=4"]
    assert bench.cli.parse(["--define", *defines]).define == defines
    for bad in ("lower_case", "A B", "X=1;rm", "--define=-DX"):
        argv = [bad] if bad.startswith("--define=") else ["--define", bad]
        with pytest.raises(SystemExit) as info:
            bench.cli.parse(argv)
        assert info.value.code == 2
    assert "drop the -D: 'X'" in capsys.readouterr().err


def test_trace_cells_are_batch_and_miss(bench, capsys):
    args = bench.cli.parse(["trace", "--cells", "1:5", "8:20.5", "--calls", "3", "--define", "X=1"])
    assert args.cells == [(1, 5.0), (8, 20.5)]
    assert (args.calls, args.define, args.splits, args.row) == (3, ["X=1"], None, 1152)
    assert bench.cli.parse(["trace"]).cells == [(1, 5.0), (1, 20.0), (1, 100.0), (8, 20.0)]
    for bad in ("8", "8:x", "1.5:20", "1:2:3"):
        with pytest.raises(SystemExit):
            bench.cli.parse(["trace", "--cells", bad])
    assert "is not BATCH:MISS_PERCENT" in capsys.readouterr().err


def test_profile_latency_and_diagnose_keep_their_arguments(bench):
    args = bench.cli.parse(["profile", "128", "0"])
    assert (args.batch, args.miss, args.splits, args.row) == (128, 0.0, None, 1152)
    assert bench.cli.parse(["profile", "8", "20", "3"]).splits == 3
    assert bench.cli.parse(["latency"]).batch == 1 and bench.cli.parse(["latency", "64"]).batch == 64
    args = bench.cli.parse(["diagnose", "--batch", "128", "--miss", "5", "--sglang", "--calls", "1"])
    assert (args.batch, args.miss, args.sglang, args.ours, args.calls, args.splits, args.threads) == (
        128, 5.0, True, False, 1, None, None)


def test_baseline_subcommands(bench):
    args = bench.cli.parse(["build-baseline", "--config", "1152,2048,4096", "--config", "656,2048,4096,960"])
    assert args.module == "swap_in.build_baseline" and args.config == ["1152,2048,4096", "656,2048,4096,960"]
    assert pathlib.Path(args.out_dir) == REPO / ".baseline" and args.arch == "9.0" and not args.clean
    args = bench.cli.parse(["check-baseline", "--smoke"])
    assert args.module == "swap_in.baseline" and args.smoke and args.lib_dir is None


def test_the_command_line_imports_only_the_standard_library():
    """``--help`` and build-baseline run where neither torch nor this package is importable."""
    probe = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(REPO / 'benchmarks')!r})
        from swap_in import cli
        cli.build_parser()
        cli.parse(["build-baseline"])
        heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'hisparse_sglang', 'tvm_ffi', 'sglang'))
        print(heavy)
    """)
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


# --- the report (pure functions of the records) -----------------------------------------------------

@pytest.mark.parametrize("stem", ["swap_in_H100_2026-11-23", "swap_in_H200_2026-11-23",
                                  "swap_in_against_f5438cc_H100_2026-11-24"])
def test_markdown_renders_committed_results_byte_for_byte(bench, stem):
    """The table of the runs docs/kernels.md quotes comes out of their JSON exactly as committed (both as
    tests/data/swap_in_tables.json keeps them, which tests/test_data_files.py checks against git)."""
    committed = json.loads((REPO / "tests" / "data" / "swap_in_tables.json").read_text())["tables"][stem]
    data = committed["run"]
    rounds = len(data["results"][0]["ours_rounds_us"])
    table = bench.report.markdown(data["results"], data["gpu"], data["memcpy_gbps"], data["gather_gbps"], rounds,
                                  data["date"])
    assert table == committed["markdown"]


def synthetic_record(**overrides) -> dict:
    record = {
        "row_bytes": 1152, "batch": 8, "miss_percent": 20.0, "missed_rows": 3279, "missed_bytes": 3279 * 1152,
        "ours_us": 85.1, "splits": 9, "floor_us": 74.9, "ours_rounds_us": [85.1, 86.0], "copy_only_us": 79.9,
        "sglang_us": 92.7, "sglang_rounds_us": [92.7, 93.0], "sm_clock_mhz_after": "1980",
    }
    record.update(overrides)
    return record


def test_format_row_states_ours_sglang_copy_floor_and_ratios(bench):
    line = bench.report.format_row(synthetic_record())
    assert line.startswith("row  1152 bs    8 miss  20.0% | ours     85.1 us (splits 9) | sglang     92.7 us")
    assert "copy-only     79.9 us ours/copy  1.065" in line
    assert "floor     74.9 us | ours/floor  1.136 | ours/sglang   0.92" in line and line.endswith("clock 1980 MHz")


def test_format_row_of_a_hit_only_cell_without_sglang(bench):
    record = synthetic_record(miss_percent=0.0, missed_rows=0, missed_bytes=0, floor_us=0.0, ours_us=7.8,
                              ours_padding_us=4.2, ours_host_us=23.9)
    for key in ("copy_only_us", "sglang_us", "sglang_rounds_us"):
        del record[key]
    line = bench.report.format_row(record)
    assert "sglang      n/a us | copy-only        - us | floor      0.0 us | ours/floor      - | ours/sglang    n/a" \
        in line
    assert "host/call ours 23.9 us sglang nan us all-padding launch 4.2 us" in line


def test_sweep_adds_the_variants_table(bench):
    swept = [
        synthetic_record(batch=32, splits=3, ours_us=84.8,
                         variants_us={"t1024s3": 84.7, "t512s1": 91.9, "t1024s1": 90.2}),
        synthetic_record(batch=128, splits=1, ours_us=309.6, variants_us={"t512s1": 312.8, "t1024s1": 309.6}),
    ]
    table = bench.report.markdown(swept, "GPU", 55.0, {1152: 51.3}, 3, "2026-11-24")
    head, variants = table.split("Variants (`sweep`", 1)
    assert "| 1152 | 32 | 20 | 84.8 | 92.7 | 79.9 | 74.9 | 1.061 | 1.132 | 0.91 |" in head
    assert variants.splitlines()[2:] == [
        "| row B | batch | miss % | default (splits) | t512s1 | t1024s1 | t1024s3 |",
        "|---|---|---|---|---|---|---|",
        "| 1152 | 32 | 20 | 84.8 (3) | 91.9 | 90.2 | 84.7 |",
        "| 1152 | 128 | 20 | 309.6 (1) | 312.8 | 309.6 | - |",
    ]
    assert bench.report.variants_markdown([synthetic_record()]) == ""
    assert "Variants" not in bench.report.markdown([synthetic_record()], "GPU", 55.0, {1152: 51.3}, 3, "2026-11-24")


def test_against_adds_the_before_after_table_with_each_kernels_round_spread(bench):
    timed = [
        synthetic_record(ours_us=80.0, ours_rounds_us=[80.0, 84.0], against_us=100.0, against_rounds_us=[100.0, 101.0]),
        synthetic_record(batch=64, ours_us=150.0, ours_rounds_us=[150.0], against_us=120.0, against_rounds_us=[120.0]),
    ]
    table = bench.report.markdown(timed, "GPU", 55.0, {1152: 51.3}, 2, "2026-11-24")
    after = table.split("Before/after (`--against`", 1)[1].splitlines()
    assert after[2:6] == [
        "| row B | batch | miss % | ours µs | against µs | ours / against | ours rounds max/min | against rounds max/min |",
        "|---|---|---|---|---|---|---|---|",
        "| 1152 | 8 | 20 | 80.0 | 100.0 | 0.800 | 1.050 | 1.010 |",
        "| 1152 | 64 | 20 | 150.0 | 120.0 | 1.250 | 1.000 | 1.000 |",
    ]
    assert after[7] == "ours / against over 2 cells: min 0.800, median 1.250, max 1.250."
    assert "against 100.0 us ours/against 0.800" in bench.report.format_row(timed[0])
    assert bench.report.against_markdown([synthetic_record()]) == ""


def test_against_is_an_option_of_table_and_sweep(bench):
    for name in ("table", "sweep"):
        args = bench.cli.parse([name, "--against", "/tmp/before/csrc"])
        assert args.against == "/tmp/before/csrc"
    assert bench.cli.parse(["table"]).against is None


def test_positions_are_an_option_of_table_and_sweep(bench):
    for name in ("table", "sweep"):
        args = bench.cli.parse([name, "--positions", "2", "4", "--overlap", "0.8"])
        assert (args.positions, args.overlap) == ([2, 4], 0.8)
    assert (bench.cli.parse([]).positions, bench.cli.parse([]).overlap) == ([], 0.9)


def test_positions_add_the_verify_table_and_the_ratio_to_each_line(bench):
    positions = {"2": {"us": 120.0, "rounds_us": [120.0, 121.0], "missed_rows": 3500, "splits": 9, "overlap": 0.9}}
    record = synthetic_record(ours_us=80.0, positions=positions)
    line = bench.report.format_row(record)
    assert "| T=2 120.0 us = 1.50 x one position (splits 9, 3500 misses)" in line and line.endswith("clock 1980 MHz")
    table = bench.report.markdown([record, synthetic_record()], "GPU", 55.0, {1152: 51.3}, 2, "2026-11-26")
    after = table.split("Verify positions (`--positions`", 1)[1].splitlines()
    assert "repeats a share 0.9 of its entries" in after[0]
    assert after[2:5] == [
        "| row B | batch | miss % | T | D | G | one position µs | T positions µs | T / one | misses (one) "
        "| copies (T) | splits |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
        "| 1152 | 8 | 20 | 2 | 4096 | 2 | 80.0 | 120.0 | 1.50 | 3279 | 3500 | 9 |",
    ]
    assert after[6].startswith("D = device_buffer_size of the T-position cells")
    assert bench.report.positions_markdown([synthetic_record()]) == ""


def test_four_positions_at_top_k_2048_are_a_cell_served_one_position_per_launch(bench, monkeypatch):
    """--positions 4 at top_k 2048 is kept (a buffer of 4 x 2048 slots, one position per launch); the line and
    the table say so. Only 7 (beyond even one position per launch) and 64 (beyond the page) are skipped."""
    from swap_in import cells, table

    assert cells.positions_shape(2) == (cells.BUFFER, cells.SEQ_LEN)
    assert cells.positions_shape(3) == (6144, cells.SEQ_LEN + 2048)
    assert cells.positions_shape(4) == (8192, cells.SEQ_LEN + 4096)
    monkeypatch.setattr(table, "shared_memory_per_block", lambda device=None: 232_448)
    monkeypatch.setattr(table.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(table.torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert table.supported_positions([2, 3, 4, 6, 7, 64]) == [2, 3, 4, 6]
    positions = {"4": {"us": 300.0, "rounds_us": [300.0], "missed_rows": 3900, "union_misses": 3600, "splits": 9,
                       "overlap": 0.9, "buffer": 8192, "group": 1}}
    record = synthetic_record(ours_us=80.0, positions=positions)
    line = bench.report.format_row(record)
    assert "| T=4 300.0 us = 3.75 x one position (splits 9, 3900 misses, groups of 1)" in line
    rows = bench.report.positions_markdown([record]).splitlines()
    assert "| 1152 | 8 | 20 | 4 | 8192 | 1 | 80.0 | 300.0 | 3.75 | 3279 | 3900 | 9 |" in rows


def test_results_keep_their_file_names(bench, tmp_path):
    name = bench.report.result_name("NVIDIA H100 80GB HBM3", "2026-11-23", "_sweep")
    assert name == "swap_in_NVIDIA_H100_80GB_HBM3_2026-11-23_sweep"
    paths = bench.report.write_results(tmp_path / "out", name, {"results": []}, "# table\n")
    assert [p.name for p in paths] == [f"{name}.json", f"{name}.md"]
    assert json.loads(paths[0].read_text()) == {"results": []} and paths[1].read_text() == "# table\n"


# --- the trace's parsing (what the kernel prints under -DHISPARSE_TRACE) ----------------------------

def trace_line(role: str, part: int, start_ns: int, *deltas_ns: int) -> str:
    marks = list(deltas_ns) + [0] * (7 - len(deltas_ns))
    return f"trace {role} {part} {start_ns} " + " ".join(str(m) for m in marks)


def test_trace_summary_groups_calls_and_offsets_marks(bench):
    first, second = 10_000_000, 10_900_000  # two calls 900 us apart
    text = "\n".join([
        "unrelated output",
        trace_line("copy", 1, first + 500, 2_000, 6_000, 0, 11_000),   # plan not seen: mark 3 missing
        trace_line("plan", 0, first, 4_000, 5_000, 6_000, 8_000, 9_000, 10_000, 12_000),
        trace_line("plan", 0, second + 1_000, 3_000, 4_000, 5_000, 7_000, 8_000, 9_000, 11_000),
        trace_line("copy", 1, second, 2_500, 6_500, 7_000, 12_500),
    ])
    marks = bench.trace.summarize(text)
    assert marks["plan.start"] == [0.0, 1.0]
    assert marks["plan.looked"] == [4.0, 4.0] and marks["plan.published"] == [12.0, 12.0]
    assert marks["copy.start"] == [0.5, 0.0]
    assert marks["copy.looked"] == [2.5, 2.5] and marks["copy.written"] == [11.5, 12.5]
    assert marks["copy.plan"] == [7.0]
    lines = bench.trace.format_marks({"copy.written": [11.5, 12.5, 13.0]})
    assert lines == ["  copy.written     median   12.50 us  max   13.00 us  (n=3)"]


def test_trace_summary_of_no_trace_output_is_empty(bench):
    assert bench.trace.summarize("no device printf here\n") == {}


# --- variant builds: hisparse_sglang.ops.jit.load_module(defines=...) --------------------------------

def test_load_module_refuses_malformed_defines_before_building():
    from hisparse_sglang.ops.jit import check_defines, load_module

    assert check_defines(["HISPARSE_TRACE", "SPLITS=4", "X_1=a.b-c+d", "EMPTY="]) == (
        "HISPARSE_TRACE", "SPLITS=4", "X_1=a.b-c+d", "EMPTY=")
    with pytest.raises(TypeError, match=r"pass \('HISPARSE_TRACE',\)"):
        load_module("HISPARSE_TRACE")
    with pytest.raises(TypeError, match="must hold strings"):
        load_module((7,))
    for bad in ("-DHISPARSE_TRACE", "trace", "9LIVES", "A B", "A=1 2", "A=$(x)", ""):
        with pytest.raises(ValueError, match="is not NAME or NAME=VALUE"):
            load_module((bad,))


@pytest.mark.skipif(shutil.which("nvcc") is None and not os.environ.get("CUDA_HOME"), reason="needs nvcc (no GPU)")
def test_each_define_set_builds_its_own_cache_entry(tmp_path):
    """Built for 9.0a without a GPU (three nvcc builds, about 30 s each on two cores): the default,
    the trace build and a variant are three libraries, ``load_module()`` and ``load_module(())`` one;
    a second process finds all three in the cache and builds nothing."""
    probe = textwrap.dedent("""
        import json
        from hisparse_sglang.ops.jit import cache_dir, load_module
        default = load_module()
        assert load_module(()) is default and load_module(defines=()) is default
        trace = load_module(("HISPARSE_TRACE",))
        variant = load_module(("HISPARSE_TRACE", "HISPARSE_TEST_VARIANT=2"))
        assert len({id(default), id(trace), id(variant)}) == 3
        assert all(hasattr(m, "swap_in") and hasattr(m, "copy_rows") for m in (default, trace, variant))
        print(json.dumps(sorted(p.name for p in cache_dir().iterdir() if p.is_dir() and not p.name.startswith("."))))
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "HISPARSE_CACHE_DIR": str(tmp_path),
           "HISPARSE_CUDA_ARCH": "9.0a"}
    first = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    entries = json.loads(first.stdout.strip().splitlines()[-1])
    assert len(entries) == 3 and all(name.startswith("hisparse_kernels_") for name in entries)
    mtimes = {name: (tmp_path / name / "hisparse_kernels.so").stat().st_mtime_ns for name in entries}
    again = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert {name: (tmp_path / name / "hisparse_kernels.so").stat().st_mtime_ns for name in entries} == mtimes


def test_against_kernel_from_before_given_resident_rows_is_driven_without_them(bench):
    """``--against DIR`` of sources whose ``swap_in_positions`` takes no ``resident_rows_given``: the adapter drops
    it after the first refusal (tvm-ffi refuses a wrong arity before any launch) and refuses given rows, which that
    kernel would translate as positions; a library of this tree's signature is called unchanged."""
    from swap_in.against import adapt

    class Library:
        def __init__(self, arity):
            self.arity, self.calls = arity, []

        def swap_in_positions(self, *args):
            if len(args) != self.arity:
                raise TypeError(f"Mismatched number of arguments: expected {self.arity}, got {len(args)}")
            self.calls.append(args)
            return "launched"

    ours = (*range(18), "group", 0, "splits", "threads", "stream")
    earlier = Library(len(ours) - 1)
    adapted = adapt(earlier)
    assert adapted.swap_in_positions(*ours) == "launched"
    assert adapted.swap_in_positions(*ours) == "launched"
    assert earlier.calls == [(*range(18), "group", "splits", "threads", "stream")] * 2
    with pytest.raises(ValueError, match="predates given resident rows"):
        adapted.swap_in_positions(*ours[:19], 1, *ours[20:])
    current = Library(len(ours))
    assert adapt(current).swap_in_positions(*ours) == "launched" and current.calls == [ours]
    with pytest.raises(TypeError, match="Mismatched"):
        adapt(Library(3)).swap_in_positions(*ours)
