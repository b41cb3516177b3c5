"""The low-load phase (issue #16): time per output token and decode throughput at concurrency 1-8.

Per arm, every level of --ll-levels runs --ll-repeats times with new prompts (--ll-input-len input,
--ll-output-len output tokens, all requests of a level sent at once, streaming).  The repeats are
interleaved (1, 2, 4, 8, 1, 2, 4, 8, ...) so that a slow drift of the machine spreads over all levels.
The prompts depend only on (level, repeat, request), so every arm decodes the same ones."""

from __future__ import annotations

import statistics

from client import make_prompt
from common import Run
from phases import run_level, warm_up

# (arm, reference arm): the ratios reported per level
RATIO_PAIRS = (("b", "a"), ("c", "a"), ("d", "a"), ("d", "b"),
               ("c+mtp", "a+mtp"), ("d+mtp", "a+mtp"), ("a+mtp", "a"), ("c+mtp", "c"))
# figures aggregated over the repeats of a level: (key in the summary, key in a run's row)
REPEATED_FIGURES = (("tpot_ms", "tpot_ms_median"), ("steady_tpot_ms", "steady_tpot_ms_median"),
                    ("output_tok_s", "output_tok_s"), ("log_gen_tput", "log_gen_tput_median"),
                    ("step_host_ms", "hisparse_step_host_ms_median"))


def lowload_prompt_seed(level: int, repeat: int, request: int) -> int:
    return 600_000 + 10_000 * repeat + 100 * level + request


def phase_lowload(target, run: Run, keep) -> dict:
    """keep(partial result) is called after every run of a level."""
    args, dl, log = run.args, run.deadline, run.log
    L, O = args.ll_input_len, args.ll_output_len
    res = {"settings": {"input_len": L, "output_len": O, "levels": list(args.ll_levels), "repeats": args.ll_repeats},
           "invocation": run.started, "runs": []}
    warm = warm_up(target, run, 97, L)
    if warm is not None:
        res["warmup_s"] = warm
    for rep in range(args.ll_repeats):
        for c in args.ll_levels:
            if dl.left() < args.reserve_s + 20:
                res["skipped_rest"] = "deadline"
                break
            target.check()
            prompts = [make_prompt(lowload_prompt_seed(c, rep, i), L, run.vocab) for i in range(c)]
            timeout = max(20.0, min(args.ll_level_timeout, dl.left() - args.reserve_s))
            row = {"level": c, "repeat": rep} | run_level(target, prompts, O, timeout, steady=True)
            res["runs"].append(row)
            log(f"  lowload c={c} (repeat {rep + 1}/{args.ll_repeats}): TPOT median {row['tpot_ms_median']} ms "
                f"(steady {row['steady_tpot_ms_median']} ms), {row['output_tok_s']} out tok/s, log decode "
                f"{row['log_gen_tput_median']} tok/s, HiSparse step host {row['hisparse_step_host_ms_median']} ms, "
                f"all resident {row['hisparse_all_resident']}, ok {row['ok']}/{c}")
            res["levels"] = summarize_lowload(res["runs"])
            keep(res)
        if res.get("skipped_rest"):
            break
    res["levels"] = summarize_lowload(res["runs"])
    return res


def summarize_lowload(runs: list[dict]) -> list[dict]:
    """Per level: the median over its repeats of each figure and its spread (min, max); a repeat
    counts where every request of it completed."""
    out = []
    for level in sorted({r["level"] for r in runs}):
        done = [r for r in runs if r["level"] == level and r["ok"] == r["concurrency"] and not r["errors"]]
        row = {"level": level, "repeats": len(done),
               "failed_repeats": sum(1 for r in runs if r["level"] == level) - len(done)}
        for key, src in REPEATED_FIGURES:
            vals = [r[src] for r in done if r.get(src) is not None]
            row[key] = round(statistics.median(vals), 3) if vals else None
            row[f"{key}_min"] = min(vals) if vals else None
            row[f"{key}_max"] = max(vals) if vals else None
        accepts = [r["speculative"]["accept_length"] for r in done if r.get("speculative")]
        row["accept_length"] = round(statistics.median(accepts), 3) if accepts else None
        flags = [r.get("hisparse_all_resident") for r in done]
        row["all_resident"] = None if not done or None in flags else all(flags)
        row["offloaded_max"] = max((r["hisparse_offloaded_max"] for r in done
                                    if r.get("hisparse_offloaded_max") is not None), default=None)
        out.append(row)
    return out


def lowload_ratios(arms: dict) -> dict:
    """Per pair of RATIO_PAIRS and level: arm / reference of the median TPOT, the steady TPOT and the
    decode throughputs.  Only between results of the same settings (input, output, levels, repeats);
    same_invocation says whether both arms ran in one run_e2e.py invocation."""
    out = {}
    for x, y in RATIO_PAIRS:
        lx, ly = (arms.get(x) or {}).get("lowload"), (arms.get(y) or {}).get("lowload")
        if not lx or not ly or lx.get("settings") != ly.get("settings"):
            continue
        by_level = {r["level"]: r for r in ly.get("levels", [])}
        levels = []
        for rx in lx.get("levels", []):
            ry = by_level.get(rx["level"])
            if ry is None:
                continue
            row = {"level": rx["level"]}
            for key in ("tpot_ms", "steady_tpot_ms", "output_tok_s", "log_gen_tput"):
                row[key] = round(rx[key] / ry[key], 3) if rx.get(key) and ry.get(key) else None
            levels.append(row)
        out[f"{x}/{y}"] = {"levels": levels,
                           "same_invocation": lx.get("invocation") is not None
                           and lx.get("invocation") == ly.get("invocation")}
    return out
