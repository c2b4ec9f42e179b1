"""Per model-version statistics: Triton's statistics shape and histograms for Prometheus.

Both are read from the same counters, so the statistics endpoint and /metrics always agree."""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field
from typing import Any

from batching.batcher import BatchTimings
from engine.generation.stats import GenerationStats

# Seconds: 100 µs to 30 s.
LATENCY_BUCKETS_S = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


@dataclass(slots=True)
class Histogram:
    """Cumulative-ready bucket counts plus sum and count."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        """(le, cumulative count) pairs ending with +Inf, as Prometheus wants them."""
        running, out = 0, []
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += count
            out.append(("+Inf" if bound == float("inf") else repr(bound), running))
        return out


@dataclass(slots=True)
class Duration:
    count: int = 0
    ns: int = 0

    def add(self, seconds: float, count: int = 1) -> None:
        self.count += count
        self.ns += int(seconds * 1e9)

    def as_dict(self) -> dict[str, int]:
        return {"count": self.count, "ns": self.ns}


@dataclass(slots=True)
class Stages:
    """Time in each compute stage: input (concatenate/pad/copy in), infer, output (split/copy
    out). All three are counted together, so their counts are always equal, as Triton's are."""

    input: Duration = field(default_factory=Duration)
    infer: Duration = field(default_factory=Duration)
    output: Duration = field(default_factory=Duration)

    def add(self, timings: BatchTimings, count: int = 1) -> None:
        """`count` runs of `timings` each (a batch's times count once per request in it)."""
        self.input.add(timings.input_s * count, count)
        self.infer.add(timings.infer_s * count, count)
        self.output.add(timings.output_s * count, count)

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {
            "compute_input": self.input.as_dict(),
            "compute_infer": self.infer.as_dict(),
            "compute_output": self.output.as_dict(),
        }


class ModelStats:
    """Counters of one model version; the batcher reports to it as its BatchObserver.

    As in Triton, `success` counts every answered request (cache hits included) and the compute
    stages count each request that ran once, with its batch's time; a cache hit has no compute.
    `queue` counts every success too: a request the batcher ran, a cache hit, and a request that
    joined an identical one in flight (engine/cache/inference.py counts those two).
    """

    def __init__(self) -> None:
        self.success = Duration()
        self.fail = Duration()
        self.queue = Duration()
        self.stages = Stages()  # per request
        self.cache_hit = Duration()
        self.cache_miss = Duration()
        self.inference_count = 0  # rows inferred
        self.execution_count = 0  # batches run
        self.last_inference_ms = 0
        self.batches: dict[int, Stages] = {}  # per batch, by its rows
        self.queue_wait = Histogram(LATENCY_BUCKETS_S)
        self.compute = Histogram(LATENCY_BUCKETS_S)  # a batch's model run (infer stage)
        self.batch_rows = Histogram(BATCH_BUCKETS)
        self.batch_requests = Histogram(BATCH_BUCKETS)
        self.generation = GenerationStats()
        """A generative version's tokens and latencies (its scheduler counts into them): kept
        with the rest across an on_demand eviction."""

    def request_dequeued(self, queue_s: float) -> None:
        self.queue.add(queue_s)
        self.queue_wait.observe(queue_s)

    def cache_hit_served(self, lookup_s: float) -> None:
        """A request answered from the result cache. Triton counts a hit in `queue` too (it
        never waited in one here), and perf_analyzer finds the model's version by the growth of
        that count: without it, a run of only hits fails ("failed to find the requested model
        version")."""
        self.cache_hit.add(lookup_s)
        self.request_dequeued(0.0)

    def batch_done(self, rows: int, requests: int, timings: BatchTimings, ok: bool) -> None:
        if not ok:
            return
        self.execution_count += 1
        self.inference_count += rows
        # Triton counts a batch's compute times once per request in it.
        self.stages.add(timings, requests)
        self.batches.setdefault(rows, Stages()).add(timings)
        self.compute.observe(timings.infer_s)
        self.batch_rows.observe(rows)
        self.batch_requests.observe(requests)
        self.last_inference_ms = int(time.time() * 1000)

    def request_done(self, seconds: float, ok: bool) -> None:
        (self.success if ok else self.fail).add(seconds)

    def triton(self, name: str, version: str) -> dict[str, Any]:
        """This version's entry of Triton's statistics response."""
        return {
            "name": name,
            "version": version,
            "last_inference": self.last_inference_ms,
            "inference_count": self.inference_count,
            "execution_count": self.execution_count,
            "inference_stats": {
                "success": self.success.as_dict(),
                "fail": self.fail.as_dict(),
                "queue": self.queue.as_dict(),
                **self.stages.as_dict(),
                "cache_hit": self.cache_hit.as_dict(),
                "cache_miss": self.cache_miss.as_dict(),
            },
            "batch_stats": [
                {"batch_size": size, **stages.as_dict()}
                for size, stages in sorted(self.batches.items())
            ],
        }
