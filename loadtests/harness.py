"""The load test itself: fetch the model's metadata, run each concurrency step with locust,
scrape /metrics around every step, and assemble a `LoadTestResult`.

With an SLO the ramp stops at the first step whose p99 (or error rate) misses it: load beyond the
knee only piles up queues and tells nothing new.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

import httpx

from loadtests.locust_csv import StepFiles, read_timeline
from loadtests.locust_summary import read_summary
from loadtests.options import UserOptions
from loadtests.plan import best_step, meets_slo
from loadtests.results import LoadTestResult, RunSettings, ServerMetrics, StepResult
from loadtests.runner import LoadTestError, Progress, StepSpec, run_step
from loadtests.scrape import Snapshot, scrape, server_metrics


@dataclass(slots=True)
class LoadTestConfig:
    """Everything `sluice loadtest` was asked to do."""

    url: str
    """The server's HTTP base URL: metadata, /metrics, and the target of the HTTP protocols."""
    model: str
    protocol: str
    users: list[int]
    duration_s: int
    out: Path
    grpc_target: str | None = None
    """host:port of the gRPC front-end (protocol grpc)."""
    model_version: str = ""
    batch_size: int = 1
    dynamic_size: int = 1
    cache_hit_fraction: float = 0.0
    api_keys: tuple[str, ...] = ()
    slo_p99_ms: float | None = None
    max_error_fraction: float = 0.01
    workers: int = 0
    remote_workers: int = 0
    master_bind: tuple[str, int] | None = None
    metrics_url: str | None = None
    """Default: `<url>/metrics`."""
    timeout_s: float = 30.0
    seed: int = 0

    @property
    def target(self) -> str:
        if self.protocol == "grpc":
            return self.grpc_target or ""
        return self.url

    def auth_headers(self) -> dict[str, str]:
        """Headers for the harness's own calls (metadata, metrics): the first API key, if any."""
        return {"Authorization": f"Bearer {self.api_keys[0]}"} if self.api_keys else {}


class Observer(Protocol):
    """Told what happens while the load test runs (the CLI draws a progress display)."""

    def step_started(self, index: int, users: int, duration_s: int) -> None: ...

    def step_progress(self, index: int, elapsed_s: float, progress: Progress | None) -> None: ...

    def step_finished(self, step: StepResult) -> None: ...


def check_grpc_target(config: LoadTestConfig) -> None:
    """LoadTestError unless the gRPC target accepts a connection (HTTP/2 handshake included)
    within the request timeout: every call would fail, and a run of failures is not a
    measurement."""
    if config.grpc_target is None:
        return
    import grpc

    with grpc.insecure_channel(config.grpc_target) as channel:
        try:
            grpc.channel_ready_future(channel).result(timeout=config.timeout_s)
        except grpc.FutureTimeoutError:
            raise LoadTestError(
                f"cannot reach the gRPC server at {config.grpc_target} "
                f"(no connection within {config.timeout_s:g} s); is --grpc-url right?"
            ) from None


def fetch_metadata(config: LoadTestConfig) -> dict[str, Any]:
    """GET /v2/models/{name}[/versions/{v}]; LoadTestError says what went wrong."""
    path = f"/v2/models/{config.model}"
    if config.model_version:
        path += f"/versions/{config.model_version}"
    url = config.url.rstrip("/") + path
    try:
        response = httpx.get(url, headers=config.auth_headers(), timeout=config.timeout_s)
    except httpx.HTTPError as exc:
        raise LoadTestError(f"cannot reach the server at {url}: {exc!r}") from exc
    if response.status_code != 200:
        raise LoadTestError(
            f"model metadata at {url} answered {response.status_code}: {response.text[:300]}"
        )
    metadata: dict[str, Any] = response.json()
    return metadata


def _step_result(
    index: int, users: int, config: LoadTestConfig, files: StepFiles, origin: float, begun: float
) -> StepResult:
    summary = read_summary(files.summary)
    tenants = sorted(summary.infer_entries, key=lambda entry: (len(entry.name), entry.name))
    return StepResult(
        index=index,
        users=users,
        started_s=begun - origin,
        duration_s=float(config.duration_s),
        total=summary.total,
        tenants=tenants if len(tenants) > 1 else [],
        errors=summary.errors,
        exceptions=summary.exceptions,
        timeline=read_timeline(files, origin),
        generator_cpu_bound=summary.cpu_bound,
    )


def run_load_test(config: LoadTestConfig, observer: Observer | None = None) -> LoadTestResult:
    """Run every step (stopping early past the SLO) and return the measurements.

    Raises LoadTestError when the model cannot be described or locust cannot run. Ctrl-C during
    a later step ends the ramp and returns the finished steps (`interrupted` set).
    """
    check_grpc_target(config)
    metadata = fetch_metadata(config)
    options = UserOptions(
        model=config.model,
        model_version=config.model_version,
        batch_size=config.batch_size,
        dynamic_size=config.dynamic_size,
        cache_hit_fraction=config.cache_hit_fraction,
        api_keys=config.api_keys,
        metadata=metadata,
        timeout_s=config.timeout_s,
        seed=config.seed,
    )
    env = options.to_env()
    metrics_url = config.metrics_url or config.url.rstrip("/") + "/metrics"
    headers = config.auth_headers()
    origin = time.time()
    started_at = datetime.now(UTC).isoformat(timespec="seconds")
    first: Snapshot = scrape(metrics_url, headers)
    before = first
    steps: list[StepResult] = []
    interrupted = False
    for index, users in enumerate(config.users):
        if observer is not None:
            observer.step_started(index, users, config.duration_s)
        spec = StepSpec(
            protocol=config.protocol,
            host=config.target,
            users=users,
            duration_s=config.duration_s,
            prefix=config.out / "locust" / f"step-{index + 1:02d}",
            workers=config.workers,
            remote_workers=config.remote_workers,
            master_bind=config.master_bind,
        )
        begun = time.time()

        def report(elapsed: float, progress: Progress | None, index: int = index) -> None:
            if observer is not None:
                observer.step_progress(index, elapsed, progress)

        try:
            files = run_step(spec, env, on_progress=report)
        except KeyboardInterrupt:
            if not steps:
                raise
            interrupted = True  # Ctrl-C: report the steps that finished
            break
        after = scrape(metrics_url, headers)
        step = _step_result(index, users, config, files, origin, begun)
        step.server = server_metrics(before, after, config.model)
        if config.slo_p99_ms is not None:
            step.meets_slo = meets_slo(step, config.slo_p99_ms, config.max_error_fraction)
        steps.append(step)
        before = after
        if observer is not None:
            observer.step_finished(step)
        if step.meets_slo is False:
            break
    best, verdict = best_step(steps, config.slo_p99_ms, config.max_error_fraction)
    whole: ServerMetrics = server_metrics(first, before, config.model)
    settings = RunSettings(
        url=config.url,
        model=config.model,
        protocol=config.protocol,
        users=list(config.users),
        duration_s=float(config.duration_s),
        target=config.target,
        batch_size=config.batch_size,
        cache_hit_fraction=config.cache_hit_fraction,
        tenants=len(config.api_keys),
        workers=config.workers + config.remote_workers,
        slo_p99_ms=config.slo_p99_ms,
        max_error_fraction=config.max_error_fraction,
    )
    return LoadTestResult(
        settings=settings,
        started_at=started_at,
        steps=steps,
        server=whole,
        best_step=best.index if best is not None else None,
        verdict=verdict,
        interrupted=interrupted,
    )
