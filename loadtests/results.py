"""What a load test measured: the data behind results.json, the report and the plots.

All latencies are milliseconds (as locust reports them), rates are per second, times are seconds.
`LoadTestResult.to_dict()` is the results.json document; `LoadTestResult.from_dict()` reads it
back, so a report can be re-rendered from a saved run.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from loadtests.failures import is_expected

Verdict = Literal["pass", "fail", "no_slo"]


@dataclass(slots=True)
class Latency:
    """Response-time summary in milliseconds; None where locust had no samples."""

    p50_ms: float | None = None
    p95_ms: float | None = None
    p99_ms: float | None = None
    p999_ms: float | None = None
    avg_ms: float | None = None
    max_ms: float | None = None


@dataclass(slots=True)
class RequestStats:
    """One row of locust's stats: a request name (a tenant) or the aggregate."""

    name: str
    requests: int
    failures: int
    rps: float
    failures_per_s: float
    latency: Latency

    @property
    def ok_rps(self) -> float:
        """Successful responses per second (goodput)."""
        return max(0.0, self.rps - self.failures_per_s)


@dataclass(slots=True)
class TimePoint:
    """One second of the run: `t_s` counts from the start of the whole load test."""

    t_s: float
    users: int
    rps: float
    failures_per_s: float
    p50_ms: float | None
    p95_ms: float | None
    p99_ms: float | None


@dataclass(slots=True)
class Histogram:
    """A Prometheus histogram's change over a window.

    `counts` is cumulative per upper bound in `bounds`, plus one last entry for +Inf, so
    `len(counts) == len(bounds) + 1` and `counts[-1] == count`.
    """

    bounds: list[float]
    counts: list[float]
    sum: float

    @property
    def count(self) -> float:
        return self.counts[-1] if self.counts else 0.0

    @property
    def mean(self) -> float | None:
        return self.sum / self.count if self.count > 0 else None

    def per_bucket(self) -> list[float]:
        """Observations in each bucket (not cumulative), +Inf bucket last."""
        return [c - (self.counts[i - 1] if i else 0.0) for i, c in enumerate(self.counts)]

    def upper_bound(self, q: float) -> float | None:
        """The upper bound of the bucket holding rank q * count (inf when past the last bound):
        the honest answer for integer-valued histograms such as batch sizes."""
        if self.count <= 0:
            return None
        rank = q * self.count
        for bound, cumulative in zip(self.bounds, self.counts, strict=False):
            if cumulative >= rank:
                return bound
        return math.inf

    def quantile(self, q: float) -> float | None:
        """Prometheus' `histogram_quantile`: linear inside the bucket holding rank q * count."""
        if self.count <= 0 or not self.bounds:
            return None
        rank = q * self.count
        for i, cumulative in enumerate(self.counts[:-1]):
            if cumulative >= rank:
                lower = self.bounds[i - 1] if i else 0.0
                below = self.counts[i - 1] if i else 0.0
                inside = cumulative - below
                fraction = (rank - below) / inside if inside > 0 else 1.0
                return lower + (self.bounds[i] - lower) * fraction
        return self.bounds[-1]  # in the +Inf bucket: the highest finite bound is all we know


@dataclass(slots=True)
class ServerMetrics:
    """Server-side changes between two /metrics scrapes; None marks a metric not exported."""

    batch_size: Histogram | None = None
    queue_wait_s: Histogram | None = None
    requests_by_status: dict[str, float] | None = None
    cache_hits: float | None = None
    cache_misses: float | None = None
    rejections: dict[str, float] | None = None
    """Admission rejections by `tenant/reason` (rate limits, quotas)."""
    error: str | None = None
    """Why /metrics could not be read at all (then every other field is None)."""

    @property
    def cache_hit_ratio(self) -> float | None:
        if self.cache_hits is None or self.cache_misses is None:
            return None
        lookups = self.cache_hits + self.cache_misses
        return self.cache_hits / lookups if lookups > 0 else None


@dataclass(slots=True)
class StepResult:
    """One fixed-concurrency step of the run."""

    index: int
    users: int
    started_s: float
    """Offset of this step's start from the start of the load test."""
    duration_s: float
    total: RequestStats
    tenants: list[RequestStats]
    errors: dict[str, int]
    """Failed requests by status (`429`, `UNAVAILABLE`, `connection_error`, ...)."""
    exceptions: int
    timeline: list[TimePoint]
    server: ServerMetrics | None = None
    meets_slo: bool | None = None
    generator_cpu_bound: bool = False
    """A locust process ran above 90% CPU: throughput and latency understate the server."""

    @property
    def unexpected_errors(self) -> int:
        """Failures that are not backpressure (429/503), plus exceptions in user code."""
        faults = sum(n for status, n in self.errors.items() if not is_expected(status))
        return faults + self.exceptions

    @property
    def error_fraction(self) -> float:
        return self.total.failures / self.total.requests if self.total.requests else 0.0


@dataclass(slots=True)
class RunSettings:
    """How the load test was run (echoed in the report)."""

    url: str
    model: str
    protocol: str
    users: list[int]
    duration_s: float
    target: str = ""
    """Where the load went: the HTTP URL, or host:port for gRPC."""
    batch_size: int = 1
    cache_hit_fraction: float = 0.0
    tenants: int = 0
    workers: int = 0
    slo_p99_ms: float | None = None
    max_error_fraction: float = 0.01


@dataclass(slots=True)
class LoadTestResult:
    """The whole run: settings, every step, and the server's view over the whole run."""

    settings: RunSettings
    started_at: str
    steps: list[StepResult] = field(default_factory=list)
    server: ServerMetrics | None = None
    best_step: int | None = None
    """Index of the step with the highest goodput within the SLO (with an SLO), else the highest."""
    verdict: Verdict = "no_slo"
    interrupted: bool = False
    """Ctrl-C ended the ramp early; `steps` holds the ones that finished."""

    @property
    def best(self) -> StepResult | None:
        return next((s for s in self.steps if s.index == self.best_step), None)

    def to_dict(self) -> dict[str, Any]:
        """The results.json document (plain JSON: no NaN, no infinities)."""
        data = asdict(self)
        for step, raw in zip(self.steps, data["steps"], strict=True):
            raw["ok_rps"] = step.total.ok_rps
            raw["unexpected_errors"] = step.unexpected_errors
            raw["error_fraction"] = step.error_fraction
        if self.server is not None:
            data["server"]["cache_hit_ratio"] = self.server.cache_hit_ratio
        best = self.best
        data["summary"] = {
            "verdict": self.verdict,
            "best_users": best.users if best else None,
            "best_ok_rps": best.total.ok_rps if best else None,
            "best_p99_ms": best.total.latency.p99_ms if best else None,
            "requests": sum(s.total.requests for s in self.steps),
            "failures": sum(s.total.failures for s in self.steps),
            "unexpected_errors": sum(s.unexpected_errors for s in self.steps),
        }
        cleaned: dict[str, Any] = _finite(data)
        return cleaned

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LoadTestResult:
        """Read a results.json document back."""
        return cls(
            settings=RunSettings(**data["settings"]),
            started_at=data["started_at"],
            steps=[_step(raw) for raw in data["steps"]],
            server=_server(data.get("server")),
            best_step=data.get("best_step"),
            verdict=data.get("verdict", "no_slo"),
            interrupted=data.get("interrupted", False),
        )


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _stats(raw: dict[str, Any]) -> RequestStats:
    return RequestStats(**{**raw, "latency": Latency(**raw["latency"])})


def _histogram(raw: dict[str, Any] | None) -> Histogram | None:
    return Histogram(**raw) if raw is not None else None


def _server(raw: dict[str, Any] | None) -> ServerMetrics | None:
    if raw is None:
        return None
    return ServerMetrics(
        batch_size=_histogram(raw.get("batch_size")),
        queue_wait_s=_histogram(raw.get("queue_wait_s")),
        requests_by_status=raw.get("requests_by_status"),
        cache_hits=raw.get("cache_hits"),
        cache_misses=raw.get("cache_misses"),
        rejections=raw.get("rejections"),
        error=raw.get("error"),
    )


def _step(raw: dict[str, Any]) -> StepResult:
    return StepResult(
        index=raw["index"],
        users=raw["users"],
        started_s=raw["started_s"],
        duration_s=raw["duration_s"],
        total=_stats(raw["total"]),
        tenants=[_stats(t) for t in raw["tenants"]],
        errors=dict(raw["errors"]),
        exceptions=raw["exceptions"],
        timeline=[TimePoint(**p) for p in raw["timeline"]],
        server=_server(raw.get("server")),
        meets_slo=raw.get("meets_slo"),
        generator_cpu_bound=raw.get("generator_cpu_bound", False),
    )
