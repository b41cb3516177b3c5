"""Statistics of the harness's measurements (pure functions)."""

from __future__ import annotations

import math


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def detect_cycle(ids: list[int], min_repeats: int = 2) -> int | None:
    """Smallest period p such that the tail of `ids` repeats with period p at least min_repeats
    times and covers at least half of the sequence; None if there is no such period."""
    n = len(ids)
    for p in range(1, n // min_repeats + 1):
        k = 0
        while k + p < n and ids[n - 1 - k] == ids[n - 1 - k - p]:
            k += 1
        if k + p >= max(p * min_repeats, n // 2):
            return p
    return None


def compare_outputs(ref: dict, other: dict) -> dict:
    """Compare two correctness results (dicts with "prompts": [{id, output_ids, logprobs, top}...])."""
    by_id = {p["id"]: p for p in other.get("prompts", [])}
    rows, max_dlp, max_dtop, identical, mismatched_tokens, compared = [], 0.0, 0.0, 0, 0, 0
    for rp in ref.get("prompts", []):
        op = by_id.get(rp["id"])
        if op is None or rp.get("error") or op.get("error"):
            rows.append({"id": rp["id"], "status": "missing"})
            continue
        a, b = rp["output_ids"], op["output_ids"]
        n = min(len(a), len(b))
        first = next((i for i in range(n) if a[i] != b[i]), None)
        if first is None and len(a) != len(b):
            first = n
        upto = n if first is None else first
        dlp = [abs(x - y) for x, y in zip(rp["logprobs"][:upto], op["logprobs"][:upto])
               if x is not None and y is not None]
        dtop = []
        for ta, tb in zip(rp.get("top", [])[:upto], op.get("top", [])[:upto]):
            if not ta or not tb:
                continue
            mb = {tid: lp for tid, lp in tb}
            dtop += [abs(lp - mb[tid]) for tid, lp in ta if tid in mb and lp is not None and mb[tid] is not None]
        mism = sum(1 for i in range(n) if a[i] != b[i]) + abs(len(a) - len(b))
        row = {"id": rp["id"], "tokens": n, "identical": first is None, "first_mismatch": first,
               "mismatched_tokens": mism, "max_abs_dlogprob": max(dlp) if dlp else 0.0,
               "max_abs_dtop5": max(dtop) if dtop else 0.0}
        rows.append(row)
        compared += 1
        identical += row["identical"]
        mismatched_tokens += mism
        max_dlp = max(max_dlp, row["max_abs_dlogprob"])
        max_dtop = max(max_dtop, row["max_abs_dtop5"])
    return {"prompts_compared": compared, "prompts_identical": identical,
            "mismatched_tokens": mismatched_tokens,
            "max_abs_dlogprob_before_divergence": max_dlp,
            "max_abs_dtop5_before_divergence": max_dtop, "per_prompt": rows}


def steady_window(arrivals_per_request: list[list]) -> tuple[float, float] | None:
    """The time every request of a level is decoding: from the last request's first token to the
    first request's last token (None if a request has no token or the span is empty)."""
    if not arrivals_per_request or not all(arrivals_per_request):
        return None
    start = max(a[0][0] for a in arrivals_per_request)
    end = min(a[-1][0] for a in arrivals_per_request)
    return (start, end) if end > start else None


def window_tpot(arrivals: list, window: tuple[float, float]) -> float | None:
    """Seconds per output token of one request over the chunks that arrived within `window`
    (arrivals: [(time, cumulative tokens), ...]); None with fewer than two such chunks."""
    inside = [(t, n) for t, n in arrivals if window[0] <= t <= window[1]]
    if len(inside) < 2 or inside[-1][1] <= inside[0][1]:
        return None
    return (inside[-1][0] - inside[0][0]) / (inside[-1][1] - inside[0][1])
