"""loadtests/benchmarks/many_models.py: the metrics it reads from the server (summed per model,
the mean cold start between two scrapes) and its cores option."""

from __future__ import annotations

import math

import pytest
from prometheus_client.parser import text_string_to_metric_families

from loadtests.benchmarks.many_models import Samples, cold_start_mean_ms, cores_of, per_model


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
