"""Statistics of the harness's measurements (pure functions)."""

from __future__ import annotations

import math
import statistics


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
        first = first_divergence(a, b)
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


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first position where two greedy outputs differ (a length difference counts at the shorter
    one's end); None if they are identical."""
    n = min(len(a), len(b))
    first = next((i for i in range(n) if a[i] != b[i]), None)
    if first is None and len(a) != len(b):
        first = n
    return first


def top_distance(top_x: list | None, top_y: list | None) -> float | None:
    """How far apart two top-k lists ([[token id, logprob], ...]) of one position are: the largest
    discrepancy over the tokens of either list. A token in both lists contributes |lp_x - lp_y|; a
    token only in x's list was ranked below y's last entry by y, so it contributes at least
    max(0, lp_x - lowest lp of y) (and symmetrically): a lower bound of the L-infinity distance of the
    two distributions on those tokens. None if either list is missing."""
    if not top_x or not top_y:
        return None
    x = {int(t): lp for t, lp in top_x if lp is not None}
    y = {int(t): lp for t, lp in top_y if lp is not None}
    if not x or not y:
        return None
    x_last, y_last = min(x.values()), min(y.values())
    worst = 0.0
    for token in x.keys() | y.keys():
        if token in x and token in y:
            gap = abs(x[token] - y[token])
        elif token in x:
            gap = max(0.0, x[token] - y_last)
        else:
            gap = max(0.0, y[token] - x_last)
        worst = max(worst, gap)
    return worst


def divergence(x: dict, y: dict) -> dict:
    """What two decodes of one prompt computed from the same prefix (dicts with output_ids, top).

    first: the first differing position (the output length if none). Up to and including it both
    decodes saw identical tokens, so their distributions there must agree up to the serving stack's
    own noise. score: the largest top_distance over those positions (0.0 if no position has both top
    lists). compared: how many positions were compared."""
    a, b = x["output_ids"], y["output_ids"]
    first = first_divergence(a, b)
    end = min(len(a), len(b)) if first is None else first
    last = min(end, len(a) - 1, len(b) - 1)
    tops_x, tops_y = x.get("top") or [], y.get("top") or []
    distances = [top_distance(tops_x[i] if i < len(tops_x) else None, tops_y[i] if i < len(tops_y) else None)
                 for i in range(last + 1)]
    distances = [d for d in distances if d is not None]
    return {"first": min(len(a), len(b)) if first is None else first, "identical": first is None,
            "score": max(distances) if distances else 0.0, "compared": len(distances)}


def greedy_inconsistencies(decode: dict, tolerance: float = 1e-4) -> int:
    """Positions where a greedy decode chose a token that is not its own most likely one: the token is
    missing from its own top list, ranks below the top-1 there by more than `tolerance`, or its
    reported logprob is not the one its top list gives it."""
    bad = 0
    for token, lp, top in zip(decode.get("output_ids") or [], decode.get("logprobs") or [], decode.get("top") or []):
        if not top or lp is None:
            continue
        listed = {int(t): v for t, v in top if v is not None}
        own = listed.get(int(token))
        if own is None or own < max(listed.values()) - tolerance or abs(lp - own) > tolerance:
            bad += 1
    return bad


def signed_rank_greater(differences: list[float]) -> float:
    """One-sided p-value that paired differences tend to be positive: Wilcoxon's signed-rank test,
    exact (zero differences dropped, tied magnitudes given their average rank). 1.0 with no non-zero
    difference."""
    nonzero = sorted((abs(d), d > 0) for d in differences if d != 0)
    n = len(nonzero)
    if n == 0:
        return 1.0
    doubled_ranks = [0] * n  # twice the average rank, an integer
    i = 0
    while i < n:
        j = i
        while j + 1 < n and nonzero[j + 1][0] == nonzero[i][0]:
            j += 1
        for k in range(i, j + 1):
            doubled_ranks[k] = i + j + 2
        i = j + 1
    observed = sum(r for r, (_, positive) in zip(doubled_ranks, nonzero) if positive)
    # Under the null every sign is a fair coin: count the sign patterns whose positive rank sum
    # reaches the observed one.
    counts = {0: 1}
    for r in doubled_ranks:
        step = dict(counts)
        for total, ways in counts.items():
            step[total + r] = step.get(total + r, 0) + ways
        counts = step
    return sum(ways for total, ways in counts.items() if total >= observed) / 2 ** n


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
    chunks = window_chunks(arrivals, window)
    return chunks[0] / chunks[1] if chunks else None


def window_pace(arrivals_per_request: list[list], window: tuple[float, float],
                stall_factor: float = 2.0) -> tuple[float, float] | None:
    """(median seconds between two chunks, stall seconds per request) of a level over `window`: the median of
    every request's chunk intervals inside it (the steps' usual pace, which a single long step does not move),
    and, per request on average, what the intervals longer than `stall_factor` times that median took beyond
    it (a step held up once, e.g. by a copy beside the forward); None with no interval in the window."""
    intervals = []
    for arrivals in arrivals_per_request:
        inside = [t for t, _ in _in_window(arrivals, window)]
        intervals += [b - a for a, b in zip(inside, inside[1:])]
    if not intervals:
        return None
    median = statistics.median(intervals)
    stall = sum(i - median for i in intervals if i > stall_factor * median)
    return median, stall / len(arrivals_per_request)


def _in_window(arrivals: list, window: tuple[float, float]) -> list:
    """The (time, cumulative tokens) arrivals of one request that fall within `window`, bounds included."""
    return [(t, n) for t, n in arrivals if window[0] <= t <= window[1]]


def window_chunks(arrivals: list, window: tuple[float, float]) -> tuple[float, float] | None:
    """Seconds per streamed chunk and output tokens per chunk of one request over the chunks that arrived
    within `window` (a speculative server streams one chunk per verify step: the step's pace, and its accepted
    tokens, apart); None with fewer than two such chunks."""
    inside = _in_window(arrivals, window)
    if len(inside) < 2 or inside[-1][1] <= inside[0][1]:
        return None
    chunks = len(inside) - 1
    return (inside[-1][0] - inside[0][0]) / chunks, (inside[-1][1] - inside[0][1]) / chunks
