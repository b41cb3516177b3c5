"""``resident``: a swap-in call whose requests are all resident (the batch fits the GPU), this tree's kernel
against another tree's (``--against DIR``) in the same rounds.

    python benchmarks/bench_swap_in.py resident --against .e2e/before/csrc --batch 1 2 4 8 32 --positions 4

A resident request's entries are translated, nothing is copied: the call's cost is its launch and three
dependent loads per entry (top-k position, location, device row). That is every decode and verify layer of a
resident-first server at low load, where the coordinator keeps whole requests on the GPU. Per batch size: the
one-position call (``swap_in``, top_k 2048) and the ``T``-position call (``swap_in_positions``, the production
buffer of 4096 slots, the group the op picks), median µs of CUDA-event-timed calls, the best round of each
kernel, the ratio this tree / against; both kernels' outputs must be equal. Writes ``resident<tag>.md`` to
``--out``.
"""

from __future__ import annotations

import pathlib

import torch

from hisparse_sglang.ops import jit
from hisparse_sglang.ops.reference import NO_VERIFY_LIMIT
from hisparse_sglang.ops.swap_in import DEFAULT_THREADS, CudaOps
from hisparse_sglang.testing.cases import make_case, make_positions_case
from swap_in.against import adapt
from swap_in.cells import BUFFER, PAGE, SEQ_LEN, TOP_K
from swap_in.timing import median_us, sm_clock_mhz, warm_up

ROW_BYTES = 1152


def _calls(batch: int, positions: int, ops: list[CudaOps]):
    """Per kernel: the one-position call and the ``positions`` call on all-resident cases of ``batch`` rows."""
    one = make_case(batch, TOP_K, BUFFER, ROW_BYTES, page_size=PAGE, seq_len=SEQ_LEN, resident_fraction=1.0,
                    seed=batch).clone(device="cuda")
    many = make_positions_case(batch, positions, TOP_K, BUFFER, ROW_BYTES, page_size=PAGE, seq_len=SEQ_LEN,
                               resident_fraction=1.0, seed=batch + 1).clone(device="cuda")
    for case in (one, many):
        if bool((case.buffer_of_req[case.req_pool_indices.long()] >= 0).any()):
            raise AssertionError("the resident cell has an offloaded request")
    outs = [(torch.empty_like(one.top_k), torch.empty_like(many.top_k)) for _ in ops]
    limit = torch.full((batch,), NO_VERIFY_LIMIT, dtype=torch.int32, device="cuda")  # never lowered: no offloaded row
    calls = []
    for op, (out_one, out_many) in zip(ops, outs):
        calls.append((
            lambda op=op, out=out_one: op.swap_in(*one.args(), out=out),
            lambda op=op, out=out_many: op.swap_in_positions(*many.args(), out=out, verify_limit=limit),
        ))
    for call_one, call_many in calls:
        call_one()
        call_many()
    torch.cuda.synchronize()
    for out_one, out_many in outs[1:]:
        if not (torch.equal(out_one, outs[0][0]) and torch.equal(out_many, outs[0][1])):
            raise AssertionError(f"bs {batch}: the two kernels' outputs differ")
    group = ops[0].positions_group(positions, TOP_K, BUFFER)
    return calls, ops[0].choose_splits(batch, TOP_K, BUFFER, DEFAULT_THREADS), group


def run(args) -> int:
    ops = [CudaOps()]
    if args.against:
        ops.append(CudaOps(module=adapt(jit.load_module(sources=args.against))))
    nothing = lambda: None  # noqa: E731
    warm_up()
    header = ["batch", "CTAs per request", f"T = {args.positions}: launches (group)", "one position µs"]
    if args.against:
        header += ["against µs", "ours / against"]
    header += [f"T = {args.positions} µs"]
    if args.against:
        header += ["against µs", "ours / against"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for batch in args.batch:
        calls, splits, group = _calls(batch, args.positions, ops)
        best = [[float("inf"), float("inf")] for _ in ops]
        for _ in range(args.rounds):
            for k, pair in enumerate(calls):
                for which, call in enumerate(pair):
                    best[k][which] = min(best[k][which], median_us(call, nothing, args.reps))
        row = [str(batch), str(splits), f"{-(-args.positions // group)} ({group})"]
        for which in (0, 1):
            row.append(f"{best[0][which]:.1f}")
            if args.against:
                row += [f"{best[1][which]:.1f}", f"{best[0][which] / best[1][which]:.3f}"]
        lines.append("| " + " | ".join(row) + " |")
        print(lines[-1], flush=True)
    device = torch.cuda.get_device_name()
    text = (
        f"# Resident swap-in calls: {device}\n\ntop_k {TOP_K}, {BUFFER} slots, seq_len {SEQ_LEN}, every request "
        f"resident; median of {args.reps} CUDA-event-timed calls, best of {args.rounds} rounds alternating the "
        f"kernels; SM clock {sm_clock_mhz()} MHz. Against: {args.against or 'none'}.\n\n" + "\n".join(lines) + "\n"
    )
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"resident{args.tag}.md").write_text(text)
    print(text, flush=True)
    return 0
