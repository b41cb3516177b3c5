"""Verdicts on harness results, shared by tests/e2e and the report.

judge_correctness: the rule by which an arm decodes "like the baseline" (docs/gpu-e2e.md, "Greedy
outputs"): identical tokens and logprobs where the same-server repeats are identical; otherwise (SGLang
0.5.17's DSA stack is not deterministic on one server) the arm's divergence from the baseline, measured
up to the first differing token, must look like the servers' own: its median over prompts within the
largest same-server divergence, its largest within 1.5x of it.

run_failures: what makes a harness run unusable for a test (a non-zero exit, an arm not ok)."""

from __future__ import annotations

NOISE_MAX_FACTOR = 1.5  # a wrong KV row moves logprobs by whole units, the stack's own noise by tenths


def judge_correctness(comparison: dict, arm_corr: dict, base_corr: dict) -> dict:
    """{"ok", "failures": [...], "rule": "identical" | "noise", and the figures the rule used}.

    comparison: stats.compare_outputs(baseline, arm) with "same_weights"; arm_corr / base_corr: the
    arms' correctness results (prompts, repeats, context_sensitive)."""
    failures = []
    if not comparison.get("same_weights"):
        failures.append("the arms did not load identical weights")
    compared = comparison.get("prompts_compared", 0)
    if compared < 3:
        failures.append(f"only {compared} prompts compared")
    missing = [r["id"] for r in comparison.get("per_prompt", []) if r.get("status") == "missing"]
    if missing:
        failures.append(f"prompts without a result in one of the arms: {missing}")
    if not base_corr.get("context_sensitive"):
        failures.append("outputs do not depend on the context: the check proves little")
    if any(p.get("nan_logprobs") for p in arm_corr.get("prompts", [])):
        failures.append("NaN logprobs")
    repeats = base_corr.get("repeats", []) + arm_corr.get("repeats", [])
    if len(repeats) < 2 * compared - 2:
        failures.append("every prompt must be decoded twice on each server (--corr-repeat 8) to measure the "
                        f"stack's own noise: {len(repeats)} repeats for {compared} prompts")
    cross = sorted(r["max_abs_dlogprob"] for r in comparison.get("per_prompt", []) if "max_abs_dlogprob" in r)
    verdict = {"cross_dlogprob": cross}
    if repeats and all(r["identical"] for r in repeats):
        verdict["rule"] = "identical"
        if comparison.get("prompts_identical") != compared or (cross and cross[-1] != 0.0):
            failures.append(f"the servers repeat themselves exactly but the arm differs from the baseline: "
                            f"{comparison.get('prompts_identical')}/{compared} prompts identical")
    elif repeats and cross:
        own = max(r["max_abs_dlogprob"] for r in repeats)
        median = cross[len(cross) // 2]
        verdict.update(rule="noise", own_max=own, cross_median=median, cross_max=cross[-1])
        if median > own:
            failures.append(f"median divergence from the baseline {median:.3g} > the servers' own {own:.3g}")
        if cross[-1] > NOISE_MAX_FACTOR * own:
            failures.append(f"largest divergence from the baseline {cross[-1]:.3g} > {NOISE_MAX_FACTOR} x the "
                            f"servers' own {own:.3g}")
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
