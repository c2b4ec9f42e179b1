"""loadtests/benchmarks/many_models_stats.py: the cold/warm split, a run's figures and the
targets, on inputs small enough to follow by hand."""

from __future__ import annotations

import math
from typing import Any

import pytest

from loadtests.benchmarks.many_models_stats import (
    Answer,
    cold_by_size,
    quantile,
    split_cold,
    summarize,
    table,
    targets,
)


def test_a_models_cold_starts_are_its_slowest_requests_as_many_as_its_loads() -> None:
    answers = [Answer("a", "200", s) for s in (0.001, 0.3, 0.002, 0.2)]
    answers += [Answer("b", "200", 0.004), Answer("b", "503", 9.0), Answer("c", "200", 0.5)]
    cold, warm = split_cold(answers, {"a": 2, "b": 1, "c": 3})
    # b's 503 is neither; c loaded more often than it answered
    assert cold == {"a": [0.3, 0.2], "b": [0.004], "c": [0.5]}
    assert sorted(warm) == [0.001, 0.002]


def test_cold_starts_by_size_cut_the_models_into_groups_of_as_many() -> None:
    sizes = {"s1": 1, "s2": 2, "m1": 30, "m2": 40, "l1": 900, "l2": 1000}
    cold = {"s1": [0.010, 0.012], "l2": [0.4], "l1": [0.2, 0.3, 0.5]}
    rows = cold_by_size(cold, sizes, groups=3)
    assert [(r["bytes_low"], r["bytes_high"], r["cold_starts"]) for r in rows] == [
        (1, 2, 2),
        (30, 40, 0),
        (900, 1000, 4),
    ]
    assert rows[0]["p50_ms"] == pytest.approx(12.0)
    assert math.isnan(rows[1]["p50_ms"])
    assert rows[2]["p50_ms"] == pytest.approx(400.0)


def test_quantiles_are_nearest_rank() -> None:
    assert quantile([3.0, 1.0, 2.0, 4.0], 0.5) == 3.0
    assert quantile(list(range(100)), 0.99) == 99
    assert math.isnan(quantile([], 0.5))


def test_a_runs_figures() -> None:
    answers = [Answer("a", "200", 0.001)] * 6 + [Answer("a", "200", 0.1), Answer("b", "200", 0.2)]
    answers += [Answer("b", "error", 1.0), Answer("c", "unanswered", 60.0)]
    rss = {"idle": 100, "peak": 300}
    summary = summarize(answers, {"a": 1, "b": 1, "z": 5}, 4, 2.0, rss, {"a": 1, "b": 2})
    assert summary["requests"] == 10
    assert summary["hit_ratio"] == pytest.approx(0.8)  # z was never asked for: not counted
    assert (summary["cold_p50_ms"], summary["warm_p99_ms"]) == (200.0, 1.0)
    assert (summary["errors"], summary["evictions_per_s"]) == (2, 2.0)
    assert summary["statuses"] == {"200": 8, "error": 1, "unanswered": 1}
    assert (summary["idle_rss_bytes"], summary["peak_rss_bytes"]) == (100, 300)
    assert [(r["bytes_low"], r["cold_starts"]) for r in summary["cold_by_size"]] == [(1, 1), (2, 1)]


def run(hit: float, warm_p99: float, errors: int = 0, peak: int = 0) -> dict[str, Any]:
    return {
        "hit_ratio": hit,
        "warm_p99_ms": warm_p99,
        "errors": errors,
        "idle_rss_bytes": 1000,
        "peak_rss_bytes": 1000 + peak,
        "cold_p50_ms": 50.0,
        "cold_p99_ms": 90.0,
        "warm_p50_ms": 1.0,
        "evictions_per_s": 0.5,
    }


def report(ours: dict[str, Any]) -> dict[str, Any]:
    sim = {"hit_ratio": 0.70, "evictions": 10, "loaded_bytes": 5_000_000, "hits": 7, "misses": 3}
    return {
        "budget_bytes": 10_000_000,
        "runs": {"all_loaded": run(1.0, 10.0), "lru_bytes": ours, "lru_count": run(0.65, 11.0)},
        "simulation": {"lru_bytes": sim},
        "plan": {"models": 200, "pipelines": 4, "low": 300_000, "high": 30_000_000},
        "command": "python -m loadtests.benchmarks.many_models",
        "machine": "test",
        "repository_bytes": 40_000_000,
        "budget_share": 0.25,
        "max_models": 50,
        "zipf": 1.1,
        "rate_rps": 40,
        "seconds": 180,
    }


def test_targets_met() -> None:
    found = targets(report(run(0.72, 12.0, peak=11_000_000)))  # 12 <= 1.2 x 10; 11 MB <= 11
    assert [met for _, met, _ in found] == [True] * 5
    page = table(report(run(0.72, 12.0, peak=11_000_000)))
    assert "| on_demand, LRU by bytes | 0.720 | 50 / 90 | - | 1.0 / 12.0 |" in page
    assert "MISSED" not in page
    assert "Cold starts of the LRU-by-bytes run" not in page  # none measured by size
    ours = {
        **run(0.72, 12.0),
        "cold_by_size": [
            {"bytes_low": 300_000, "bytes_high": 900_000, "cold_starts": 7, "p50_ms": 21.4}
        ],
    }
    assert "| 0.3-0.9 MB | 7 | 21 |" in table(report(ours))
    assert "| all loaded (mode none) | 1.000 | - / - | - | 1.0 / 10.0 |" in table(
        {
            **report(run(0.72, 12.0)),
            "runs": {
                "all_loaded": {**run(1.0, 10.0), "cold_p50_ms": math.nan, "cold_p99_ms": math.nan},
                "lru_bytes": run(0.72, 12.0),
            },
        }
    )


def test_each_target_missed() -> None:
    found = targets(report(run(0.65, 12.1, errors=1, peak=11_000_001)))
    assert [met for _, met, _ in found] == [False] * 5
    assert found[2] == ("hit ratio >= offline LRU by bytes", False, "0.650 vs 0.700")
