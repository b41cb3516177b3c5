"""What a table run prints and writes: one line per cell, the Markdown table, the result files.

Pure functions of the records ``table`` builds (dicts with the keys of the committed
``benchmarks/results/swap_in_*.json``), so they run, and are tested, without a GPU.
"""

from __future__ import annotations

import json
import pathlib
import re

from swap_in.cells import BUFFER, SEQ_LEN, TOP_K

__all__ = [
    "format_row", "markdown", "against_markdown", "variants_markdown", "positions_markdown", "result_name",
    "write_results",
]

_VARIANT = re.compile(r"t(\d+)s(\d+)")


def format_row(r: dict) -> str:
    sglang = f"{r['sglang_us']:8.1f}" if "sglang_us" in r else "     n/a"
    vs = f"{r['ours_us'] / r['sglang_us']:6.2f}" if "sglang_us" in r else "   n/a"
    floor = f"{r['ours_us'] / r['floor_us']:6.3f}" if r["floor_us"] > 0 else "     -"
    extra = ""
    if "ours_host_us" in r:
        extra += f" host/call ours {r['ours_host_us']:.1f} us sglang {r.get('sglang_host_us', float('nan')):.1f} us"
    if "variants_us" in r:
        best = min(r["variants_us"], key=r["variants_us"].get)
        extra = f" best {best} {r['variants_us'][best]:.1f}"
    if "ours_padding_us" in r:
        extra += f" all-padding launch {r['ours_padding_us']:.1f} us"
    copy = f"{r['copy_only_us']:8.1f} us ours/copy {r['ours_us'] / r['copy_only_us']:6.3f}" if "copy_only_us" in r else "       - us"
    if "against_us" in r:
        extra += f" against {r['against_us']:.1f} us ours/against {r['ours_us'] / r['against_us']:.3f}"
    for count, p in r.get("positions", {}).items():
        groups = f", groups of {p['group']}" if p.get("group", int(count)) < int(count) else ""
        extra += (f" | T={count} {p['us']:.1f} us = {p['us'] / r['ours_us']:.2f} x one position "
                  f"(splits {p['splits']}, {p['missed_rows']} misses{groups})")
    extra += f" clock {r.get('sm_clock_mhz_after', '?')} MHz"
    return (f"row {r['row_bytes']:5d} bs {r['batch']:4d} miss {r['miss_percent']:5.1f}% | ours {r['ours_us']:8.1f} us "
            f"(splits {r['splits']}) | sglang {sglang} us | copy-only {copy} | floor {r['floor_us']:8.1f} us | "
            f"ours/floor {floor} | ours/sglang {vs}{extra}")


def markdown(results: list, gpu: str, memcpy: float, gather: dict, rounds: int, date: str) -> str:
    """The table of a run (and, when it swept, the variants' table after it); ``date`` for the title."""
    lines = [
        f"# Swap-in kernel: {gpu}, {date}",
        "",
        f"top_k {TOP_K}, device_buffer_size {BUFFER}, seq_len {SEQ_LEN}; median of CUDA-event-timed single calls, "
        f"state reset outside the timed region; best of "
        f"{rounds} rounds that alternate the two kernels. Floor = missed bytes / scattered zero-copy gather bandwidth "
        f"measured in the same run ({', '.join(f'{k} B rows: {v:.1f} GB/s' for k, v in gather.items())}; "
        f"pinned H2D memcpy {memcpy:.1f} GB/s).",
        "",
        "Copy-only = `copy_rows` of exactly the cell's missed rows (host and device rows known in advance, one "
        "launch, same timing, best of three grid sizes): the data movement alone at that size, launch included. "
        "All-padding = our launch "
        "with `num_real_reqs` = 0 (launch and prologue only), in the 0 % rows.",
        "",
        "| row B | batch | miss % | ours µs | SGLang µs | copy-only µs | floor µs | ours / copy-only | ours / floor "
        "| ours / SGLang |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        sglang = f"{r['sglang_us']:.1f}" if "sglang_us" in r else "n/a"
        vs = f"{r['ours_us'] / r['sglang_us']:.2f}" if "sglang_us" in r else "n/a"
        floor = f"{r['ours_us'] / r['floor_us']:.3f}" if r["floor_us"] > 0 else "-"
        if "copy_only_us" in r:
            copy, vs_copy = f"{r['copy_only_us']:.1f}", f"{r['ours_us'] / r['copy_only_us']:.3f}"
        else:
            copy = f"all-padding {r['ours_padding_us']:.1f}" if "ours_padding_us" in r else "-"
            vs_copy = "-"
        lines.append(
            f"| {r['row_bytes']} | {r['batch']} | {r['miss_percent']:g} | {r['ours_us']:.1f} | {sglang} | "
            f"{copy} | {r['floor_us']:.1f} | {vs_copy} | {floor} | {vs} |"
        )
    variants = variants_markdown(results)
    against = against_markdown(results)
    if against:
        variants = against + ("\n" + variants if variants else "")
    positions = positions_markdown(results)
    if positions:
        variants = positions + ("\n" + variants if variants else "")
    return "\n".join(lines) + "\n" + (f"\n{variants}" if variants else "")


def against_markdown(results: list) -> str:
    """The before/after table of ``--against``: per cell, this tree's kernel and the other sources'
    (best round median each, rounds alternating) and their ratio, with the spread of each kernel's
    rounds (max / min). Empty when no record has an ``against`` time."""
    timed = [r for r in results if "against_us" in r]
    if not timed:
        return ""

    def spread(rounds: list) -> str:
        return f"{max(rounds) / min(rounds):.3f}" if rounds else "-"

    lines = [
        "Before/after (`--against`: our kernel built from other sources, alternating with this tree's in every "
        "round; µs, best round median):",
        "",
        "| row B | batch | miss % | ours µs | against µs | ours / against | ours rounds max/min | against rounds max/min |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in timed:
        lines.append(
            f"| {r['row_bytes']} | {r['batch']} | {r['miss_percent']:g} | {r['ours_us']:.1f} | {r['against_us']:.1f} | "
            f"{r['ours_us'] / r['against_us']:.3f} | {spread(r.get('ours_rounds_us', []))} | "
            f"{spread(r.get('against_rounds_us', []))} |"
        )
    ratios = sorted(r["ours_us"] / r["against_us"] for r in timed)
    lines += ["", f"ours / against over {len(ratios)} cells: min {ratios[0]:.3f}, median "
                  f"{ratios[len(ratios) // 2]:.3f}, max {ratios[-1]:.3f}."]
    return "\n".join(lines) + "\n"


def positions_markdown(results: list) -> str:
    """The verify-position table of ``--positions``: per cell and ``T``, the one-position call and
    ``swap_in_positions`` with ``T`` positions per request (best round median each, in the same rounds; the
    same requests for ``T <= 2``, a buffer of ``T x top_k`` slots beyond), their ratio, the rows copied
    against the one-position call's misses, the buffer ``D``, the positions per launch ``G`` and the split.
    Empty when no record has positions."""
    timed = [r for r in results if r.get("positions")]
    if not timed:
        return ""
    overlaps = sorted({p["overlap"] for r in timed for p in r["positions"].values()})
    lines = [
        "Verify positions (`--positions`: `swap_in_positions`, T query positions per request; position 0 is the "
        f"cell's top-k, each later one repeats a share {', '.join(f'{o:g}' for o in overlaps)} of its entries and "
        "names the verify tokens; µs, best round median, in the same rounds as the one-position call):",
        "",
        "| row B | batch | miss % | T | D | G | one position µs | T positions µs | T / one | misses (one) "
        "| copies (T) | splits |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in timed:
        for count, p in sorted(r["positions"].items(), key=lambda item: int(item[0])):
            lines.append(
                f"| {r['row_bytes']} | {r['batch']} | {r['miss_percent']:g} | {count} | {p.get('buffer', BUFFER)} | "
                f"{p.get('group', count)} | {r['ours_us']:.1f} | {p['us']:.1f} | {p['us'] / r['ours_us']:.2f} | "
                f"{r['missed_rows']} | {p['missed_rows']} | {p['splits']} |"
            )
    lines += ["", "D = device_buffer_size of the T-position cells (T x top_k when above the one-position cell's), G = "
                  "positions per launch (swap_in_plan.positions_per_group; the positions go in ceil(T / G) launches); "
                  "copies (T) = rows the call copied (the union's misses with G = T; with groups, also tokens a later "
                  "group missed because an earlier group's misses evicted them)."]
    return "\n".join(lines) + "\n"


def variants_markdown(results: list) -> str:
    """The sweep's table: per cell, the default call (its splits) and every threads/splits variant
    timed (``t512s3``: 512 threads per CTA, 3 CTAs per request; ``-`` where the grid would not be
    co-resident). Empty when no record has variants."""
    swept = [r for r in results if "variants_us" in r]
    if not swept:
        return ""
    names = sorted({name for r in swept for name in r["variants_us"]},
                   key=lambda name: tuple(int(x) for x in _VARIANT.fullmatch(name).groups()))
    lines = [
        "Variants (`sweep`: t = threads per CTA, s = CTAs per request; µs, same cells and run):",
        "",
        "| row B | batch | miss % | default (splits) | " + " | ".join(names) + " |",
        "|---|---|---|---|" + "---|" * len(names),
    ]
    for r in swept:
        times = [f"{r['variants_us'][name]:.1f}" if name in r["variants_us"] else "-" for name in names]
        lines.append(
            f"| {r['row_bytes']} | {r['batch']} | {r['miss_percent']:g} | {r['ours_us']:.1f} ({r['splits']}) | "
            + " | ".join(times) + " |"
        )
    return "\n".join(lines) + "\n"


def result_name(gpu: str, stamp: str, tag: str) -> str:
    """File stem of a run's results: ``swap_in_<gpu>_<date><tag>`` (``.json`` and ``.md``)."""
    return f"swap_in_{gpu.replace(' ', '_')}_{stamp}{tag}"


def write_results(out_dir: pathlib.Path, name: str, payload: dict, table: str) -> list[pathlib.Path]:
    """``<name>.json`` (the payload) and ``<name>.md`` (the table) in ``out_dir``, created if needed."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{name}.json", out_dir / f"{name}.md"]
    paths[0].write_text(json.dumps(payload, indent=1))
    paths[1].write_text(table)
    return paths
