"""The swap-in kernel benchmarks behind ``benchmarks/bench_swap_in.py`` (their one entry).

    cli.py             the options of every subcommand (standard library only; ``--help`` anywhere)
    cells.py           a (batch, miss rate, row size) case in our and SGLang's tables; run, reset, verify
    timing.py          warm-up, CUDA-event medians, host time per call, the gather and memcpy floors
    report.py          a cell's line, the Markdown tables, the result files (no GPU)
    table.py           ``table`` (default) and ``sweep``
    against.py         ``table --against DIR``: another tree's kernel driven with this tree's arguments
    trace.py           ``trace``: phase timeline of a -DHISPARSE_TRACE build
    diagnose.py        ``diagnose``: one cell, checked (compute-sanitizer, ncu)
    latency.py         ``latency``: fixed costs of a call
    profile.py         ``profile``: one cell's calls for Nsight Compute
    baseline.py        SGLang's prebuilt kernel (``check-baseline``)
    build_baseline.py  ``build-baseline``: SGLang's kernel compiled from the installed sglang

Variant builds of our kernels come from ``hisparse_sglang.ops.jit.load_module(defines=...)`` and
reach only the calls of the cells they are passed to.
"""
