"""The generation latency histograms: buckets that add up across replicas."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from engine.generation.metrics import GenerationCollector
from engine.generation.stats import BUCKETS_S, GenerationStats, LatencyHistogram


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


def test_the_collector_exports_the_three_histograms_per_model() -> None:
    stats = GenerationStats()
    stats.first_token(0.02)
    stats.next_token(0.004)
    stats.next_token(0.006)
    stats.e2e.observe(0.03)
    scheduler = SimpleNamespace(
        running=[], waiting=[], prefix=None, stats=stats,
        cache=SimpleNamespace(slot_bytes=0, budget_bytes=1),
    )  # fmt: skip
    model = SimpleNamespace(
        name="llama", version="1", generator=SimpleNamespace(scheduler=scheduler)
    )
    registry = CollectorRegistry()
    registry.register(GenerationCollector(lambda: {"models": [model]}))
    text = generate_latest(registry).decode()
    labels = 'model="llama",version="1"'
    assert f'sluice_generation_ttft_seconds_bucket{{le="0.025",{labels}}} 1.0' in text
    assert f'sluice_generation_itl_seconds_bucket{{le="0.005",{labels}}} 1.0' in text
    assert f'sluice_generation_itl_seconds_bucket{{le="0.01",{labels}}} 2.0' in text
    assert f"sluice_generation_itl_seconds_count{{{labels}}} 2.0" in text
    assert f"sluice_generation_e2e_seconds_sum{{{labels}}} 0.03" in text
