"""Counters and latencies of one generative model's scheduler (the metrics read them)."""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

RECENT = 10_000
BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
             60.0, 120.0)  # fmt: skip
"""Histogram bucket bounds, seconds: from a tiny model's token gaps to a long completion."""


@dataclass
class LatencyHistogram:
    """Counts of observations at most each bound of BUCKETS_S (one more: past the last), and
    their sum: a Prometheus histogram, which adds up across replicas as quantiles cannot."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(BUCKETS_S) + 1))
    sum_s: float = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS_S, seconds)] += 1
        self.sum_s += seconds

    def cumulative(self) -> list[tuple[str, int]]:
        """(le, observations at most le) per bound, then +Inf: the exposition's buckets."""
        total, buckets = 0, []
        for bound, count in zip([*map(str, BUCKETS_S), "+Inf"], self.counts, strict=True):
            total += count
            buckets.append((bound, total))
        return buckets


@dataclass
class GenerationStats:
    """Generated tokens and steps since load; time to first token, inter-token gaps and
    end-to-end times as histograms since load and the latest few as values (the quantile
    gauges)."""

    generated_tokens: int = 0
    steps: int = 0
    time_to_first_token_s: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))
    inter_token_s: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))
    ttft: LatencyHistogram = field(default_factory=LatencyHistogram)
    itl: LatencyHistogram = field(default_factory=LatencyHistogram)
    e2e: LatencyHistogram = field(default_factory=LatencyHistogram)

    def first_token(self, seconds: float) -> None:
        self.time_to_first_token_s.append(seconds)
        self.ttft.observe(seconds)

    def next_token(self, seconds: float) -> None:
        self.inter_token_s.append(seconds)
        self.itl.observe(seconds)
