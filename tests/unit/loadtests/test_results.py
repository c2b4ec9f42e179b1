from __future__ import annotations

import json
import math

import pytest

from loadtests.results import Histogram, LoadTestResult, ServerMetrics
from tests.unit.loadtests.samples import result, server_metrics, step


def test_histogram_buckets_quantiles_and_bounds() -> None:
    histogram = Histogram(bounds=[1.0, 2.0, 4.0], counts=[10.0, 30.0, 40.0, 40.0], sum=70.0)
    assert histogram.count == 40.0
    assert histogram.mean == 70.0 / 40.0
    assert histogram.per_bucket() == [10.0, 20.0, 10.0, 0.0]
    assert histogram.quantile(0.25) == 1.0  # rank 10: the top of the first bucket
    assert histogram.quantile(0.5) == pytest.approx(1.5)  # rank 20: half way through (1, 2]
    assert histogram.upper_bound(0.5) == 2.0
    assert histogram.upper_bound(0.9) == 4.0


def test_histogram_past_the_last_bound_and_empty() -> None:
    histogram = Histogram(bounds=[1.0], counts=[1.0, 10.0], sum=50.0)
    assert histogram.quantile(0.99) == 1.0
    assert histogram.upper_bound(0.99) == math.inf
    empty = Histogram(bounds=[1.0], counts=[0.0, 0.0], sum=0.0)
    assert empty.mean is None
    assert empty.quantile(0.5) is None
    assert empty.upper_bound(0.5) is None


def test_cache_hit_ratio() -> None:
    assert ServerMetrics(cache_hits=1.0, cache_misses=3.0).cache_hit_ratio == 0.25
    assert ServerMetrics(cache_hits=0.0, cache_misses=0.0).cache_hit_ratio is None
    assert ServerMetrics(cache_hits=None, cache_misses=3.0).cache_hit_ratio is None


def test_unexpected_errors_leave_out_backpressure() -> None:
    s = step(
        0,
        4,
        100.0,
        5.0,
        failures=30,
        errors={"429": 10, "UNAVAILABLE": 5, "500": 3, "connection_error": 2},
        exceptions=1,
    )
    assert s.unexpected_errors == 3 + 2 + 1
    assert s.error_fraction == 30 / 1000


def test_to_dict_round_trips_through_json() -> None:
    original = result(
        [step(0, 1, 100.0, 5.0, server=server_metrics()), step(1, 2, 180.0, None)], slo_p99_ms=10.0
    )
    original.server = server_metrics()
    original.best_step = 0
    original.verdict = "pass"
    text = json.dumps(original.to_dict(), allow_nan=False)
    data = json.loads(text)
    assert data["summary"] == {
        "verdict": "pass",
        "best_users": 1,
        "best_ok_rps": 100.0,
        "best_p99_ms": 5.0,
        "requests": 2000,
        "failures": 0,
        "unexpected_errors": 0,
    }
    assert data["server"]["cache_hit_ratio"] == 0.25
    assert data["steps"][0]["ok_rps"] == 100.0
    assert LoadTestResult.from_dict(data) == original


def test_to_dict_replaces_non_finite_numbers() -> None:
    original = result([step(0, 1, math.inf, 5.0)])
    data = original.to_dict()
    assert data["steps"][0]["total"]["rps"] is None
    json.dumps(data, allow_nan=False)
