"""Prometheus metrics. Per-model figures are read at scrape time from the same counters that feed
the Triton statistics endpoint, so the two always agree; front-ends add request counts."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from engine.stats import LATENCY_BUCKETS_S, ModelStats
from engine.stats import Histogram as StatsHistogram


class Metrics:
    """One registry per engine (no process-global state, so tests can run several engines)."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "sluice_requests",
            "Inference requests answered, by model, version, protocol and status code.",
            ["model", "version", "protocol", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "sluice_request_duration_seconds",
            "End-to-end inference latency inside the server (decode to encode).",
            ["model", "protocol"],
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.encode = Histogram(
            "sluice_encode_duration_seconds",
            "Time to encode a response body.",
            ["protocol"],
            buckets=LATENCY_BUCKETS_S,
            registry=self.registry,
        )
        self.rejections = Counter(
            "sluice_admission_rejections",
            "Requests refused by admission control, by tenant and reason.",
            ["tenant", "reason"],
            registry=self.registry,
        )
        self.registry.register(_EngineCollector(snapshot))

    def request(self, model: str, version: str, protocol: str, status: int, seconds: float) -> None:
        self.requests.labels(model, version or "", protocol, str(status)).inc()
        self.latency.labels(model, protocol).observe(seconds)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


def _histogram(family: HistogramMetricFamily, labels: list[str], histogram: StatsHistogram) -> None:
    family.add_metric(labels, histogram.cumulative(), histogram.total)


class _EngineCollector:
    """Reads the engine's snapshot at scrape time."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self._snapshot = snapshot

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        labels = ["model", "version"]
        queue_wait = HistogramMetricFamily(
            "sluice_queue_wait_seconds", "Time requests waited in the batch queue.", labels=labels
        )
        compute = HistogramMetricFamily(
            "sluice_compute_seconds", "Time a batch ran in the backend.", labels=labels
        )
        batch_size = HistogramMetricFamily(
            "sluice_batch_size", "Rows per executed batch.", labels=labels
        )
        batch_requests = HistogramMetricFamily(
            "sluice_batch_requests", "Requests per executed batch.", labels=labels
        )
        depth = GaugeMetricFamily(
            "sluice_queue_depth", "Requests waiting in the queue.", labels=labels
        )
        depth_rows = GaugeMetricFamily(
            "sluice_queue_rows", "Rows waiting in the queue.", labels=labels
        )
        inferences = CounterMetricFamily(
            "sluice_inference_rows", "Rows inferred (Triton inference_count).", labels=labels
        )
        executions = CounterMetricFamily(
            "sluice_executions", "Batches executed (Triton execution_count).", labels=labels
        )
        state = GaugeMetricFamily(
            "sluice_model_state", "1 for the model's current state.", labels=[*labels, "state"]
        )
        provider = GaugeMetricFamily(
            "sluice_model_provider", "Execution provider in use.", labels=[*labels, "provider"]
        )
        for model in snap["models"]:
            key = [model.name, model.version]
            stats: ModelStats = model.stats
            _histogram(queue_wait, key, stats.queue_wait)
            _histogram(compute, key, stats.compute)
            _histogram(batch_size, key, stats.batch_rows)
            _histogram(batch_requests, key, stats.batch_requests)
            depth.add_metric(key, model.batcher.queue.requests)
            depth_rows.add_metric(key, model.batcher.queue.rows)
            inferences.add_metric(key, stats.inference_count)
            executions.add_metric(key, stats.execution_count)
            provider.add_metric([*key, model.backend.provider], 1)
        for row in snap["index"]:
            state.add_metric([row["name"], row["version"], row["state"]], 1)
        in_flight = GaugeMetricFamily("sluice_in_flight", "Requests inside the engine now.")
        in_flight.add_metric([], snap["in_flight"])
        yield from (queue_wait, compute, batch_size, batch_requests, depth, depth_rows)
        yield from (inferences, executions, state, provider, in_flight)
        cache = snap.get("cache")
        if cache is not None:
            for name in ("hits", "misses", "errors", "evictions"):
                family = CounterMetricFamily(f"sluice_cache_{name}", f"Result cache {name}.")
                family.add_metric([], getattr(cache, name))
                yield family
            size = GaugeMetricFamily("sluice_cache_bytes", "Bytes held by the memory cache.")
            size.add_metric([], getattr(cache, "bytes", 0))
            yield size
