"""Per model-version statistics: Triton's statistics shape and histograms for Prometheus.

Both are read from the same counters, so the statistics endpoint and /metrics always agree."""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field
from typing import Any

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


class ModelStats:
    """Counters of one model version; the batcher reports to it as its BatchObserver."""

    def __init__(self) -> None:
        self.success = Duration()
        self.fail = Duration()
        self.queue = Duration()
        self.compute_infer = Duration()
        self.cache_hit = Duration()
        self.cache_miss = Duration()
        self.inference_count = 0  # rows inferred
        self.execution_count = 0  # batches run
        self.last_inference_ms = 0
        self.batches: dict[int, Duration] = {}
        self.queue_wait = Histogram(LATENCY_BUCKETS_S)
        self.compute = Histogram(LATENCY_BUCKETS_S)
        self.batch_rows = Histogram(BATCH_BUCKETS)
        self.batch_requests = Histogram(BATCH_BUCKETS)

    def request_dequeued(self, queue_s: float) -> None:
        self.queue.add(queue_s)
        self.queue_wait.observe(queue_s)

    def batch_done(self, rows: int, requests: int, compute_s: float, ok: bool) -> None:
        if not ok:
            return
        self.execution_count += 1
        self.inference_count += rows
        # Triton counts a batch's compute time once per request in it.
        self.compute_infer.add(compute_s * requests, requests)
        self.batches.setdefault(rows, Duration()).add(compute_s)
        self.compute.observe(compute_s)
        self.batch_rows.observe(rows)
        self.batch_requests.observe(requests)
        self.last_inference_ms = int(time.time() * 1000)

    def request_done(self, seconds: float, ok: bool) -> None:
        (self.success if ok else self.fail).add(seconds)

    def triton(self, name: str, version: str) -> dict[str, Any]:
        """This version's entry of Triton's statistics response."""
        zero = Duration().as_dict()
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
                "compute_input": zero,
                "compute_infer": self.compute_infer.as_dict(),
                "compute_output": zero,
                "cache_hit": self.cache_hit.as_dict(),
                "cache_miss": self.cache_miss.as_dict(),
            },
            "batch_stats": [
                {
                    "batch_size": size,
                    "compute_input": {"count": d.count, "ns": 0},
                    "compute_infer": d.as_dict(),
                    "compute_output": {"count": d.count, "ns": 0},
                }
                for size, d in sorted(self.batches.items())
            ],
        }
