"""Prometheus metrics of the generation schedulers, read at scrape time from each generative
model's scheduler: running and waiting sequences, key/value cache bytes used and budgeted,
generated tokens and scheduler steps (rate() of the tokens counter is tokens/s), prefix-cache
bytes, hit tokens and prompt tokens (their ratio is the hit rate); time to first token,
inter-token latency and end-to-end time as histograms since load (they add up across replicas)
and, as before, the first two as p50/p99 gauges over each model's latest 10,000 tokens."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

LABELS = ["model", "version"]


class GenerationCollector:
    """Reads `snapshot()["models"]` (LoadedModel) and reports those with a generator."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self._snapshot = snapshot

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        def gauge(name: str, text: str, labels: list[str] = LABELS) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"sluice_generation_{name}", text, labels=labels)

        running = gauge("running_sequences", "Sequences in the decode batch.")
        waiting = gauge("waiting_sequences", "Sequences waiting for key/value cache room.")
        used = gauge("kv_cache_used_bytes", "Key/value cache bytes reserved by sequences.")
        prefix = gauge("prefix_cache_bytes", "Key/value cache bytes of cached prompt prefixes.")
        hits = CounterMetricFamily(
            "sluice_generation_prefix_hit_tokens",
            "Prompt tokens taken from the prefix cache instead of prefilled.",
            labels=LABELS,
        )
        prompts = CounterMetricFamily(
            "sluice_generation_prompt_tokens",
            "Prompt tokens admitted (prefix_hit_tokens / prompt_tokens is the hit rate).",
            labels=LABELS,
        )
        budget = gauge("kv_cache_budget_bytes", "The model's kv_cache_bytes.")
        tokens = CounterMetricFamily(
            "sluice_generation_tokens", "Tokens generated (rate() is tokens/s).", labels=LABELS
        )
        steps = CounterMetricFamily(
            "sluice_generation_steps", "Scheduler steps (one decode batch each).", labels=LABELS
        )
        quantile_labels = [*LABELS, "quantile"]
        ttft = gauge("time_to_first_token_seconds", "Time to first token.", quantile_labels)
        itl = gauge("inter_token_seconds", "Time between a sequence's tokens.", quantile_labels)
        histograms = [
            HistogramMetricFamily(
                "sluice_generation_ttft_seconds",
                "Time from a sequence's arrival to its first token.",
                labels=LABELS,
            ),
            HistogramMetricFamily(
                "sluice_generation_itl_seconds", "Time between a sequence's tokens.", labels=LABELS
            ),
            HistogramMetricFamily(
                "sluice_generation_e2e_seconds",
                "Time from a sequence's arrival to its end (any finish reason).",
                labels=LABELS,
            ),
        ]
        for model in self._snapshot()["models"]:
            generator = getattr(model, "generator", None)
            if generator is None:
                continue
            scheduler = generator.scheduler
            labels = [model.name, model.version]
            running.add_metric(labels, len(scheduler.running))
            waiting.add_metric(labels, len(scheduler.waiting))
            used.add_metric(labels, scheduler.cache.slot_bytes)
            cached = scheduler.prefix
            prefix.add_metric(labels, cached.bytes if cached is not None else 0)
            hits.add_metric(labels, cached.hit_tokens if cached is not None else 0)
            prompts.add_metric(labels, cached.prompt_tokens if cached is not None else 0)
            budget.add_metric(labels, scheduler.cache.budget_bytes)
            tokens.add_metric(labels, scheduler.stats.generated_tokens)
            steps.add_metric(labels, scheduler.stats.steps)
            stats = scheduler.stats
            observed_all = (stats.ttft, stats.itl, stats.e2e)
            for histogram, observed in zip(histograms, observed_all, strict=True):
                histogram.add_metric(labels, observed.cumulative(), observed.sum_s)
            for family, values in (
                (ttft, scheduler.stats.time_to_first_token_s),
                (itl, scheduler.stats.inter_token_s),
            ):
                if values:
                    p50, p99 = np.quantile(np.fromiter(values, float), [0.5, 0.99])
                    family.add_metric([*labels, "0.5"], float(p50))
                    family.add_metric([*labels, "0.99"], float(p99))
        yield from (running, waiting, used, budget, tokens, steps, ttft, itl)
        yield from (prefix, hits, prompts)
        yield from histograms
