"""Swap-in kernel benchmarks: ours vs SGLang 0.5.17's in-tree kernel vs the PCIe gather floor.

One entry, one subcommand per question; the code lives in the package ``swap_in/`` beside this
file (cells.py: the cases; timing.py: warm-up, CUDA-event medians, floors; report.py: the table and
result files; one module per subcommand; cli.py: the options):

    python benchmarks/bench_swap_in.py                          # table: the full table (embedded defaults)
    python benchmarks/bench_swap_in.py --batch 1 8 --miss 20    # table, a subset
    python benchmarks/bench_swap_in.py sweep --batch 1 8 --miss 20   # also the splits/threads variants
    python benchmarks/bench_swap_in.py table --define NAME=VALUE --tag _variant   # a variant build
    python benchmarks/bench_swap_in.py trace --cells 1:5 1:20 8:20   # phase timeline (-DHISPARSE_TRACE)
    python benchmarks/bench_swap_in.py diagnose --batch 128 --miss 5 [--sglang]   # under compute-sanitizer/ncu
    python benchmarks/bench_swap_in.py latency [BATCH]          # fixed costs of a call
    python benchmarks/bench_swap_in.py resident --against DIR   # all-resident calls, this tree's kernel against DIR's
    python benchmarks/bench_swap_in.py profile BATCH MISS [SPLITS]   # under ncu
    python benchmarks/bench_swap_in.py build-baseline           # SGLang's kernel into .baseline/ (sglang env)
    python benchmarks/bench_swap_in.py check-baseline [--smoke] # load (and run) the .baseline/ libraries

``python benchmarks/bench_swap_in.py SUBCOMMAND --help`` lists each one's options.
"""

import sys

from swap_in.cli import main

if __name__ == "__main__":
    sys.exit(main())
