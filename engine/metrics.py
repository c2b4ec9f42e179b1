"""Prometheus metrics. Per-model figures are read at scrape time from the same counters that feed
the Triton statistics endpoint, so the two always agree; so are admission rejections (from the
limiter's counters) and cache counters. Front-ends add request counts and latencies.

`status` on `sluice_requests_total` is the HTTP status code for both protocols: a gRPC request
counts under the HTTP equivalent of its status code (OK 200, INVALID_ARGUMENT 400, NOT_FOUND 404,
RESOURCE_EXHAUSTED 429, UNAVAILABLE 503, ...; a client that went away 499), so one query covers
both front-ends. `version` is the version that answered, empty for a failed request (a client
cannot grow the label set by naming versions that do not exist) and for a generation (its routes
name no version). A generation request counts once, when its last stream ends (a client that
left first: 499), or when it is refused; its latency runs from its arrival to that end."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from engine.generation.gateway_metrics import GatewayCollector
from engine.generation.metrics import GenerationCollector
from engine.gpu_metrics import GpuMetrics
from engine.memory_metrics import memory_families
from engine.stats import LATENCY_BUCKETS_S, ModelStats
from engine.stats import Histogram as StatsHistogram

_NOT_FOUND = b'{"error": "not found; metrics are at GET /metrics"}'


class Metrics:
    """One registry per engine (no process-global state, so tests can run several engines)."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_FrontEndCollector(self))
        self.registry.register(_EngineCollector(snapshot))
        self.registry.register(GpuMetrics())  # exports nothing without NVML
        self.registry.register(GenerationCollector(snapshot))  # generative models only
        self.registry.register(GatewayCollector(snapshot))  # an inference gateway's view of them
        # Plain counts and histograms, exported at scrape time: prometheus_client's own take a
        # lock and several calls per update.
        self.counted: dict[tuple[str, str, str, int], int] = {}
        """Requests answered by (model, version, protocol, status)."""
        self.timed: dict[tuple[str, str], StatsHistogram] = {}
        """Request latency by (model, protocol)."""
        self.encoded_timed: dict[str, StatsHistogram] = {}
        """Response encoding time by protocol."""

    def request(self, model: str, version: str, protocol: str, status: int, seconds: float) -> None:
        """Count one answered inference request and observe its latency."""
        key = (model, version, protocol, status)
        self.counted[key] = self.counted.get(key, 0) + 1
        histogram = self.timed.get((model, protocol))
        if histogram is None:
            histogram = self.timed[(model, protocol)] = StatsHistogram(LATENCY_BUCKETS_S)
        histogram.observe(seconds)

    def encoded(self, protocol: str, seconds: float) -> None:
        """Observe the time one response took to encode."""
        histogram = self.encoded_timed.get(protocol)
        if histogram is None:
            histogram = self.encoded_timed[protocol] = StatsHistogram(LATENCY_BUCKETS_S)
        histogram.observe(seconds)

    async def exposition(self) -> bytes:
        """The registry in Prometheus text format. A coroutine: a worker's (RemoteMetrics) is
        the engine process's, awaited without stalling the worker's loop."""
        return generate_latest(self.registry)

    async def asgi(
        self,
        scope: MutableMapping[str, Any],
        receive: Callable[[], Awaitable[MutableMapping[str, Any]]],
        send: Callable[[MutableMapping[str, Any]], Awaitable[None]],
    ) -> None:
        """A bare ASGI app for the separate metrics port: GET /metrics, 404 for anything else."""
        if scope["type"] != "http":
            return
        status, body, kind = 404, _NOT_FOUND, "application/json"
        if scope["path"] == "/metrics" and scope["method"] in ("GET", "HEAD"):
            status, body, kind = 200, await self.exposition(), CONTENT_TYPE_LATEST
        headers = [(b"content-type", kind.encode()), (b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        empty = scope["method"] == "HEAD"
        await send({"type": "http.response.body", "body": b"" if empty else body})


def _histogram(family: HistogramMetricFamily, labels: list[str], histogram: StatsHistogram) -> None:
    family.add_metric(labels, histogram.cumulative(), histogram.total)


class _FrontEndCollector:
    """The front-ends' request counts and latencies (Metrics.request, Metrics.encoded)."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        metrics = self._metrics
        requests = CounterMetricFamily(
            "sluice_requests",
            "Requests answered (inference and generation), by model, version, protocol and "
            "status code.",
            labels=["model", "version", "protocol", "status"],
        )
        for (model, version, protocol, status), count in list(metrics.counted.items()):
            requests.add_metric([model, version, protocol, str(status)], count)
        latency = HistogramMetricFamily(
            "sluice_request_duration_seconds",
            "End-to-end latency inside the server: inference from decode to encode, a "
            "generation from its arrival to the end of its last stream.",
            labels=["model", "protocol"],
        )
        for (model, protocol), histogram in list(metrics.timed.items()):
            _histogram(latency, [model, protocol], histogram)
        encode = HistogramMetricFamily(
            "sluice_encode_duration_seconds", "Time to encode a response body.", labels=["protocol"]
        )
        for protocol, histogram in list(metrics.encoded_timed.items()):
            _histogram(encode, [protocol], histogram)
        yield from (requests, latency, encode)


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
        batch_cost = GaugeMetricFamily(
            "sluice_batch_cost_seconds",
            "Fitted fixed cost of one batch (the batcher's online model: seconds = batch + rows "
            "x row cost); absent until a few batches ran.",
            labels=labels,
        )
        row_cost = GaugeMetricFamily(
            "sluice_row_cost_seconds", "Fitted cost of each row in a batch.", labels=labels
        )
        shed = CounterMetricFamily(
            "sluice_deadline_shed",
            "Requests answered 504 without running: their batch could not meet their deadline "
            "(max_queue_delay_s: auto).",
            labels=labels,
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
            fitted = model.batcher.cost.coefficients()
            if fitted is not None:
                batch_cost.add_metric(key, fitted[0])
                row_cost.add_metric(key, fitted[1])
            shed.add_metric(key, model.batcher.shed)
        for row in snap["index"]:
            state.add_metric([row["name"], row["version"], row["state"]], 1)
        in_flight = GaugeMetricFamily("sluice_in_flight", "Requests inside the engine now.")
        in_flight.add_metric([], snap["in_flight"])
        yield from (queue_wait, compute, batch_size, batch_requests, depth, depth_rows)
        yield from (inferences, executions, state, provider, in_flight)
        yield from (batch_cost, row_cost, shed)
        yield from memory_families(snap.get("memory"))
        limiter = snap.get("limiter")
        if limiter is not None:
            yield from _admission(limiter)
        cache = snap.get("cache")
        if cache is not None:
            for name in ("hits", "misses", "errors", "evictions", "rejected"):
                family = CounterMetricFamily(f"sluice_cache_{name}", f"Result cache {name}.")
                family.add_metric([], getattr(cache, name))
                yield family
            size = GaugeMetricFamily("sluice_cache_bytes", "Bytes held by the memory cache.")
            size.add_metric([], getattr(cache, "bytes", 0))
            yield size


@dataclass(frozen=True)
class WorkerArenas:
    """One worker slot's shared-memory arenas and process, as the engine process sees them."""

    worker: int
    in_used_bytes: int  # requests the engine still reads
    out_used_bytes: int  # answers the worker has not encoded yet
    arena_bytes: int
    connected: bool
    restarts: int  # connections after the slot's first: its process died and was forked again


class WorkerCollector:
    """`--workers`: arena use and worker restarts, read from the engine host at scrape time."""

    def __init__(self, rows: Callable[[], list[WorkerArenas]]) -> None:
        self._rows = rows

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        labels = ["worker", "arena"]
        used = GaugeMetricFamily(
            "sluice_worker_arena_used_bytes",
            "Bytes in use in a worker's shared-memory arena: `in` holds requests the engine "
            "still reads, `out` answers the worker has not encoded yet (a request that does not "
            "fit is a 503).",
            labels=labels,
        )
        size = GaugeMetricFamily(
            "sluice_worker_arena_bytes", "Size of each arena (worker_arena_bytes).", labels=labels
        )
        connected = GaugeMetricFamily(
            "sluice_worker_connected",
            "1 while the worker slot's process is connected to the engine.",
            labels=["worker"],
        )
        restarts = CounterMetricFamily(
            "sluice_worker_restarts",
            "Times a worker slot's process was replaced (it died and the supervisor forked it "
            "again).",
            labels=["worker"],
        )
        for row in self._rows():
            worker = str(row.worker)
            used.add_metric([worker, "in"], row.in_used_bytes)
            used.add_metric([worker, "out"], row.out_used_bytes)
            for arena in ("in", "out"):
                size.add_metric([worker, arena], row.arena_bytes)
            connected.add_metric([worker], int(row.connected))
            restarts.add_metric([worker], row.restarts)
        yield from (used, size, connected, restarts)


def _admission(counters: Any) -> Iterator[Metric]:
    """The limiter's running totals (engine.limits.LimiterCounters), read at scrape time."""
    rejections = CounterMetricFamily(
        "sluice_admission_rejections",
        "Requests refused by admission control, by tenant and reason (rate, quota_day, "
        "quota_month, concurrency, too_large, unavailable).",
        labels=["tenant", "reason"],
    )
    # A copy: the limiter may add a key while this runs in a thread (prometheus' own server).
    for (tenant, reason), count in list(counters.rejections.items()):
        rejections.add_metric([tenant, reason], count)
    failures = CounterMetricFamily(
        "sluice_admission_backend_failures",
        "Admissions and usage reads the shared (Redis) limiter did not answer.",
    )
    failures.add_metric([], counters.backend_failures)
    fallbacks = CounterMetricFamily(
        "sluice_admission_fallbacks",
        "Admissions decided by the local limiter because Redis did not answer (fail_open).",
    )
    fallbacks.add_metric([], counters.fallback_admissions)
    garbage = CounterMetricFamily(
        "sluice_admission_garbage_state",
        "Rate-limit or quota values read from Redis that were not valid (planted or corrupt) "
        "and were replaced by a fresh bucket or counter.",
    )
    garbage.add_metric([], counters.garbage_state)
    late_refunds = CounterMetricFamily(
        "sluice_admission_late_refunds",
        "Admissions Redis charged whose reply came after the caller stopped waiting (fail_open "
        "false: refused with 503), given back by a refund call.",
    )
    late_refunds.add_metric([], counters.late_refunds)
    yield from (rejections, failures, fallbacks, garbage, late_refunds)
