"""The end-to-end correctness judge (benchmarks/e2e/judge.py) has power: it accepts an arm that computes
what the baseline computes, up to the serving stack's own noise, and rejects broken arms.

The decodes come from a synthetic serving stack: a deterministic "model" (the logits of a position are
seeded by the prompt, the position and the previous token, so outputs depend on the prefix) plus
independent noise on every decode (a non-deterministic stack, as SGLang 0.5.17's DSA stack on an H100
is: its repeats diverge within a few tokens). Greedy decoding records what /generate returns: the
chosen token, its logprob and the top-5 logprobs of every position."""

from __future__ import annotations

import hashlib
import math
import pathlib
import random
import sys

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "e2e"))

import judge  # noqa: E402
import stats  # noqa: E402

VOCAB = 512
TOKENS = 48
PROMPTS = [f"len{n}-seed{s}" for n in (8192, 16384, 32768) for s in range(4)] + ["pair16384-A", "pair16384-B"]


def stable_seed(*key) -> int:
    """A seed from `key` that does not change between processes (str hashes do)."""
    return int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=7).digest(), "little")


def logits_of(prompt: str, position: int, previous: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(stable_seed(prompt, position, previous))
    return torch.randn(VOCAB, generator=generator, dtype=torch.float64)


def decode(prompt: str, noise: float, seed: int, perturb=None, tokens: int = TOKENS) -> dict:
    """One greedy decode of the synthetic stack: noise ~ N(0, noise) on every logit; `perturb(prompt,
    position, logits)` changes what a broken arm computes."""
    rng = torch.Generator().manual_seed(seed)
    ids, lps, tops = [], [], []
    previous = -1
    for position in range(tokens):
        logits = logits_of(prompt, position, previous)
        if perturb is not None:
            logits = perturb(prompt, position, logits)
        logits = logits + noise * torch.randn(VOCAB, generator=rng, dtype=torch.float64)
        logprobs = torch.log_softmax(logits, dim=0)
        values, indices = logprobs.topk(5)
        token = int(indices[0])
        ids.append(token)
        lps.append(float(values[0]))
        tops.append([[int(t), float(v)] for t, v in zip(indices, values)])
        previous = token
    return {"output_ids": ids, "logprobs": lps, "top": tops}


def server(name: str, noise: float = 0.07, decodes: int = 3, perturb=None, prompts=PROMPTS) -> dict:
    """A correctness result as the harness stores it: every prompt decoded `decodes` times."""
    seeds = [stable_seed(name, pid, k) for pid in prompts for k in range(decodes)]
    runs = {pid: [decode(pid, noise, seeds[i * decodes + k], perturb) for k in range(decodes)]
            for i, pid in enumerate(prompts)}
    return {"prompts": [{"id": pid, "nan_logprobs": 0} | runs[pid][0] for pid in prompts],
            "redecodes": [{"id": pid, "decode": k} | runs[pid][k] for pid in prompts for k in range(1, decodes)],
            "context_sensitive": True}


@pytest.fixture(scope="module")
def baseline() -> dict:
    return server("a")


def test_an_arm_that_computes_what_the_baseline_computes_is_accepted(baseline):
    for name in ("c", "d", "pd-c"):
        verdict = judge.judge_correctness(server(name), baseline, same_weights=True)
        assert verdict["ok"], verdict
        assert verdict["rule"] == "noise"
        # the noise makes the decodes diverge early, as on the GPU
        assert verdict["base_own"]["first_median"] < TOKENS / 2


def test_false_alarms_are_rare():
    """Twenty independent good arms against twenty baselines: at most one rejected."""
    rejected = sum(not judge.judge_correctness(server(f"c{i}"), server(f"a{i}"), True)["ok"] for i in range(20))
    assert rejected <= 1


def shuffled(corr: dict, seed: int = 5) -> dict:
    """Every decode's positions (token, logprob, top-5 together) in another order."""
    rng = random.Random(seed)

    def shuffle(d: dict) -> dict:
        order = list(range(len(d["output_ids"])))
        rng.shuffle(order)
        return d | {key: [d[key][i] for i in order] for key in ("output_ids", "logprobs", "top")}

    return corr | {"prompts": [shuffle(p) for p in corr["prompts"]], "redecodes": [shuffle(d) for d in corr["redecodes"]]}


def shifted(corr: dict, by: float) -> dict:
    def shift(d: dict) -> dict:
        return d | {"logprobs": [x + by for x in d["logprobs"]],
                    "top": [[[t, v + by] for t, v in top] for top in d["top"]]}

    return corr | {"prompts": [shift(p) for p in corr["prompts"]], "redecodes": [shift(d) for d in corr["redecodes"]]}


def other_prompts(corr: dict) -> dict:
    """Each prompt answered with the next prompt's decodes."""
    ids = [p["id"] for p in corr["prompts"]]
    rename = dict(zip(ids, ids[1:] + ids[:1]))
    return corr | {"prompts": [p | {"id": rename[p["id"]]} for p in corr["prompts"]],
                   "redecodes": [d | {"id": rename[d["id"]]} for d in corr["redecodes"]]}


def wrong_rows(share: float, magnitude: float):
    """A broken arm: at a `share` of positions the logits move as if some KV rows attention read were
    wrong (a fixed perturbation of that position, the same on every decode)."""
    def perturb(prompt: str, position: int, logits: torch.Tensor) -> torch.Tensor:
        rng = random.Random(stable_seed(prompt, position, "wrong"))
        if position == 0 or rng.random() >= share:  # position 0 comes from the prefill, before any swap-in
            return logits
        generator = torch.Generator().manual_seed(rng.getrandbits(62))
        return logits + magnitude * torch.randn(VOCAB, generator=generator, dtype=torch.float64)

    return perturb


@pytest.mark.parametrize("broken", ["shuffled tokens", "logprobs shifted by -8", "tokens wrong, logprobs -1 to -9",
                                    "another prompt's output", "wrong rows at 30 % of the steps",
                                    "wrong rows at every step, small"])
def test_broken_arms_are_rejected(baseline, broken):
    good = server("c")
    arm = {
        "shuffled tokens": lambda: shuffled(good),
        "logprobs shifted by -8": lambda: shifted(good, -8.0),
        "tokens wrong, logprobs -1 to -9": lambda: shifted(other_prompts(good), -8.0),
        "another prompt's output": lambda: other_prompts(good),
        "wrong rows at 30 % of the steps": lambda: server("c", perturb=wrong_rows(0.3, 1.0)),
        "wrong rows at every step, small": lambda: server("c", perturb=wrong_rows(1.0, 0.3)),
    }[broken]()
    verdict = judge.judge_correctness(arm, baseline, same_weights=True)
    assert not verdict["ok"], f"{broken}: accepted: {verdict}"


def test_a_divergence_at_the_first_token_is_judged_there(baseline):
    """The old rule compared positions before the first differing token only, so an output wrong from
    its first token scored 0.0: now the distributions at that token are compared too."""
    arm = other_prompts(baseline)
    pairs = judge.cross_pairs(judge.decodes_by_prompt(arm), judge.decodes_by_prompt(baseline))
    firsts = [p for ps in pairs.values() for p in ps]
    assert all(p["first"] == 0 and p["compared"] == 1 and p["score"] > 0.0 for p in firsts), firsts[:3]
    assert sorted(p["score"] for p in firsts)[len(firsts) // 2] > 0.5


def test_a_deterministic_stack_demands_identical_outputs():
    exact = server("a", noise=0.0)
    verdict = judge.judge_correctness(server("c", noise=0.0), exact, True)
    assert verdict["ok"] and verdict["rule"] == "identical"
    flipped = server("c", noise=0.0)
    first = flipped["prompts"][3]
    first["output_ids"] = first["output_ids"][:10] + [(first["output_ids"][10] + 1) % VOCAB] + first["output_ids"][11:]
    verdict = judge.judge_correctness(flipped, exact, True)
    assert not verdict["ok"] and any("exactly" in f for f in verdict["failures"])


def test_an_arm_choosing_other_than_its_most_likely_token_is_rejected(baseline):
    arm = server("c")
    d = arm["prompts"][0]
    d["output_ids"][5] = d["top"][5][3][0]
    verdict = judge.judge_correctness(arm, baseline, True)
    assert not verdict["ok"] and any("most likely" in f for f in verdict["failures"])


def test_a_run_too_small_to_fail_is_rejected(baseline):
    few = PROMPTS[:6]
    small = {"prompts": [p for p in baseline["prompts"] if p["id"] in few],
             "redecodes": [d for d in baseline["redecodes"] if d["id"] in few], "context_sensitive": True}
    verdict = judge.judge_correctness(server("c", prompts=few), small, True)
    assert not verdict["ok"] and any("to be able to fail" in f for f in verdict["failures"])
    single = server("c", decodes=1)
    verdict = judge.judge_correctness(single, baseline, True)
    assert not verdict["ok"] and any("decoded at least" in f for f in verdict["failures"])


def test_other_preconditions(baseline):
    good = server("c")
    assert not judge.judge_correctness(good, baseline, same_weights=False)["ok"]
    assert not judge.judge_correctness(good, baseline | {"context_sensitive": False}, True)["ok"]
    missing = good | {"prompts": good["prompts"][1:]}
    verdict = judge.judge_correctness(missing, baseline, True)
    assert not verdict["ok"] and any("without a result" in f for f in verdict["failures"])


def test_top_distance():
    a = [[1, -1.0], [2, -2.0], [3, -3.0]]
    assert stats.top_distance(a, a) == 0.0
    assert stats.top_distance(a, [[1, -1.5], [2, -2.0], [3, -3.0]]) == 0.5
    # token 4 is y's second, x ranks it below its last (-3.0): at least 1.0 apart
    assert stats.top_distance(a, [[1, -1.0], [4, -2.0], [2, -2.0]]) == pytest.approx(1.0)
    assert stats.top_distance(None, a) is None


def test_signed_rank_test():
    assert stats.signed_rank_greater([]) == 1.0
    assert stats.signed_rank_greater([1.0] * 10) == pytest.approx(2**-10)
    assert stats.signed_rank_greater([-1.0] * 10) == 1.0
    # symmetric differences: p about one half
    assert 0.4 < stats.signed_rank_greater([1, -1, 2, -2, 3, -3, 4, -4]) < 0.7
    # against the normal approximation for a larger sample
    diffs = [i * (1 if i % 3 else -1) for i in range(1, 31)]
    n = len(diffs)
    w = sum(i for i, d in zip(range(1, n + 1), sorted(diffs, key=abs)) if d > 0)
    z = (w - n * (n + 1) / 4 - 0.5) / math.sqrt(n * (n + 1) * (2 * n + 1) / 24)
    assert stats.signed_rank_greater(diffs) == pytest.approx(0.5 * math.erfc(z / math.sqrt(2)), abs=0.01)


def power_table() -> str:
    """Which perturbed arms the judge rejects (docs/gpu-e2e.md): `python tests/test_e2e_judge.py`."""
    base = server("a")
    magnitudes = (0.05, 0.1, 0.2, 0.5)
    lines = ["| share of decode steps | " + " | ".join(f"N(0, {m})" for m in magnitudes) + " |",
             "|---|" + "---|" * len(magnitudes)]
    for share in (0.05, 0.1, 0.3, 1.0):
        cells = []
        for magnitude in magnitudes:
            verdict = judge.judge_correctness(server("c", perturb=wrong_rows(share, magnitude)), base, True)
            cells.append("accepted" if verdict["ok"] else "✗")
        lines.append(f"| {share:.0%} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(power_table())
