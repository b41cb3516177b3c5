"""Capacity beyond the fixed buffer (issue #25 item 4), first on the CPU: buffer policies compared on
the top-k workload model (src/hisparse_sglang/testing/workload.py, docs/workload.md).

A GPU pool of ``--pool-tokens`` rows per GPU holds the buffers of offloaded requests (every row holds
one token in each layer's KV tensor, so a buffer of D slots takes D rows in all layers). N requests,
prompts drawn from ``--contexts``, decode in lockstep; every request and layer gets the workload's
top-k at every step, and the buffers are exact LRU as the swap-in keeps them (the newest token in its
own reserved page, distinct misses replace the least recently used slots not hit; buffers start empty,
the first ``--warmup`` steps are not counted). Policies:

  (a) fixed      today: every request has ``device_buffer_size`` slots (default 2 x top_k);
  (b) small      every request has top_k + a few pages (``--small-extra-pages``), so more requests fit;
  (c) adaptive   per-request buffers between top_k + 1 page and 4 x top_k, resized by pages every
                 ``--interval`` steps from each request's observed miss rate: free pages go to the
                 requests missing most, and a page moves from the request missing least to the one
                 missing most while their miss rates differ by more than ``--margin``;
  (d) shared     one hot pool for all requests with a global LRU replacement (each request keeps only
                 its newest token's page to itself).

Each is run at the concurrency (a) holds and at the one (b) holds, (c) and (d) with the same pool.
Printed per profile: slots per request, hit rate, distinct misses per request, layer and step, bytes
moved per decode step for the model's layers and the time they take over PCIe at ``--pcie-gbps``.
Then a sweep of fixed buffer sizes (``--sweep``, in multiples of top_k): the miss rate of each and
the most requests the pool holds when, in addition, the swap-in copies of a decode step must fit in
each of ``--pcie-budgets-ms`` (the larger of the two limits binds).
One layer is simulated per request (the workload's layers are independent and alike); bytes are
scaled to ``--model-layers``. Deterministic (seeded); the default run takes a few minutes on 2 CPUs:

    PYTHONPATH=src python benchmarks/bench_capacity_policy.py [--profiles calibrated,mixed] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from hisparse_sglang.testing.workload import PROFILES, TopKWorkload, lru_misses, profile  # noqa: E402

AGE_CAP = 32767  # ops/reference.py: ages are capped here
MIXED = "mixed"  # each request draws calibrated, high-locality or low-locality
MIXED_OF = ("calibrated", "high-locality", "low-locality")


# ------------------------------------------------------------------------------------ requests
@dataclasses.dataclass
class Population:
    """The requests of one run: their top-k per step (one layer) and lengths."""

    rows: torch.Tensor  # int32 [N, T, K], positions (-1 padding)
    seq_lens: torch.Tensor  # int64 [N, T]
    profiles: list[str]

    def first(self, count: int, steps: int | None = None) -> "Population":
        return Population(self.rows[:count, :steps], self.seq_lens[:count, :steps], self.profiles[:count])


def make_population(name: str, count: int, contexts: list[int], steps: int, top_k: int, seed: int) -> Population:
    generator = torch.Generator().manual_seed(seed)
    prompt_lens = [contexts[int(i)] for i in torch.randint(0, len(contexts), (count,), generator=generator)]
    if name == MIXED:
        names = [MIXED_OF[int(i)] for i in torch.randint(0, len(MIXED_OF), (count,), generator=generator)]
    else:
        names = [name] * count
    workloads = {n: TopKWorkload(profile(n, top_k=top_k, seed=seed)) for n in set(names)}
    rows = torch.empty((count, steps, top_k), dtype=torch.int32)
    seq_lens = torch.empty((count, steps), dtype=torch.int64)
    for request, (prompt, workload_name) in enumerate(zip(prompt_lens, names)):
        lens = torch.arange(prompt + 1, prompt + 1 + steps, dtype=torch.int64)
        rows[request] = workloads[workload_name].stream(request, prompt, 0, lens).to(torch.int32)
        seq_lens[request] = lens
    return Population(rows, seq_lens, names)


# ------------------------------------------------------------------------------------ exact LRU, batched
class BatchedLru:
    """Exact LRU buffers of B streams at once, as the swap-in keeps them (entries distinct).

    Slots may be disabled (``enabled`` False): they hold nothing and are never victims (a buffer of
    fewer pages). Victims: the slots not hit with the largest age (steps since last use, capped),
    lower slot first among equals; the k-th miss in entry order goes to the k-th victim, victims
    ordered older-than-the-youngest-chosen first, each group by slot (ops/reference.py::swap_in).
    """

    def __init__(self, streams: int, slots: int, keys: int) -> None:
        self.slots = slots
        self.tokens = torch.full((streams, slots), -1, dtype=torch.int64)
        self.stamps = torch.zeros((streams, slots), dtype=torch.int64)
        self.enabled = torch.ones((streams, slots), dtype=torch.bool)
        self.token_slot = torch.full((streams, keys + 1), -1, dtype=torch.int64)
        self.slot_index = torch.arange(slots, dtype=torch.int64).reshape(1, -1)

    def step(self, entries: torch.Tensor, valid: torch.Tensor, clock: torch.Tensor) -> torch.Tensor:
        """Look ``entries`` (int64 ``[B, E]``, keys) up where ``valid``; ``clock`` int64 ``[B]`` is
        the LRU time of each stream. Returns the misses of each stream (int64 ``[B]``)."""
        slots = self.slots
        keys = torch.where(valid, entries, torch.zeros_like(entries))
        found = torch.where(valid, self.token_slot.gather(1, keys), torch.full_like(keys, -1))
        hit = found >= 0
        used = torch.zeros((entries.shape[0], slots + 1), dtype=torch.bool)
        used.scatter_(1, torch.where(hit, found, torch.full_like(found, slots)), True)
        used = used[:, :slots]
        now = clock.reshape(-1, 1)
        self.stamps = torch.where(used, now.expand_as(self.stamps), self.stamps)
        miss = valid & ~hit
        counts = miss.sum(dim=1)
        if not bool(counts.any()):
            return counts
        ages = (now - self.stamps).clamp(0, AGE_CAP)
        candidate = self.enabled & ~used
        # Largest age first, lower slot first among equal ages; non-candidates last.
        key = torch.where(candidate, ages * slots + (slots - 1 - self.slot_index), torch.full_like(ages, -1))
        order = torch.argsort(key, dim=1, descending=True)
        chosen = self.slot_index < counts.reshape(-1, 1)
        chosen_ages = ages.gather(1, order)
        youngest = torch.where(chosen, chosen_ages, torch.full_like(chosen_ages, AGE_CAP + 1)).min(dim=1).values
        final_key = torch.where(
            chosen,
            (chosen_ages == youngest.reshape(-1, 1)).to(torch.int64) * slots + order,
            torch.full_like(order, 2 * slots),
        )
        victims = order.gather(1, torch.argsort(final_key, dim=1))
        rank = (miss.cumsum(dim=1) - 1).clamp(min=0)
        victim_of_entry = victims.gather(1, rank)
        rows = torch.nonzero(miss, as_tuple=True)[0]
        victim_slots = victim_of_entry[miss]
        new_keys = entries[miss]
        old = self.tokens[rows, victim_slots]
        had = old >= 0
        self.token_slot[rows[had], old[had]] = -1
        self.tokens[rows, victim_slots] = new_keys
        self.stamps[rows, victim_slots] = clock[rows]
        self.token_slot[rows, new_keys] = victim_slots
        return counts

    # ---------------------------------------------------------------- resizing by pages
    def disable_page(self, stream: int, page: int, page_size: int) -> None:
        span = slice(page * page_size, (page + 1) * page_size)
        held = self.tokens[stream, span]
        self.token_slot[stream, held[held >= 0]] = -1
        self.tokens[stream, span] = -1
        self.stamps[stream, span] = 0
        self.enabled[stream, span] = False

    def enable_page(self, stream: int, page: int, page_size: int) -> None:
        self.enabled[stream, page * page_size : (page + 1) * page_size] = True


def lookup_masks(pop: Population, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    entries = pop.rows[:, step].to(torch.int64)
    newest = pop.seq_lens[:, step].reshape(-1, 1) - 1
    return entries, (entries >= 0) & (entries < newest)


@dataclasses.dataclass
class Outcome:
    policy: str
    requests: int
    slots_per_request: float
    lookups: int
    misses: int
    steps: int

    @property
    def hit_rate(self) -> float:
        return 1.0 - self.misses / self.lookups if self.lookups else 1.0

    def misses_per_request_step(self) -> float:
        return self.misses / (self.requests * self.steps)


def run_fixed(pop: Population, slots: int, warmup: int, name: str) -> Outcome:
    count, steps, _ = pop.rows.shape
    lru = BatchedLru(count, slots, int(pop.seq_lens.max()) + 1)
    lookups = misses = 0
    for step in range(steps):
        entries, valid = lookup_masks(pop, step)
        counts = lru.step(entries, valid, pop.seq_lens[:, step])
        if step >= warmup:
            lookups += int(valid.sum())
            misses += int(counts.sum())
    return Outcome(name, count, float(slots), lookups, misses, steps - warmup)


def run_adaptive(
    pop: Population, pool_slots: int, top_k: int, page: int, warmup: int, interval: int, margin: float, moves: int
) -> Outcome:
    """(c): buffers of [top_k + 1 page, 4 top_k] slots in pages, rebalanced every ``interval`` steps."""
    count, steps, _ = pop.rows.shape
    min_pages, max_pages = -(-top_k // page) + 1, 4 * top_k // page
    budget_pages = pool_slots // page
    if budget_pages < count * min_pages:
        raise ValueError(f"pool of {pool_slots} slots cannot give {count} requests {min_pages} pages each")
    share = min(max_pages, budget_pages // count)
    lru = BatchedLru(count, max_pages * page, int(pop.seq_lens.max()) + 1)
    pages = [share] * count
    for request in range(count):
        for p in range(share, max_pages):
            lru.disable_page(request, p, page)
    free = budget_pages - share * count
    window_lookups = torch.zeros(count, dtype=torch.int64)
    window_misses = torch.zeros(count, dtype=torch.int64)
    lookups = misses = 0
    slot_steps = 0
    for step in range(steps):
        entries, valid = lookup_masks(pop, step)
        counts = lru.step(entries, valid, pop.seq_lens[:, step])
        window_lookups += valid.sum(dim=1)
        window_misses += counts
        if step >= warmup:
            lookups += int(valid.sum())
            misses += int(counts.sum())
            slot_steps += sum(pages) * page
        if (step + 1) % interval:
            continue
        rate = (window_misses.double() / window_lookups.clamp(min=1).double()).tolist()
        window_lookups.zero_()
        window_misses.zero_()
        # Each request grows or shrinks by at most one page per resize: free pages first go to the
        # requests missing most; then the i-th most missing takes a page from the i-th least missing
        # (its least recently used page) while their miss rates differ by more than the margin.
        order = sorted(range(count), key=lambda r: (-rate[r], r))
        moved = set()
        for request in order:
            if free == 0 or rate[request] <= margin:
                break
            if pages[request] < max_pages:
                lru.enable_page(request, spare_page(lru, request, page), page)
                pages[request] += 1
                free -= 1
                moved.add(request)
        takers = [r for r in order if pages[r] < max_pages and r not in moved]
        givers = [r for r in reversed(order) if pages[r] > min_pages and r not in moved]
        for taker, giver in list(zip(takers, givers))[:moves]:
            if taker in moved or giver in moved or rate[taker] - rate[giver] <= margin:
                break
            lru.disable_page(giver, stalest_page(lru, giver, page), page)
            lru.enable_page(taker, spare_page(lru, taker, page), page)
            pages[giver] -= 1
            pages[taker] += 1
            moved.update((taker, giver))
    return Outcome(
        "(c) adaptive", count, slot_steps / max(1, (steps - warmup) * count), lookups, misses, steps - warmup
    )


def spare_page(lru: BatchedLru, stream: int, page: int) -> int:
    """A disabled page of a stream's buffer (the lowest)."""
    return int(torch.nonzero(~lru.enabled[stream].reshape(-1, page).all(dim=1))[0])


def stalest_page(lru: BatchedLru, stream: int, page: int) -> int:
    """The enabled page of a stream whose most recent use is oldest (what shrinking gives back)."""
    stamps = lru.stamps[stream].reshape(-1, page).max(dim=1).values
    enabled = lru.enabled[stream].reshape(-1, page).all(dim=1)
    return int(torch.argmin(torch.where(enabled, stamps, torch.full_like(stamps, 2**62))))


def run_shared(pop: Population, pool_slots: int, warmup: int) -> Outcome:
    """(d): one global LRU over every request's tokens, ``pool_slots`` slots (newest pages apart)."""
    count, steps, top_k = pop.rows.shape
    stride = int(pop.seq_lens.max()) + 1
    if pool_slots < count * top_k:
        raise ValueError(f"shared pool of {pool_slots} slots cannot hold {count} requests' top-k")
    lru = BatchedLru(1, pool_slots, count * stride)
    base = (torch.arange(count, dtype=torch.int64) * stride).reshape(-1, 1)
    lookups = misses = 0
    for step in range(steps):
        entries, valid = lookup_masks(pop, step)
        keys = (entries + base).reshape(1, -1)
        counts = lru.step(keys, valid.reshape(1, -1), torch.tensor([step], dtype=torch.int64))
        if step >= warmup:
            lookups += int(valid.sum())
            misses += int(counts.sum())
    return Outcome("(d) shared pool", count, pool_slots / count, lookups, misses, steps - warmup)


# ------------------------------------------------------------------------------------ study
def check_batched_lru(pop: Population, slots: int, streams: int = 3) -> None:
    """The batched LRU counts exactly what workload.lru_misses (tested against the swap-in) counts."""
    sub = pop.first(streams)
    lru = BatchedLru(streams, slots, int(sub.seq_lens.max()) + 1)
    batched = []
    for step in range(sub.rows.shape[1]):
        entries, valid = lookup_masks(sub, step)
        batched.append(lru.step(entries, valid, sub.seq_lens[:, step]))
    batched = torch.stack(batched, dim=1)
    for stream in range(streams):
        want = lru_misses(sub.rows[stream], sub.seq_lens[stream], slots).misses
        if not torch.equal(batched[stream], want):
            raise AssertionError(f"batched LRU differs from lru_misses on stream {stream} with {slots} slots")


def study(name: str, args) -> list[dict]:
    page, top_k, pool = args.page_size, args.top_k, args.pool_tokens
    fixed_slots = args.buffer
    small_slots = top_k + args.small_extra_pages * page
    # A buffer is D slots plus the reserved page of the newest token.
    fixed_count = pool // (fixed_slots + page)
    small_count = pool // (small_slots + page)
    started = time.monotonic()
    population = make_population(name, small_count, args.contexts, args.warmup + args.steps, top_k, args.seed)
    generated = time.monotonic() - started
    check_batched_lru(population.first(3, 48), fixed_slots)
    check_batched_lru(population.first(3, 48), small_slots)
    outcomes = []
    for count, fixed_name, slots in ((fixed_count, "(a) fixed", fixed_slots), (small_count, "(b) small", small_slots)):
        pop = population.first(count)
        shared_slots = pool - count * page  # every request keeps its newest token's page
        outcomes.append(run_fixed(pop, slots, args.warmup, fixed_name))
        outcomes.append(
            run_adaptive(pop, shared_slots, top_k, page, args.warmup, args.interval, args.margin, args.moves)
        )
        outcomes.append(run_shared(pop, shared_slots, args.warmup))
    rows = []
    for outcome in outcomes:
        per_step_bytes = outcome.misses / outcome.steps * args.model_layers * args.row_bytes
        rows.append(
            {
                "profile": name,
                "policy": outcome.policy,
                "requests": outcome.requests,
                "slots_per_request": round(outcome.slots_per_request, 1),
                "hit_rate": round(outcome.hit_rate, 4),
                "misses_per_request_layer_step": round(outcome.misses_per_request_step(), 1),
                "mib_per_step": round(per_step_bytes / 2**20, 1),
                "pcie_ms_per_step": round(per_step_bytes / (args.pcie_gbps * 1e9) * 1e3, 2),
                "pcie_ms_per_token": round(per_step_bytes / (args.pcie_gbps * 1e9) * 1e3 / outcome.requests, 3),
            }
        )
    sweep = sweep_fixed(population.first(args.sweep_requests), args)
    print(f"\n### profile {name} ({generated:.0f} s to generate, {time.monotonic() - started:.0f} s in all)\n")
    print(
        "| requests | policy | slots / request | hit rate | misses / request / layer / step | MiB / step "
        f"({args.model_layers} layers) | PCIe ms / step | PCIe ms / token |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['requests']} | {row['policy']} | {row['slots_per_request']:.0f} | {100 * row['hit_rate']:.1f} % | "
            f"{row['misses_per_request_layer_step']:.0f} | {row['mib_per_step']:.0f} | {row['pcie_ms_per_step']:.2f} | "
            f"{row['pcie_ms_per_token']:.3f} |",
            flush=True,
        )
    budgets = args.pcie_budgets_ms
    print(
        f"\nFixed buffers ({len(sweep) and sweep[0]['sampled_requests']} requests sampled): the most requests the pool "
        "holds, and how many when a decode step's copies must also fit in a PCIe budget\n"
    )
    print(
        "| slots / request | hit rate | PCIe ms / request / step | pool holds | "
        + " | ".join(f"within {b:g} ms" for b in budgets)
        + " |"
    )
    print("|---|---|---|---|" + "---|" * len(budgets))
    for point in sweep:
        print(
            f"| {point['slots']} | {100 * point['hit_rate']:.1f} % | {point['pcie_ms_per_request']:.3f} | "
            f"{point['pool_holds']} | " + " | ".join(str(point["within"][str(b)]) for b in budgets) + " |"
        )
    for row in rows:
        row["sweep"] = sweep
    return rows


def sweep_fixed(pop: Population, args) -> list[dict]:
    """Miss rate of fixed buffers of ``args.sweep`` x top_k slots (rounded to pages) on ``pop``, and
    the requests a pool of ``args.pool_tokens`` rows holds under each PCIe budget."""
    page, top_k = args.page_size, args.top_k
    points = []
    for multiple in args.sweep:
        slots = max(top_k, -(-int(round(multiple * top_k)) // page) * page)
        outcome = run_fixed(pop, slots, args.warmup, f"fixed {slots}")
        per_request_ms = (
            outcome.misses_per_request_step() * args.model_layers * args.row_bytes / (args.pcie_gbps * 1e9) * 1e3
        )
        pool_holds = args.pool_tokens // (slots + page)
        within = {
            str(b): min(pool_holds, int(b / per_request_ms) if per_request_ms else pool_holds)
            for b in args.pcie_budgets_ms
        }
        points.append(
            {
                "slots": slots,
                "hit_rate": round(outcome.hit_rate, 4),
                "sampled_requests": outcome.requests,
                "pcie_ms_per_request": round(per_request_ms, 4),
                "pool_holds": pool_holds,
                "within": within,
            }
        )
    return points


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[1:]),
    )
    parser.add_argument(
        "--profiles",
        default=",".join(list(PROFILES) + [MIXED]),
        help="workload profiles, and 'mixed' (default %(default)s)",
    )
    parser.add_argument(
        "--pool-tokens", type=int, default=131072, help="GPU rows for buffers, per GPU (default %(default)s)"
    )
    parser.add_argument(
        "--contexts",
        default="8192,16384,32768,65536",
        help="prompt lengths the requests draw from, uniformly (default %(default)s)",
    )
    parser.add_argument("--top-k", type=int, default=2048)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--buffer", type=int, default=4096, help="(a): device_buffer_size (default %(default)s)")
    parser.add_argument(
        "--small-extra-pages", type=int, default=4, help="(b): top_k + this many pages (default %(default)s)"
    )
    parser.add_argument("--interval", type=int, default=8, help="(c): steps between resizes (default %(default)s)")
    parser.add_argument(
        "--margin", type=float, default=0.02, help="(c): miss-rate gap that moves a page (default %(default)s)"
    )
    parser.add_argument("--moves", type=int, default=32, help="(c): most pages moved per resize (default %(default)s)")
    parser.add_argument("--steps", type=int, default=96, help="decode steps counted (default %(default)s)")
    parser.add_argument("--warmup", type=int, default=48, help="decode steps before counting (default %(default)s)")
    parser.add_argument(
        "--model-layers", type=int, default=61, help="layers the bytes are scaled to (DeepSeek-V3.2: 61)"
    )
    parser.add_argument(
        "--row-bytes", type=int, default=1152, help="bytes per token and layer (bf16 MLA: 1152, fp8: 656)"
    )
    parser.add_argument(
        "--pcie-gbps",
        type=float,
        default=50.4,
        help="host -> device gather bandwidth, GB/s (H100, 1152-B rows, docs/kernels.md)",
    )
    parser.add_argument(
        "--sweep",
        default="1.03125,1.125,1.5,2,3,4",
        help="fixed buffer sizes to sweep, in multiples of top_k (default %(default)s)",
    )
    parser.add_argument(
        "--sweep-requests", type=int, default=16, help="requests sampled by the sweep (default %(default)s)"
    )
    parser.add_argument(
        "--pcie-budgets-ms",
        default="10,20,40",
        help="PCIe time per decode step the copies must fit in (default %(default)s)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write every row here")
    args = parser.parse_args(argv)
    args.contexts = [int(x) for x in args.contexts.split(",") if x.strip()]
    args.sweep = [float(x) for x in args.sweep.split(",") if x.strip()]
    args.pcie_budgets_ms = [float(x) for x in args.pcie_budgets_ms.split(",") if x.strip()]
    names = [x.strip() for x in args.profiles.split(",") if x.strip()]
    unknown = [n for n in names if n not in PROFILES and n != MIXED]
    if unknown:
        parser.error(f"unknown profile(s) {unknown}; choose from {', '.join(list(PROFILES) + [MIXED])}")
    if args.buffer < args.top_k or args.buffer % args.page_size:
        parser.error(f"--buffer ({args.buffer}) must be >= --top-k ({args.top_k}) and a multiple of --page-size")
    torch.set_num_threads(1)  # small tensors: one thread beats two contending ones
    print(
        f"pool {args.pool_tokens} rows per GPU, top_k {args.top_k}, page {args.page_size}, "
        f"prompts from {args.contexts}, {args.warmup} + {args.steps} steps, "
        f"bytes for {args.model_layers} layers x {args.row_bytes} B, PCIe {args.pcie_gbps} GB/s, seed {args.seed}"
    )
    every = []
    for name in names:
        every += study(name, args)
    if args.json:
        args.json.write_text(
            json.dumps(
                {"args": {k: v for k, v in vars(args).items() if k != "json"}, "rows": every}, indent=1, default=str
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
