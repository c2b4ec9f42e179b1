"""The memory budget's books: what each resident model version measured, which models are in
use, and which one goes first when room is needed.

The rule is least recently used, by model, among the idle ones: a model no request holds (none
queued, running or waiting in the result cache's lookup), not pinned, not a step of a resident
pipeline. Least recently used by bytes rather than GreedyDual-Size: in simulation
(loadtests/benchmarks/eviction_sim.py: 200 models of 0.3-30 MB, a budget of a quarter of them, Zipf
s=1.1) GreedyDual-Size with a unit load cost finds 81% of requests resident against LRU's 72%, but
loads 18% more bytes: it keeps the small models and turns the large ones over (the largest quarter
of the models finds 60% of its requests resident, against 71% under LRU). LRU treats every model
alike, is predictable from the traffic alone, and needs no model of what a load costs
(GreedyDual-Size's cost should be the cold start, a fixed part plus one that grows with size; with
a cost proportional to size it reduces to LRU). Measuring cold starts per model would let a
size-aware rule weigh them; the benchmark is there to show whether it pays."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from engine.stats import Histogram

# Seconds: a small model's session opens in milliseconds, a large one's in tens of seconds.
COLD_START_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


@dataclass(slots=True)
class Cost:
    """What one loaded version measured: host bytes, and bytes on each GPU it used."""

    host_bytes: int = 0
    gpu_bytes: dict[int, int] = field(default_factory=dict)

    def __sub__(self, before: Cost) -> Cost:
        """The growth from `before` to this reading (never below 0: memory another part of the
        process freed meanwhile is not a negative cost)."""
        gpu = {d: max(0, b - before.gpu_bytes.get(d, 0)) for d, b in self.gpu_bytes.items()}
        return Cost(max(0, self.host_bytes - before.host_bytes), gpu)

    def __add__(self, other: Cost) -> Cost:
        gpu = dict(self.gpu_bytes)
        for device, size in other.gpu_bytes.items():
            gpu[device] = gpu.get(device, 0) + size
        return Cost(self.host_bytes + other.host_bytes, gpu)


@dataclass(slots=True)
class Usage:
    """One model's counters (kept across its evictions, so they only grow)."""

    in_use: int = 0
    """Requests holding the model now (admitted to it, queued, running)."""
    waiting: int = 0
    """Requests waiting for its load."""
    last_used: float = 0.0
    loads: int = 0
    load_failures: int = 0
    evictions: dict[str, int] = field(default_factory=dict)
    """Evictions by reason: `budget` (room for another load), `idle` (idle_unload_s)."""


class MemoryBudget:
    """Measured bytes of the resident versions against the host and per-GPU budgets."""

    def __init__(
        self, host_bytes: int | None, gpu_bytes: int | None, max_models: int | None = None
    ) -> None:
        self.host_limit = host_bytes
        self.gpu_limit = gpu_bytes
        self.max_models = max_models
        self.costs: dict[tuple[str, str], Cost] = {}
        self.usage: dict[str, Usage] = {}
        self.cold_start = Histogram(COLD_START_BUCKETS_S)
        """Seconds from a request finding its model not resident to the model serving."""
        self.measured: dict[str, Cost] = {}
        """The last measured cost of each model (all its versions): the estimate of its next
        load, so room is made before the load rather than after it."""

    def of(self, name: str) -> Usage:
        usage = self.usage.get(name)
        if usage is None:
            usage = self.usage[name] = Usage()
        return usage

    def touch(self, name: str) -> None:
        self.of(name).last_used = time.monotonic()

    def resident_bytes(self, name: str, version: str) -> int:
        cost = self.costs.get((name, version))
        return 0 if cost is None else cost.host_bytes

    def host_used(self) -> int:
        return sum(cost.host_bytes for cost in self.costs.values())

    def gpu_used(self) -> dict[int, int]:
        used: dict[int, int] = {}
        for cost in self.costs.values():
            for device, size in cost.gpu_bytes.items():
                used[device] = used.get(device, 0) + size
        return used

    def record(self, name: str, version: str, cost: Cost) -> None:
        self.costs[(name, version)] = cost

    def forget(self, name: str) -> None:
        """The model's versions left memory: their bytes leave the books."""
        for key in [key for key in self.costs if key[0] == name]:
            del self.costs[key]

    def model_cost(self, name: str) -> Cost:
        total = Cost()
        for (model, _), cost in self.costs.items():
            if model == name:
                total += cost
        return total

    def excess(self, need: Cost, adding: str | None = None) -> str | None:
        """Why resident versions plus `need` (of model `adding`, resident or about to be) pass
        a budget ("host: ... bytes"), or None."""
        if self.max_models is not None:
            models = {name for name, _ in self.costs} | ({adding} if adding else set())
            if len(models) > self.max_models:
                return f"{len(models)} models > {self.max_models} (model_memory.max_models)"
        if self.host_limit is not None and self.host_used() + need.host_bytes > self.host_limit:
            return (
                f"host: {self.host_used()} bytes resident + {need.host_bytes} needed > "
                f"{self.host_limit} (model_memory.host_bytes)"
            )
        if self.gpu_limit is not None:
            used = self.gpu_used()
            for device, size in need.gpu_bytes.items():
                if used.get(device, 0) + size > self.gpu_limit:
                    return (
                        f"GPU {device}: {used.get(device, 0)} bytes resident + {size} needed > "
                        f"{self.gpu_limit} (model_memory.gpu_bytes)"
                    )
        return None

    def too_large(self, need: Cost) -> str | None:
        """Why `need` cannot fit even with nothing else resident, or None."""
        if self.host_limit is not None and need.host_bytes > self.host_limit:
            return f"{need.host_bytes} bytes; model_memory.host_bytes is {self.host_limit}"
        for device, size in need.gpu_bytes.items():
            if self.gpu_limit is not None and size > self.gpu_limit:
                return f"{size} bytes on GPU {device}; model_memory.gpu_bytes is {self.gpu_limit}"
        return None

    def victim(self, candidates: Iterable[str]) -> str | None:
        """The least recently used of `candidates` (the caller passes only idle ones)."""
        return min(candidates, key=lambda name: self.of(name).last_used, default=None)
