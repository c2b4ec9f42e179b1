"""engine.generation.stats: the generation latency histograms, buckets that add up across
replicas."""

from __future__ import annotations

import pytest

from engine.generation.stats import BUCKETS_S, LatencyHistogram


def test_buckets_are_cumulative_and_a_bound_is_inclusive() -> None:
    histogram = LatencyHistogram()
    for seconds in (0.001, 0.002, 0.3, 500.0):
        histogram.observe(seconds)
    buckets = dict(histogram.cumulative())
    assert buckets["0.001"] == 1  # le: at most the bound
    assert buckets["0.0025"] == 2
    assert buckets["0.25"] == 2
    assert buckets["0.5"] == 3
    assert buckets[str(BUCKETS_S[-1])] == 3
    assert buckets["+Inf"] == 4
    assert histogram.sum_s == pytest.approx(500.303)
