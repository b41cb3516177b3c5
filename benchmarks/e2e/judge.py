"""Verdicts on harness results, shared by tests/e2e and the report.

judge_correctness: the rule by which an arm decodes "like the baseline" (docs/gpu-e2e.md, "Greedy
outputs"). Every prompt is decoded several times on each server (--corr-decodes). Two decodes of one
prompt saw identical tokens up to and including their first differing position, so what they computed
there can be compared: stats.divergence gives, per pair of decodes, that position (`first`) and the
largest distance between their top-5 logprob lists up to and including it (`score`).

* Where the baseline server repeats itself exactly (every pair of its own decodes identical), the arm
  must produce exactly the baseline's outputs.
* Otherwise (SGLang 0.5.17's DSA stack is not deterministic on one server) the baseline's own pairs
  measure the stack's noise, and the arm must look like it. Per prompt, the mean over its pairs of
  the arm against the baseline (decode k of the arm against decode k of the baseline) is set against
  the mean over the baseline's own pairs, and over the prompts (paired, so a prompt with small margins
  weighs alike on both sides) Wilcoxon's one-sided signed-rank test must not find (p < ALPHA) that the
  arm's scores are larger, that it diverges earlier, or that its own pairs score larger than the
  baseline's own; and its largest score against the baseline must stay within NOISE_MAX_FACTOR of the
  baseline's own largest.
* Every arm: a greedy decode must choose its own most likely token (checked where the baseline does).

run_failures: what makes a harness run unusable for a test (a non-zero exit, an arm not ok)."""

from __future__ import annotations

import itertools
import statistics

from stats import divergence, greedy_inconsistencies, signed_rank_greater

ALPHA = 1e-3  # per test; three tests per arm and a few arms per run: a good run fails by chance about 1 % of the time
NOISE_MAX_FACTOR = 1.5  # a wrong KV row moves logprobs by whole units, the stack's own noise by tenths
MIN_PROMPTS = 3
# With n prompts the smallest p-value the signed-rank test can give is 2^-n: below ALPHA from 10 on.
MIN_PROMPTS_NOISE = 12
MIN_DECODES = 2


def decodes_by_prompt(corr: dict) -> dict[str, list[dict]]:
    """Every decode of every prompt of a correctness result (the first in "prompts", the others in
    "redecodes"), by prompt id, in decode order; prompts with an error are left out."""
    out: dict[str, list[dict]] = {}
    for p in corr.get("prompts", []):
        if "output_ids" in p and not p.get("error"):
            out[p["id"]] = [p]
    for d in sorted(corr.get("redecodes", []), key=lambda d: d.get("decode", 0)):
        if d["id"] in out and "output_ids" in d:
            out[d["id"]].append(d)
    return out


def own_pairs(decodes: dict[str, list[dict]]) -> dict[str, list[dict]]:
    """stats.divergence of every pair of one server's decodes of a prompt, by prompt."""
    return {pid: [divergence(x, y) for x, y in itertools.combinations(runs, 2)] for pid, runs in decodes.items()}


def cross_pairs(arm: dict[str, list[dict]], base: dict[str, list[dict]]) -> dict[str, list[dict]]:
    """stats.divergence of decode k of the arm against decode k of the baseline, by common prompt."""
    return {pid: [divergence(x, y) for x, y in zip(arm[pid], base[pid])] for pid in sorted(arm.keys() & base.keys())}


def paired_p(worse: dict[str, list[dict]], better: dict[str, list[dict]], key: str, larger_is_worse: bool) -> float:
    """Signed-rank p-value that, prompt by prompt, the mean `key` of `worse`'s pairs is worse than
    that of `better`'s (prompts with pairs on both sides)."""
    differences = []
    for pid in sorted(worse.keys() & better.keys()):
        if worse[pid] and better[pid]:
            d = statistics.fmean(p[key] for p in worse[pid]) - statistics.fmean(p[key] for p in better[pid])
            differences.append(d if larger_is_worse else -d)
    return signed_rank_greater(differences)


def _summary(by_prompt: dict[str, list[dict]]) -> dict:
    pairs = [p for ps in by_prompt.values() for p in ps]
    scores = [p["score"] for p in pairs]
    firsts = [p["first"] for p in pairs]
    return {"pairs": len(pairs), "identical": sum(p["identical"] for p in pairs),
            "score_median": statistics.median(scores) if scores else None, "score_max": max(scores, default=None),
            "first_median": statistics.median(firsts) if firsts else None, "first_min": min(firsts, default=None)}


def judge_correctness(arm_corr: dict, base_corr: dict, same_weights: bool | None) -> dict:
    """{"ok", "failures": [...], "rule": "identical" | "noise", and the figures the rule used}.

    arm_corr / base_corr: the arms' correctness results (prompts with output_ids, logprobs, top;
    redecodes; context_sensitive); same_weights: whether both arms logged the same weight fingerprint."""
    failures = []
    if not same_weights:
        failures.append("the arms did not load identical weights")
    arm, base = decodes_by_prompt(arm_corr), decodes_by_prompt(base_corr)
    common = sorted(arm.keys() & base.keys())
    if len(common) < MIN_PROMPTS:
        failures.append(f"only {len(common)} prompts decoded by both arms (at least {MIN_PROMPTS})")
    missing = sorted((arm.keys() | base.keys() | {p["id"] for p in base_corr.get("prompts", [])}) - set(common))
    if missing:
        failures.append(f"prompts without a result in one of the arms: {missing}")
    if not base_corr.get("context_sensitive"):
        failures.append("outputs do not depend on the context: the check proves little")
    if any(p.get("nan_logprobs") for p in arm_corr.get("prompts", [])):
        failures.append("NaN logprobs")
    few = [pid for pid in common if min(len(arm[pid]), len(base[pid])) < MIN_DECODES]
    if few:
        failures.append(f"every prompt must be decoded at least {MIN_DECODES} times on each server "
                        f"(--corr-decodes) to measure the stack's own noise: {few}")
    base_greedy = sum(greedy_inconsistencies(d) for runs in base.values() for d in runs)
    arm_greedy = sum(greedy_inconsistencies(d) for runs in arm.values() for d in runs)
    if base_greedy == 0 and arm_greedy:
        failures.append(f"the arm chose a token that is not its own most likely at {arm_greedy} positions "
                        f"(greedy decoding; the baseline: none)")
    base = {pid: base[pid] for pid in common}
    arm = {pid: arm[pid] for pid in common}
    base_own, arm_own, cross = own_pairs(base), own_pairs(arm), cross_pairs(arm, base)
    verdict = {"base_own": _summary(base_own), "arm_own": _summary(arm_own), "cross": _summary(cross),
               "greedy_inconsistencies": {"arm": arm_greedy, "base": base_greedy}}
    all_base_own = [p for ps in base_own.values() for p in ps]
    all_cross = [p for ps in cross.values() for p in ps]
    if all_base_own and all(p["identical"] for p in all_base_own):
        verdict["rule"] = "identical"
        if not all(p["identical"] for p in all_cross):
            failures.append(f"the baseline repeats itself exactly but the arm differs from it: "
                            f"{sum(p['identical'] for p in all_cross)}/{len(all_cross)} decodes identical")
    elif all_base_own and all_cross:
        verdict["rule"] = "noise"
        if len(common) < MIN_PROMPTS_NOISE:
            failures.append(f"only {len(common)} prompts decoded by both arms: the tests need at least "
                            f"{MIN_PROMPTS_NOISE} to be able to fail (--corr-seeds)")
        tests = {
            "score": paired_p(cross, base_own, "score", larger_is_worse=True),
            "first": paired_p(cross, base_own, "first", larger_is_worse=False),
            "own_score": paired_p(arm_own, base_own, "score", larger_is_worse=True),
        }
        verdict["p"] = tests
        if tests["score"] < ALPHA:
            failures.append(f"the arm's distributions differ from the baseline's more than the baseline's own "
                            f"decodes do (top-5 distance up to the first divergence: median "
                            f"{verdict['cross']['score_median']:.3g} against {verdict['base_own']['score_median']:.3g}, "
                            f"p={tests['score']:.2g})")
        if tests["first"] < ALPHA:
            failures.append(f"the arm diverges from the baseline earlier than the baseline from itself (median "
                            f"first divergence {verdict['cross']['first_median']} against "
                            f"{verdict['base_own']['first_median']}, p={tests['first']:.2g})")
        if tests["own_score"] < ALPHA:
            failures.append(f"the arm's own decodes differ from each other more than the baseline's (median "
                            f"{verdict['arm_own']['score_median']:.3g} against {verdict['base_own']['score_median']:.3g}, "
                            f"p={tests['own_score']:.2g})")
        own_max = verdict["base_own"]["score_max"]
        if verdict["cross"]["score_max"] > NOISE_MAX_FACTOR * own_max:
            failures.append(f"largest top-5 distance from the baseline {verdict['cross']['score_max']:.3g} > "
                            f"{NOISE_MAX_FACTOR} x the baseline's own {own_max:.3g}")
    return verdict | {"ok": not failures, "failures": failures}


def run_failures(rc: int, data: dict | None, arms: list[str]) -> list[str]:
    """Why a harness run cannot be judged: its exit code (0 ok, 2 an arm failed, 3 skipped for time),
    an arm of `arms` without results, or not ok."""
    failures = [] if rc == 0 else [f"run_e2e.py exited {rc} (0 ok, 2 an arm failed, 3 skipped for time)"]
    if data is None:
        return failures + ["no results.json"]
    for arm in arms:
        r = data.get("arms", {}).get(arm)
        if r is None:
            failures.append(f"arm {arm}: no results")
        elif r.get("status") != "ok":
            failures.append(f"arm {arm}: {r.get('status')}: {str(r.get('error', ''))[-2000:]}")
    return failures


def explain(data: dict, arms: list[str], baseline: str = "a") -> str:
    """Markdown: each arm's verdict against the baseline, with the figures of the rule, and the paired
    tests also where a precondition fails (a run cut short still shows what it measured)."""
    base_corr = data["arms"][baseline]["correctness"]
    base = decodes_by_prompt(base_corr)
    base_own = own_pairs(base)
    lines = [f"baseline {baseline}: {len(base)} prompts, own pairs {_summary(base_own)}", ""]
    for arm in arms:
        result = data["arms"].get(arm)
        if not result or not result.get("correctness"):
            lines.append(f"- {arm}: no correctness results")
            continue
        corr = result["correctness"]
        decodes = decodes_by_prompt(corr)
        common = sorted(decodes.keys() & base.keys())
        cross = cross_pairs({p: decodes[p] for p in common}, {p: base[p] for p in common})
        own = {p: base_own[p] for p in common}
        weights = data.get("compare", {}).get(f"{arm}_vs_{baseline}", {}).get("same_weights")
        verdict = judge_correctness(corr, base_corr, weights)
        kv = result.get("log", {}).get("kv_check")
        lines += [
            f"- {arm} ({result.get('status')}): {len(common)} prompts; against {baseline}: {_summary(cross)}; "
            f"paired p score {paired_p(cross, own, 'score', True):.2g}, first divergence "
            f"{paired_p(cross, own, 'first', False):.2g}; greedy inconsistencies "
            f"{sum(greedy_inconsistencies(d) for runs in decodes.values() for d in runs)}; in-server KV check {kv}",
            f"  verdict: {'accepted' if verdict['ok'] else 'REJECTED'}: {verdict['failures']}",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    import argparse
    import gzip
    import json

    parser = argparse.ArgumentParser(description="Judge the arms of a harness results.json (or .json.gz) against "
                                                 "the baseline, with the figures of the rule.")
    parser.add_argument("results")
    parser.add_argument("--arms", default="b,c,d,pd-c,pd-b,dx")
    parser.add_argument("--baseline", default="a")
    args = parser.parse_args(argv)
    opener = gzip.open if args.results.endswith(".gz") else open
    with opener(args.results, "rt") as f:
        data = json.load(f)
    print(explain(data, [a for a in args.arms.split(",") if a in data["arms"]], args.baseline), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
