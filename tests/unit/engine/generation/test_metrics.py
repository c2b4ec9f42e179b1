"""engine.generation.metrics: the generation schedulers' metrics, read at scrape time."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest

from engine.generation.metrics import GenerationCollector
from engine.generation.stats import GenerationStats

LABELS = 'model="llama",version="1"'


def _scrape(*models: Any) -> str:
    registry = CollectorRegistry()
    registry.register(GenerationCollector(lambda: {"models": list(models)}))
    return generate_latest(registry).decode()


def test_the_collector_exports_the_three_histograms_per_model() -> None:
    stats = GenerationStats()
    stats.first_token(0.02)
    stats.next_token(0.004)
    stats.next_token(0.006)
    stats.e2e.observe(0.03)
    scheduler = SimpleNamespace(
        running=[],
        waiting=[],
        prefix=None,
        stats=stats,
        cache=SimpleNamespace(slot_bytes=0, budget_bytes=1),
    )
    model = SimpleNamespace(
        name="llama", version="1", generator=SimpleNamespace(scheduler=scheduler)
    )
    text = _scrape(model)
    labels = LABELS
    assert f'sluice_generation_ttft_seconds_bucket{{le="0.025",{labels}}} 1.0' in text
    assert f'sluice_generation_itl_seconds_bucket{{le="0.005",{labels}}} 1.0' in text
    assert f'sluice_generation_itl_seconds_bucket{{le="0.01",{labels}}} 2.0' in text
    assert f"sluice_generation_itl_seconds_count{{{labels}}} 2.0" in text
    assert f"sluice_generation_e2e_seconds_sum{{{labels}}} 0.03" in text


def test_the_gauges_and_counters_of_a_running_scheduler() -> None:
    stats = GenerationStats(generated_tokens=40, steps=12)
    for seconds in (0.01, 0.02, 0.03):
        stats.first_token(seconds)
    scheduler = SimpleNamespace(
        running=[object(), object()],
        waiting=[object()],
        prefix=SimpleNamespace(bytes=512, hit_tokens=30, prompt_tokens=90),
        stats=stats,
        cache=SimpleNamespace(slot_bytes=4096, budget_bytes=1 << 20),
    )
    model = SimpleNamespace(
        name="llama", version="1", generator=SimpleNamespace(scheduler=scheduler)
    )
    text = _scrape(model)
    for line in (
        f"sluice_generation_running_sequences{{{LABELS}}} 2.0",
        f"sluice_generation_waiting_sequences{{{LABELS}}} 1.0",
        f"sluice_generation_kv_cache_used_bytes{{{LABELS}}} 4096.0",
        f"sluice_generation_kv_cache_budget_bytes{{{LABELS}}} 1.048576e+06",
        f"sluice_generation_tokens_total{{{LABELS}}} 40.0",
        f"sluice_generation_steps_total{{{LABELS}}} 12.0",
        f"sluice_generation_prefix_cache_bytes{{{LABELS}}} 512.0",
        f"sluice_generation_prefix_hit_tokens_total{{{LABELS}}} 30.0",
        f"sluice_generation_prompt_tokens_total{{{LABELS}}} 90.0",
        # The exposition sorts the labels: quantile comes between model and version.
        "sluice_generation_time_to_first_token_seconds"
        '{model="llama",quantile="0.5",version="1"} 0.02',
    ):
        assert f"\n{line}\n" in text, line
    assert "sluice_generation_inter_token_seconds{" not in text  # no gaps yet: no quantiles


def test_models_without_a_generator_are_left_out() -> None:
    text = _scrape(
        SimpleNamespace(name="mlp", version="1", generator=None),
        SimpleNamespace(name="x", version="1"),
    )
    assert 'model="mlp"' not in text
    assert 'model="x"' not in text
    assert "# TYPE sluice_generation_running_sequences gauge" in text  # the families stay
