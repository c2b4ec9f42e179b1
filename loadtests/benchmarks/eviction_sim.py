"""Offline simulation of eviction rules on a request trace: which share of requests find their
model resident under a byte budget. The yardstick of the many-models benchmark (issue 36): the
server's hit ratio against LRU by bytes (its rule), LRU by count (Ray Serve's multiplexing: at
most N models, N = the budget over the mean model size) and GreedyDual-Size (size-aware).

    python -m loadtests.benchmarks.eviction_sim [--models 200] [--requests 50000] [--zipf 1.1]

A simulation, not a measurement of this machine: it takes a second and prints a table.
"""

from __future__ import annotations

import argparse
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

RULES = ("lru_bytes", "lru_count", "gds")


@dataclass(frozen=True)
class Outcome:
    """A rule's result on a trace."""

    hits: int
    misses: int
    evictions: int
    loaded_bytes: int
    """Bytes loaded by the misses: what the loads cost, roughly, in time."""

    @property
    def hit_ratio(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


def simulate(trace: Sequence[str], sizes: Mapping[str, int], budget: int, rule: str) -> Outcome:
    """Replay `trace` (model names) with models of `sizes` bytes under `budget` bytes. A model
    larger than the budget is a miss and never resident (the server refuses it)."""
    if rule not in RULES:
        raise ValueError(f"unknown rule {rule!r}; rules: {', '.join(RULES)}")
    slots = max(1, budget // max(1, round(sum(sizes.values()) / len(sizes)))) if sizes else 1
    resident: OrderedDict[str, float] = OrderedDict()  # name -> GDS priority; order is recency
    used = hits = misses = evictions = loaded = 0
    inflation = 0.0  # GreedyDual's L: the priority of the last model evicted
    for name in trace:
        size = sizes[name]
        if name in resident:
            hits += 1
            resident.move_to_end(name)
            resident[name] = inflation + 1 / size  # cost 1 a load: small models are kept
            continue
        misses += 1
        if size > budget:
            continue
        loaded += size
        while resident and (
            used + size > budget or (rule == "lru_count" and len(resident) >= slots)
        ):
            if rule == "gds":
                victim = min(resident, key=resident.__getitem__)
                inflation = resident[victim]
            else:
                victim = next(iter(resident))
            del resident[victim]
            used -= sizes[victim]
            evictions += 1
        resident[name] = inflation + 1 / size
        used += size
    return Outcome(hits, misses, evictions, loaded)


def zipf_trace(names: Sequence[str], requests: int, s: float, seed: int = 0) -> list[str]:
    """`requests` names drawn with probability ~ 1/rank^s, ranks shuffled over `names`."""
    rng = np.random.default_rng(seed)
    weights = 1 / np.arange(1, len(names) + 1) ** s
    order = rng.permutation(len(names))
    picks = rng.choice(len(names), size=requests, p=weights / weights.sum())
    return [names[order[pick]] for pick in picks]


def mixed_sizes(count: int, low: int, high: int, seed: int = 0) -> dict[str, int]:
    """`count` model sizes drawn log-uniformly between `low` and `high` bytes."""
    rng = np.random.default_rng(seed)
    drawn = np.exp(rng.uniform(np.log(low), np.log(high), count))
    return {f"m{i:03d}": int(size) for i, size in enumerate(drawn)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=int, default=200)
    parser.add_argument("--requests", type=int, default=50_000)
    parser.add_argument("--zipf", type=float, default=1.1)
    parser.add_argument("--budget-share", type=float, default=0.25)
    args = parser.parse_args()
    sizes = mixed_sizes(args.models, 300_000, 30_000_000)
    budget = int(sum(sizes.values()) * args.budget_share)
    trace = zipf_trace(sorted(sizes), args.requests, args.zipf)
    print(f"{args.models} models, {args.requests} requests, Zipf s={args.zipf}, budget {budget} B")
    print("| rule | hit ratio | evictions | GB loaded |\n|---|---|---|---|")
    for rule in RULES:
        outcome = simulate(trace, sizes, budget, rule)
        gigabytes = outcome.loaded_bytes / 1e9
        print(f"| {rule} | {outcome.hit_ratio:.3f} | {outcome.evictions} | {gigabytes:.1f} |")


if __name__ == "__main__":
    main()
