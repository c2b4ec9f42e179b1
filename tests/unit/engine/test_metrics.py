"""engine/metrics.py: request counters, admission rejections read from the limiter at scrape time,
histograms that resolve sub-millisecond latencies, and the bare ASGI app of the metrics port."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.engine import Engine
from engine.limits import LimiterCounters
from engine.metrics import Metrics
from engine.types import InferRequest
from server.settings import Settings

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: bytes) -> Samples:
    samples: Samples = {}
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def labels(**values: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(values.items()))


def empty_snapshot(limiter: LimiterCounters | None = None) -> dict[str, Any]:
    return {"models": [], "index": [], "in_flight": 3, "cache": None, "limiter": limiter}


def buckets(samples: Samples, name: str, **match: str) -> list[tuple[float, float]]:
    """(le, cumulative count) of one histogram's series, in bound order."""
    found = [
        (float(dict(key)["le"]), value)
        for (sample, key), value in samples.items()
        if sample == f"{name}_bucket" and all(dict(key).get(k) == v for k, v in match.items())
    ]
    return sorted(found)


def check_histogram(samples: Samples, name: str, **match: str) -> list[tuple[float, float]]:
    """Bucket sanity: cumulative, +Inf last and equal to _count."""
    series = buckets(samples, name, **match)
    assert series, f"no {name} series for {match}"
    counts = [count for _, count in series]
    assert counts == sorted(counts), f"{name} buckets are not cumulative: {series}"
    assert math.isinf(series[-1][0])
    assert series[-1][1] == samples[(f"{name}_count", labels(**match))]
    return series


async def test_requests_counted_by_label_set() -> None:
    metrics = Metrics(empty_snapshot)
    for status in (200, 200, 429):
        metrics.request("demo", "1" if status == 200 else "", "grpc", status, 0.0004)
    metrics.request("demo", "1", "http", 200, 0.003)
    found = parse(await metrics.exposition())
    ok = labels(model="demo", version="1", protocol="grpc", status="200")
    limited = labels(model="demo", version="", protocol="grpc", status="429")
    assert found[("sluice_requests_total", ok)] == 2
    assert found[("sluice_requests_total", limited)] == 1
    assert (
        found[("sluice_request_duration_seconds_count", labels(model="demo", protocol="grpc"))] == 3
    )
    assert found[("sluice_in_flight", ())] == 3
    # 0.0004 s lands in the 0.0005 bucket, not below it: sub-millisecond resolution.
    series = dict(check_histogram(found, "sluice_request_duration_seconds", model="demo",
                                  protocol="grpc"))  # fmt: skip
    assert (series[0.00025], series[0.0005], series[30.0]) == (0, 3, 3)


async def test_rejections_read_from_the_limiter_at_scrape_time() -> None:
    counters = LimiterCounters()
    metrics = Metrics(lambda: empty_snapshot(counters))
    assert not any(
        name == "sluice_admission_rejections_total" for name, _ in parse(await metrics.exposition())
    )
    counters.rejections[("acme", "rate")] += 3
    counters.rejections[("acme", "quota_day")] += 1
    counters.rejections[("other", "concurrency")] += 2
    counters.backend_failures, counters.fallback_admissions = 5, 4
    counters.late_refunds = 2
    found = parse(await metrics.exposition())
    rejected = {
        dict(key)["tenant"] + "/" + dict(key)["reason"]: value
        for (name, key), value in found.items()
        if name == "sluice_admission_rejections_total"
    }
    assert rejected == {"acme/rate": 3, "acme/quota_day": 1, "other/concurrency": 2}
    assert found[("sluice_admission_backend_failures_total", ())] == 5
    assert found[("sluice_admission_fallbacks_total", ())] == 4
    assert found[("sluice_admission_late_refunds_total", ())] == 2


async def call_asgi(
    metrics: Metrics, method: str, path: str
) -> tuple[int, dict[bytes, bytes], bytes]:
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Any) -> None:
        sent.append(message)

    await metrics.asgi({"type": "http", "method": method, "path": path}, receive, send)
    start, body = sent
    return start["status"], dict(start["headers"]), body["body"]


async def test_asgi_app_of_the_metrics_port() -> None:
    metrics = Metrics(empty_snapshot)
    metrics.request("demo", "1", "http", 200, 0.01)
    status, headers, body = await call_asgi(metrics, "GET", "/metrics")
    assert status == 200
    assert headers[b"content-type"].startswith(b"text/plain")
    assert int(headers[b"content-length"]) == len(body)
    ok = labels(model="demo", version="1", protocol="http", status="200")
    assert parse(body)[("sluice_requests_total", ok)] == 1
    status, headers, body = await call_asgi(metrics, "HEAD", "/metrics")
    assert (status, body) == (200, b"")
    status, _, body = await call_asgi(metrics, "GET", "/v2/models/demo/infer")
    assert status == 404
    assert b"/metrics" in body


@pytest.fixture
async def engine() -> AsyncIterator[Engine]:
    engine = Engine(Settings())
    await engine.start()
    yield engine
    await engine.close()


async def test_engine_figures_agree_with_statistics(engine: Engine) -> None:
    rows = [1, 3, 2, 5]
    for count in rows:
        x = np.random.default_rng(count).standard_normal((count, 16)).astype(np.float32)
        await engine.infer(InferRequest("demo", {"x": x}, {"x": "FP32"}))
    found = parse(await engine.metrics.exposition())
    stats = (await engine.statistics("demo"))["model_stats"][0]
    key = labels(model="demo", version="1")
    assert found[("sluice_inference_rows_total", key)] == stats["inference_count"] == sum(rows)
    executions = stats["execution_count"]
    assert found[("sluice_executions_total", key)] == executions
    assert 1 <= executions <= len(rows)
    assert found[("sluice_batch_size_count", key)] == executions
    assert found[("sluice_batch_size_sum", key)] == sum(rows)
    assert found[("sluice_queue_wait_seconds_count", key)] == len(rows)
    for name in ("sluice_queue_wait_seconds", "sluice_compute_seconds", "sluice_batch_size"):
        check_histogram(found, name, model="demo", version="1")
    compute_bounds = [le for le, _ in buckets(found, "sluice_compute_seconds", model="demo")]
    assert compute_bounds[0] <= 0.0001  # 100 µs: the demo's batches run in tens of µs
    assert compute_bounds[-2] >= 10  # and tens of seconds for big models
    assert found[("sluice_model_state", labels(model="demo", version="1", state="READY"))] == 1
    provider = labels(model="demo", version="1", provider="CPUExecutionProvider")
    assert found[("sluice_model_provider", provider)] == 1
    assert found[("sluice_queue_depth", key)] == 0
    assert found[("sluice_in_flight", ())] == 0


async def test_fitted_batch_cost_and_shed_requests_are_exported(engine: Engine) -> None:
    for count in (1, 3, 2, 5, 4):
        x = np.random.default_rng(count).standard_normal((count, 16)).astype(np.float32)
        await engine.infer(InferRequest("demo", {"x": x}, {"x": "FP32"}))
    batcher = engine.registry.resolve("demo", None).batcher
    fitted = batcher.cost.coefficients()
    assert fitted is not None
    found = parse(await engine.metrics.exposition())
    key = labels(model="demo", version="1")
    assert found[("sluice_batch_cost_seconds", key)] == pytest.approx(fitted[0])
    assert found[("sluice_row_cost_seconds", key)] == pytest.approx(fitted[1])
    assert fitted[0] + 5 * fitted[1] > 0
    assert found[("sluice_deadline_shed_total", key)] == batcher.shed == 0
