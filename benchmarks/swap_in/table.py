"""``table`` (the default) and ``sweep``: ours vs SGLang 0.5.17's in-tree kernel vs the PCIe gather floor.

One run on a GPU prints, for every batch size x miss rate x row size, the median time per call of
our kernel (with the hit/miss counters, as the coordinator calls it) and of SGLang's kernel on
identical inputs (best of --rounds rounds alternating the two), the floor (missed bytes /
scattered zero-copy gather bandwidth measured in the same run), the copy-only time (``copy_rows``
of exactly the cell's missed rows, known in advance: the data movement alone at that size, launch
included), the all-padding launch (``num_real_reqs`` = 0) and the ratios; writes JSON and
Markdown to --out (default $OUT or benchmarks/results). ``sweep`` (or ``--sweep``) also times
splits/threads variants of our kernel in every cell. ``--against DIR`` adds a third kernel to the
rounds: ours built from the sources in DIR (``git archive <commit> csrc | tar -x -C DIR/..``), for a
before/after on one GPU in one run (columns "against" and "ours / against"). ``--positions T ...`` adds
``swap_in_positions`` with ``T`` verify positions per request to the rounds of every cell (the same
requests, position 0 the cell's top-k row, for ``T <= 2``; ``T = 3, 4`` with a buffer of ``T x 2048`` slots,
served one position per launch: ``cells.PositionsCell``) and reports its time over the one-position call's;
a ``T`` the kernel cannot serve at top_k 2048 (``T > 6``, or above the page's verify slots) is reported with
the reason and skipped.

SGLang's kernel comes from ``.baseline/`` (compiled from the installed sglang package by
``build-baseline``, never copied here); without it the table has no SGLang column.
"""

from __future__ import annotations

import datetime
import pathlib

import torch

from hisparse_sglang.errors import HiSparseError
from hisparse_sglang.ops import jit
from hisparse_sglang.ops.swap_in import DEFAULT_THREADS, CudaOps
from hisparse_sglang.ops.swap_in_plan import check_swap_in_positions_fits, shared_memory_per_block
from swap_in import report
from swap_in.against import adapt
from swap_in.cells import BUFFER, PAGE, SEQ_LEN, TOP_K, Cell, PositionsCell, cell_seed, load_sglang, positions_shape
from swap_in.timing import gather_bandwidth, host_us, median_us, memcpy_bandwidth, sm_clock_mhz, warm_up

SWEEP_THREADS = (512, 1024)
SWEEP_SPLITS = (1, 2, 3, 5, 9, 17, 33, 65)


def sweep_variants(cell: Cell, default_splits: int, reps: int) -> dict[str, float]:
    """Median µs of every threads/splits variant whose grid is co-resident (``t1024s3``: 1024
    threads per CTA, 3 CTAs per request), the default split included."""
    batch = cell.gpu.top_k.shape[0]
    variants = {}
    for threads in SWEEP_THREADS:
        resident = cell.resident_ctas(threads)
        for splits in sorted({*SWEEP_SPLITS, default_splits}):
            if splits > 1 and batch * splits > resident:
                continue  # beyond co-residency late CTAs leave and their planner copies for them: not a split to choose
            variants[f"t{threads}s{splits}"] = median_us(
                lambda: cell.run_ours(splits, threads), cell.reset_ours, reps
            )
    return variants


def supported_positions(requested: list[int]) -> list[int]:
    """The verify-position counts of ``--positions`` that ``swap_in_positions`` serves at the benchmark's
    top_k on this GPU (with the buffer of ``cells.positions_shape``), in order; prints why each other one is
    skipped."""
    kept = []
    for positions in requested:
        try:
            if not 1 <= positions <= PAGE - 1:
                raise ValueError(f"T must be in [1, page size - 1 = {PAGE - 1}]")
            check_swap_in_positions_fits(positions, TOP_K, positions_shape(positions)[0], PAGE, DEFAULT_THREADS,
                                         limit=shared_memory_per_block(torch.cuda.current_device()),
                                         device_name=torch.cuda.get_device_name())
        except (HiSparseError, ValueError) as exc:
            print(f"[bench] --positions {positions} skipped: {exc}", flush=True)
        else:
            kept.append(positions)
    return kept


def run(args) -> int:
    module = jit.load_module(tuple(args.define)) if args.define else None
    torch.cuda.init()
    properties = torch.cuda.get_device_properties(0)
    try:
        baseline = {row: load_sglang(row) for row in args.rows}
    except Exception as exc:  # the SGLang column is optional; say why it is missing
        print(f"[bench] SGLang baseline unavailable: {exc}", flush=True)
        baseline = {}
    against = (CudaOps(module=adapt(jit.load_module(tuple(args.define), sources=args.against))) if args.against
               else None)
    positions = supported_positions(args.positions)
    memcpy = memcpy_bandwidth()
    gather = {row: gather_bandwidth(row, module=module) for row in args.rows}
    print(f"[bench] {properties.name}: pinned H2D memcpy {memcpy:.1f} GB/s; scattered gather "
          + ", ".join(f"{row} B rows {bw:.1f} GB/s" for row, bw in gather.items()), flush=True)

    results = []
    host_cache: dict = {}
    for row_bytes in args.rows:
        for batch in args.batch:
            for miss in args.miss:
                cell = Cell(batch, miss / 100.0, row_bytes, seed=cell_seed(batch, miss), host_cache=host_cache,
                            module=module)
                cell.reset_ours()
                cell.run_ours()
                torch.cuda.synchronize()
                cell.verify(cell.out)
                if against is not None:
                    cell.reset_ours()
                    cell.run_ours(ops=against)
                    torch.cuda.synchronize()
                    cell.verify(cell.out)
                position_cells = [
                    PositionsCell(count, batch, miss / 100.0, row_bytes, seed=cell_seed(batch, miss),
                                  host_cache=host_cache, overlap=args.overlap, module=module)
                    for count in positions
                ]
                for position_cell in position_cells:
                    position_cell.verify()
                kernel = baseline.get(row_bytes)
                if kernel is not None:
                    cell.reset_sglang()
                    cell.run_sglang(kernel)
                    torch.cuda.synchronize()
                    cell.verify(cell.sg_out)
                # Rounds alternate ours and SGLang's kernel; each keeps its best round median, so a
                # burst of interference on the shared host (seen on the device machines as 3-6x
                # slower medians of single cells) hits both or neither.
                ours_rounds, sglang_rounds, against_rounds = [], [], []
                position_rounds = {position_cell.num_positions: [] for position_cell in position_cells}
                for _ in range(args.rounds):
                    warm_up()
                    ours_rounds.append(median_us(cell.run_ours, cell.reset_ours, args.reps))
                    for position_cell in position_cells:
                        position_rounds[position_cell.num_positions].append(
                            median_us(position_cell.run, position_cell.reset, args.reps)
                        )
                    if against is not None:
                        against_rounds.append(
                            median_us(lambda: cell.run_ours(ops=against), cell.reset_ours, args.reps)
                        )
                    if kernel is not None:
                        sglang_rounds.append(
                            median_us(lambda: cell.run_sglang(kernel), cell.reset_sglang, args.reps)
                        )
                ours_us = min(ours_rounds)
                copy_us = None
                if cell.misses:
                    # Best over grid sizes and rounds, like the floor's bandwidth: the copy at its fastest.
                    src, dst = cell.copy_only()
                    sms = properties.multi_processor_count
                    copy_us = min(
                        median_us(lambda: cell.run_copy_only(src, dst, blocks), lambda: None, args.reps)
                        for _ in range(args.rounds) for blocks in (sms // 2, sms, 4 * sms)
                    )
                record = {
                    "row_bytes": row_bytes, "batch": batch, "miss_percent": miss, "missed_rows": cell.misses,
                    "missed_bytes": cell.bytes, "ours_us": ours_us,
                    "splits": cell.default_splits(),
                    "floor_us": cell.bytes / (gather[row_bytes] * 1e9) * 1e6,
                    "ours_rounds_us": ours_rounds,
                }
                if copy_us is not None:
                    record["copy_only_us"] = copy_us
                if against_rounds:
                    record["against_us"] = min(against_rounds)
                    record["against_rounds_us"] = against_rounds
                if sglang_rounds:
                    record["sglang_us"] = min(sglang_rounds)
                    record["sglang_rounds_us"] = sglang_rounds
                if position_cells:
                    record["positions"] = {
                        str(position_cell.num_positions): {
                            "us": min(position_rounds[position_cell.num_positions]),
                            "rounds_us": position_rounds[position_cell.num_positions],
                            "missed_rows": position_cell.copies, "union_misses": position_cell.misses,
                            "splits": position_cell.default_splits(), "overlap": args.overlap,
                            "buffer": position_cell.buffer_size, "group": position_cell.group,
                        }
                        for position_cell in position_cells
                    }
                if args.sweep:
                    record["variants_us"] = sweep_variants(cell, record["splits"], args.reps)
                if miss == 0:
                    # The same launch with every row padding (num_real_reqs = 0): launch and prologue only.
                    real = cell.gpu.num_real_reqs.clone()
                    cell.gpu.num_real_reqs.zero_()
                    record["ours_padding_us"] = min(median_us(cell.run_ours, lambda: None, args.reps)
                                                    for _ in range(args.rounds))
                    cell.gpu.num_real_reqs.copy_(real)
                    record["ours_host_us"] = host_us(cell.run_ours)
                    if kernel is not None:
                        record["sglang_host_us"] = host_us(lambda: cell.run_sglang(kernel))
                record["sm_clock_mhz_after"] = sm_clock_mhz()
                results.append(record)
                print(report.format_row(record), flush=True)
                cell = position_cells = None  # free their tensors before the next cell
            torch.cuda.empty_cache()

    table = report.markdown(results, properties.name, memcpy, gather, args.rounds, datetime.date.today().isoformat())
    print(table)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    name = report.result_name(properties.name, stamp, args.tag)
    report.write_results(pathlib.Path(args.out), name, {
        "gpu": properties.name, "date": stamp, "torch": torch.__version__, "defines": args.define, "memcpy_gbps": memcpy,
        "gather_gbps": gather, "against": args.against, "positions": positions, "top_k": TOP_K, "buffer": BUFFER,
        "seq_len": SEQ_LEN, "results": results,
    }, table)
    return 0
