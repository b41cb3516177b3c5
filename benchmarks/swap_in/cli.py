"""The command line of ``benchmarks/bench_swap_in.py``: one parser per subcommand.

Building the parsers imports nothing outside the standard library, so ``--help`` of every subcommand works anywhere and
``build-baseline`` runs in an environment that has sglang but not this package; a subcommand's
module (torch, hisparse_sglang, CUDA) is imported only to run it. ``table`` is the default: an
argument list that starts with an option (or is empty) is the table's.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pathlib
import sys

from swap_in.build_baseline import DEFAULT_CACHE, DEFAULT_OUT

__all__ = ["SUBCOMMANDS", "DEFAULT_SUBCOMMAND", "build_parser", "parse", "main"]

REPO = pathlib.Path(__file__).resolve().parents[2]
DEFAULT_SUBCOMMAND = "table"
# name -> (module under swap_in/ that runs it, one-line help)
SUBCOMMANDS = {
    "table": ("table", "ours vs SGLang's kernel vs the floor, every batch x miss rate x row size (default)"),
    "sweep": ("table", "the table plus every threads/splits variant of our kernel per cell"),
    "trace": ("trace", "phase timeline of a few cells from a -DHISPARSE_TRACE build"),
    "diagnose": ("diagnose", "one cell run a few times and checked (under compute-sanitizer or ncu)"),
    "latency": ("latency", "fixed costs: all-padding launch, after a small-smem kernel, after a swap-in"),
    "resident": ("resident", "calls whose requests are all resident (translation only), against another tree's kernel"),
    "profile": ("profile", "six calls of one cell for Nsight Compute (--launch-skip 5 profiles the last)"),
    "build-baseline": ("build_baseline", "compile SGLang's kernel from the installed sglang into .baseline/ (no GPU)"),
    "check-baseline": ("baseline", "load the .baseline/ libraries; --smoke runs them on the GPU"),
}


def define(text: str) -> str:
    """One ``NAME`` or ``NAME=VALUE`` compile define (checked by ``hisparse_sglang.ops.jit``)."""
    from hisparse_sglang.ops.jit import check_defines  # only when --define is used: build-baseline lacks it

    try:
        check_defines((text,))
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    return text


def cell_spec(text: str) -> tuple[int, float]:
    """``BATCH:MISS_PERCENT`` (``8:20``) as (8, 20.0)."""
    parts = text.split(":")
    try:
        if len(parts) != 2:
            raise ValueError
        return int(parts[0]), float(parts[1])
    except ValueError:
        raise argparse.ArgumentTypeError(f"cell {text!r} is not BATCH:MISS_PERCENT, e.g. 8:20") from None


def _add_define(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--define", nargs="*", type=define, default=[], metavar="NAME=VALUE",
                        help=f"{what} (jit.load_module(defines=...): a separate cache entry, used by this run only)")


def _add_table(parser: argparse.ArgumentParser, sweep_flag: bool) -> None:
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    parser.add_argument("--miss", type=float, nargs="+", default=[0, 5, 20, 50, 100], help="miss rates in percent")
    parser.add_argument("--rows", type=int, nargs="+", default=[1152, 656])
    parser.add_argument("--reps", type=int, default=20, help="timed calls per round (median)")
    parser.add_argument("--rounds", type=int, default=5,
                        help="rounds alternating ours and SGLang's kernel; each reports its best round median")
    if sweep_flag:
        parser.add_argument("--sweep", action="store_true", help="also time splits/threads variants (= sweep)")
    else:
        parser.set_defaults(sweep=True)
    parser.add_argument("--out", default=os.environ.get("OUT", str(REPO / "benchmarks" / "results")))
    _add_define(parser, "compile our kernel with these -D macros (variant experiments)")
    parser.add_argument("--against", metavar="DIR", default=None,
                        help="also time our kernel built from the kernel sources in DIR (e.g. an earlier commit's "
                             "csrc/), alternating with this tree's in every round: a before/after in one run")
    parser.add_argument("--tag", default="", help="suffix of the output file names")
    parser.add_argument("--positions", type=int, nargs="*", default=[], metavar="T",
                        help="also time swap_in_positions with T verify positions per request in every cell (e.g. "
                             "--positions 2 4), against the one-position call of the same cell (ratio printed); a T "
                             "the kernel cannot plan at top_k 2048 is reported and skipped")
    parser.add_argument("--overlap", type=float, default=0.9,
                        help="with --positions: share of position 0's top-k entries each later position repeats")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bench_swap_in.py",
        description="Swap-in kernel benchmarks: ours vs SGLang 0.5.17's in-tree kernel vs the PCIe gather floor.",
        epilog=f"Without a subcommand: {DEFAULT_SUBCOMMAND} (bench_swap_in.py --batch 1 8 = "
               f"bench_swap_in.py {DEFAULT_SUBCOMMAND} --batch 1 8).",
    )
    commands = parser.add_subparsers(dest="command", metavar="SUBCOMMAND")
    parsers = {}
    for name, (module, help_line) in SUBCOMMANDS.items():
        parsers[name] = commands.add_parser(name, help=help_line, description=help_line)
        parsers[name].set_defaults(module=f"swap_in.{module}")

    _add_table(parsers["table"], sweep_flag=True)
    _add_table(parsers["sweep"], sweep_flag=False)

    trace = parsers["trace"]
    trace.add_argument("--cells", nargs="+", type=cell_spec, default=[(1, 5.0), (1, 20.0), (1, 100.0), (8, 20.0)],
                       metavar="BATCH:MISS", help="batch:miss%% (default 1:5 1:20 1:100 8:20)")
    trace.add_argument("--row", type=int, default=1152)
    trace.add_argument("--splits", type=int, default=None)
    trace.add_argument("--calls", type=int, default=9)
    _add_define(trace, "extra -D macros besides HISPARSE_TRACE (variants)")

    diagnose = parsers["diagnose"]
    diagnose.add_argument("--batch", type=int, default=1)
    diagnose.add_argument("--miss", type=float, default=0)
    diagnose.add_argument("--row", type=int, default=1152)
    diagnose.add_argument("--sglang", action="store_true", help="run SGLang's kernel (and ours only with --ours)")
    diagnose.add_argument("--ours", action="store_true")
    diagnose.add_argument("--splits", type=int, default=None)
    diagnose.add_argument("--threads", type=int, default=None)
    diagnose.add_argument("--calls", type=int, default=3)
    _add_define(diagnose, "compile our kernel with these -D macros")

    latency = parsers["latency"]
    latency.add_argument("batch", type=int, nargs="?", default=1)
    _add_define(latency, "compile our kernel with these -D macros")

    resident = parsers["resident"]
    resident.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4, 8, 32])
    resident.add_argument("--positions", type=int, default=4, metavar="T",
                          help="verify positions of the swap_in_positions call (the op picks the group at 4096 slots)")
    resident.add_argument("--reps", type=int, default=50, help="timed calls per round (median)")
    resident.add_argument("--rounds", type=int, default=5, help="rounds alternating the kernels; the best round counts")
    resident.add_argument("--against", metavar="DIR", default=None,
                          help="also time our kernel built from the kernel sources in DIR (an earlier commit's csrc/)")
    resident.add_argument("--out", default=os.environ.get("OUT", str(REPO / "benchmarks" / "results")))
    resident.add_argument("--tag", default="", help="suffix of the output file name")

    profile = parsers["profile"]
    profile.add_argument("batch", type=int)
    profile.add_argument("miss", type=float, help="miss rate in percent")
    profile.add_argument("splits", type=int, nargs="?", default=None, help="CTAs per request (default: choose_splits)")
    profile.add_argument("--row", type=int, default=1152)
    _add_define(profile, "compile our kernel with these -D macros")

    build = parsers["build-baseline"]
    build.add_argument("--config", action="append", default=[],
                       help="ITEM_BYTES,TOP_K,HOT_BUFFER[,BLOCK_SIZE] (repeatable)")
    build.add_argument("--out-dir", default=str(DEFAULT_OUT))
    build.add_argument("--cache-dir", default=str(DEFAULT_CACHE),
                       help="TVM_FFI_CACHE_DIR used for the JIT build tree (outside the repo)")
    build.add_argument("--arch", default="9.0",
                       help="compute capability to build for, MAJOR.MINOR (SGLang adds the suffix)")
    build.add_argument("--clean", action="store_true", help="drop the JIT build cache first")

    check = parsers["check-baseline"]
    check.add_argument("--lib-dir", default=None)
    check.add_argument("--smoke", action="store_true", help="run the GPU smoke test")
    return parser


def parse(argv: list[str]) -> argparse.Namespace:
    """Parsed arguments, ``table``'s when ``argv`` names no subcommand."""
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        argv = [DEFAULT_SUBCOMMAND, *argv]
    return build_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    return importlib.import_module(args.module).run(args)
