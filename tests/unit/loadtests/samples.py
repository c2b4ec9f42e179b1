"""Hand-made results for the load-test unit tests."""

from __future__ import annotations

from loadtests.results import (
    Histogram,
    Latency,
    LoadTestResult,
    RequestStats,
    RunSettings,
    ServerMetrics,
    StepResult,
    TimePoint,
)


def stats(
    rps: float, p99_ms: float | None, requests: int = 1000, failures: int = 0, name: str = "infer"
) -> RequestStats:
    failures_per_s = rps * failures / requests if requests else 0.0
    latency = Latency(
        p50_ms=(p99_ms or 0) / 4,
        p95_ms=(p99_ms or 0) / 2,
        p99_ms=p99_ms,
        p999_ms=p99_ms,
        avg_ms=(p99_ms or 0) / 3,
        max_ms=p99_ms,
    )
    return RequestStats(name, requests, failures, rps, failures_per_s, latency)


def step(
    index: int,
    users: int,
    rps: float,
    p99_ms: float | None,
    failures: int = 0,
    errors: dict[str, int] | None = None,
    exceptions: int = 0,
    server: ServerMetrics | None = None,
) -> StepResult:
    started = index * 12.0
    timeline = [
        TimePoint(started + t, users, rps, 0.0, (p99_ms or 0) / 4, (p99_ms or 0) / 2, p99_ms)
        for t in (1.0, 2.0, 3.0)
    ]
    return StepResult(
        index=index,
        users=users,
        started_s=started,
        duration_s=10.0,
        total=stats(rps, p99_ms, failures=failures, name="Aggregated"),
        tenants=[],
        errors=errors or {},
        exceptions=exceptions,
        timeline=timeline,
        server=server,
    )


def server_metrics() -> ServerMetrics:
    return ServerMetrics(
        batch_size=Histogram(
            bounds=[1, 2, 4, 8, 16, 1024], counts=[10, 30, 60, 60, 60, 60, 60], sum=150.0
        ),
        queue_wait_s=Histogram(bounds=[0.001, 0.01], counts=[50, 90, 100], sum=0.3),
        requests_by_status={"200": 900.0, "429": 100.0},
        cache_hits=25.0,
        cache_misses=75.0,
        rejections={"slow/rate": 100.0},
    )


def result(steps: list[StepResult], slo_p99_ms: float | None = None) -> LoadTestResult:
    settings = RunSettings(
        url="http://127.0.0.1:8000",
        model="demo",
        protocol="http",
        users=[s.users for s in steps],
        duration_s=10.0,
        target="http://127.0.0.1:8000",
        cache_hit_fraction=0.25,
        slo_p99_ms=slo_p99_ms,
    )
    return LoadTestResult(settings=settings, started_at="2026-01-01T00:00:00+00:00", steps=steps)
