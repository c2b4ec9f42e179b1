"""The many-models benchmark's pure parts (loadtests/benchmarks/many_models_repo.py and
many_models_stats.py): the plan and trace it sends, the cold/warm split, a run's figures and the
targets, on inputs small enough to follow by hand."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loadtests.benchmarks.many_models import Samples, cold_start_mean_ms, cores_of, per_model
from loadtests.benchmarks.many_models_repo import (
    BYTES_PER_HIDDEN,
    Plan,
    hidden,
    make_trace,
    request_body,
    write_repository,
)
from loadtests.benchmarks.many_models_stats import (
    Answer,
    cold_by_size,
    quantile,
    split_cold,
    summarize,
    table,
    targets,
)


def test_the_plan_names_its_models_pipelines_and_steps_within_the_size_range() -> None:
    plan = Plan(models=5, pipelines=2, low=1000, high=50_000, seed=3)
    weights = plan.weights()
    assert sorted(weights) == [
        "m000",
        "m001",
        "m002",
        "m003",
        "m004",
        "p0_a",
        "p0_b",
        "p1_a",
        "p1_b",
    ]
    assert all(1000 <= size <= 50_000 for size in weights.values())
    assert plan.steps() == {"p0": ("p0_a", "p0_b"), "p1": ("p1_a", "p1_b")}
    assert plan.targets() == ["m000", "m001", "m002", "m003", "m004", "p0", "p1"]
    assert plan.weights() == weights  # from the seed: every run the same repository
    assert Plan(seed=1).key() != Plan(seed=2).key()


def test_a_written_mlp_has_about_the_planned_weights(tmp_path: Path) -> None:
    plan = Plan(models=1, pipelines=1, low=200_000, high=210_000)
    write_repository(tmp_path, plan)
    model = onnx.load(tmp_path / "m000" / "1" / "model.onnx")
    weights = sum(np.prod(t.dims) * 4 for t in model.graph.initializer)
    assert abs(weights - plan.weights()["m000"]) < 2 * BYTES_PER_HIDDEN
    assert "{model: p0_b, inputs: {x: H}" in (tmp_path / "p0" / "config.yaml").read_text()
    assert hidden(1) == 1


def test_request_bodies_name_the_input_of_a_model_or_a_pipeline() -> None:
    assert json.loads(request_body("m007"))["inputs"][0]["name"] == "x"
    body = json.loads(request_body("p1"))["inputs"][0]
    assert (body["name"], body["shape"], len(body["data"])) == ("X", [1, 16], 16)


def test_the_trace_is_poisson_at_the_rate_and_zipf_over_the_models() -> None:
    names = [f"m{i}" for i in range(50)]
    trace = make_trace(names, rate_rps=200, seconds=50, s=1.1, seed=0)
    assert trace == make_trace(names, rate_rps=200, seconds=50, s=1.1, seed=0)
    assert len(trace.times) == len(trace.names)
    assert abs(len(trace.times) - 10_000) < 400  # 200/s for 50 s: sd ~100
    assert trace.times == sorted(trace.times)
    assert trace.times[-1] < 50
    counts = [count for _, count in Counter(trace.names).most_common()]
    # Zipf s=1.1 over 50 models: the top one gets 1/H(50,1.1) ~ 26%, the 10th ~ 2%.
    assert 0.23 < counts[0] / len(trace.names) < 0.29
    assert 0.015 < counts[9] / len(trace.names) < 0.03
    with pytest.raises(ValueError, match="must be > 0"):
        make_trace(names, 0, 10, 1.1, 0)


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


def test_metrics_are_summed_per_model_and_cores_parsed() -> None:
    samples: Samples = {
        ("sluice_model_loads_total", (("model", "a"), ("outcome", "loaded"))): 3.0,
        ("sluice_model_loads_total", (("model", "a"), ("outcome", "failed"))): 1.0,
        ("sluice_model_resident_bytes", (("model", "a"), ("version", "1"))): 5.0,
        ("sluice_model_resident_bytes", (("model", "a"), ("version", "2"))): 7.0,
    }
    assert per_model(samples, "sluice_model_loads_total", outcome="loaded") == {"a": 3}
    assert per_model(samples, "sluice_model_resident_bytes") == {"a": 12}
    assert cores_of("0-2,5") == {0, 1, 2, 5}


def test_the_servers_mean_cold_start_between_two_scrapes() -> None:
    def parsed(total: float, count: int) -> Samples:
        text = (
            "# TYPE sluice_model_cold_start_seconds histogram\n"
            f'sluice_model_cold_start_seconds_bucket{{le="+Inf"}} {count}\n'
            f"sluice_model_cold_start_seconds_sum {total}\n"
            f"sluice_model_cold_start_seconds_count {count}\n"
        )
        return {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        }

    assert cold_start_mean_ms(parsed(1.0, 10), parsed(4.0, 40)) == pytest.approx(100.0)
    assert math.isnan(cold_start_mean_ms(parsed(1.0, 10), parsed(1.0, 10)))
