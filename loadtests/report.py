"""The report folder: results.json, the PNG plots, report.md and a self-contained report.html."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from loadtests.failures import is_expected
from loadtests.plots import Plot, draw_all
from loadtests.render import Block, Heading, Image, Paragraph, Table, to_html, to_markdown
from loadtests.results import Histogram, LoadTestResult, ServerMetrics, StepResult

NOT_EXPORTED = "not exported"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def _rate(value: float) -> str:
    return f"{value:,.1f}"


def verdict_text(result: LoadTestResult) -> str:
    """One sentence: the answer the load test was run for."""
    best = result.best
    slo = result.settings.slo_p99_ms
    if result.verdict == "fail":
        first = result.steps[0] if result.steps else None
        seen = (
            f" (p99 {_ms(first.total.latency.p99_ms)} ms, {first.error_fraction:.1%} failed)"
            if first
            else ""
        )
        users = f"{first.users} users" if first else "no step"
        return f"**FAIL**: even the lowest step ({users}) missed p99 ≤ {slo:g} ms{seen}."
    if best is None:
        return "No step completed."
    found = (
        f"{_rate(best.total.ok_rps)} ok req/s at {best.users} users "
        f"(p99 {_ms(best.total.latency.p99_ms)} ms)"
    )
    if result.verdict == "pass":
        return f"**PASS**: highest throughput with p99 ≤ {slo:g} ms is {found}."
    return f"Highest throughput: {found}."


def _steps_table(result: LoadTestResult) -> Table:
    headers = [
        "users",
        "req/s",
        "ok req/s",
        "p50 ms",
        "p95 ms",
        "p99 ms",
        "p99.9 ms",
        "requests",
        "failed",
        "unexpected",
    ]
    with_slo = result.settings.slo_p99_ms is not None
    if with_slo:
        headers.append("SLO")
    rows = []
    for step in result.steps:
        latency = step.total.latency
        row = [
            str(step.users),
            _rate(step.total.rps),
            _rate(step.total.ok_rps),
            _ms(latency.p50_ms),
            _ms(latency.p95_ms),
            _ms(latency.p99_ms),
            _ms(latency.p999_ms),
            f"{step.total.requests:,}",
            f"{step.total.failures:,}",
            f"{step.unexpected_errors:,}",
        ]
        if with_slo:
            row.append("ok" if step.meets_slo else "missed")
        rows.append(row)
    return Table(headers, rows)


def _errors_blocks(steps: Sequence[StepResult]) -> list[Block]:
    statuses = sorted({status for step in steps for status in step.errors})
    if not statuses and not any(step.exceptions for step in steps):
        return [Paragraph("No failed requests.")]
    headers = ["status", "kind", *[f"{step.users} users" for step in steps]]
    rows = [
        [
            status,
            "backpressure" if is_expected(status) else "unexpected",
            *[f"{step.errors.get(status, 0):,}" for step in steps],
        ]
        for status in statuses
    ]
    if any(step.exceptions for step in steps):
        rows.append(["exception", "unexpected", *[f"{step.exceptions:,}" for step in steps]])
    return [Table(headers, rows)]


def _cpu_warning(steps: Sequence[StepResult]) -> list[Block]:
    bound = [str(step.users) for step in steps if step.generator_cpu_bound]
    if not bound:
        return []
    return [
        Paragraph(
            f"**Warning**: locust ran above 90% CPU at {', '.join(bound)} users, so those steps "
            "measure the load generator as much as the server. Add `--workers` (or machines)."
        )
    ]


def _tenant_blocks(steps: Sequence[StepResult]) -> list[Block]:
    rows = [
        [
            str(step.users),
            t.name.removeprefix("infer").strip(" []"),
            f"{t.requests:,}",
            f"{t.failures:,}",
            _rate(t.ok_rps),
            _ms(t.latency.p99_ms),
        ]
        for step in steps
        for t in step.tenants
    ]
    if not rows:
        return []
    headers = ["users", "tenant", "requests", "failed", "ok req/s", "p99 ms"]
    return [Heading(2, "Tenants"), Table(headers, rows)]


def _histogram_row(
    name: str, histogram: Histogram | None, scale: float, unit: str, whole: bool
) -> list[str]:
    """Count, mean and p50/p99: bucket bounds for whole-number histograms (`whole`), else
    Prometheus-style interpolation."""
    if histogram is None:
        return [name, NOT_EXPORTED]
    if histogram.count <= 0:
        return [name, "no observations"]
    mean = histogram.sum / histogram.count
    parts = [f"{histogram.count:,.0f} observations", f"mean {mean * scale:,.3g} {unit}"]
    for q in (0.5, 0.99):
        label = f"p{q * 100:g}"
        if whole:
            bound = histogram.upper_bound(q)
            if bound is not None:
                shown = f"> {histogram.bounds[-1]:g}" if math.isinf(bound) else f"≤ {bound:g}"
                parts.append(f"{label} {shown} {unit}")
        else:
            value = histogram.quantile(q)
            if value is not None:
                parts.append(f"{label} ≈ {value * scale:,.3g} {unit}")
    return [name, ", ".join(parts)]


def _server_blocks(server: ServerMetrics | None, configured_fraction: float) -> list[Block]:
    blocks: list[Block] = [Heading(2, "Server side (from /metrics, change over the run)")]
    if server is None or server.error is not None:
        reason = server.error if server is not None else "not scraped"
        return [*blocks, Paragraph(f"Server metrics unavailable: {reason}.")]
    ratio = server.cache_hit_ratio
    if server.cache_hits is None or server.cache_misses is None:
        cache = NOT_EXPORTED
    else:
        shown = f"{ratio:.1%}" if ratio is not None else "no lookups"
        cache = (
            f"{shown} ({server.cache_hits:,.0f} hits, {server.cache_misses:,.0f} misses; "
            f"repeated inputs sent: {configured_fraction:.0%})"
        )
    statuses = server.requests_by_status
    by_status = (
        ", ".join(f"{status or '?'}: {count:,.0f}" for status, count in statuses.items())
        if statuses is not None
        else NOT_EXPORTED
    )
    rejections = server.rejections
    rejected = (
        ", ".join(f"{key}: {count:,.0f}" for key, count in rejections.items())
        if rejections is not None
        else NOT_EXPORTED
    )
    rows = [
        _histogram_row("batch size", server.batch_size, 1.0, "rows", whole=True),
        _histogram_row("queue wait", server.queue_wait_s, 1000.0, "ms", whole=False),
        ["cache-hit ratio", cache],
        ["requests by status", by_status or "none"],
        ["admission rejections (tenant/reason)", rejected or "none"],
    ]
    return [*blocks, Table(["metric", "value"], rows)]


def build(result: LoadTestResult, plots: Sequence[Plot]) -> list[Block]:
    """The report's content."""
    s = result.settings
    target = f"`{s.target}`" if s.target and s.target != s.url else f"`{s.url}`"
    settings = [
        ["server", target],
        ["model", f"`{s.model}`"],
        ["protocol", s.protocol],
        ["users per step", ", ".join(str(u) for u in s.users)],
        ["seconds per step", f"{s.duration_s:g}"],
        ["rows per request", str(s.batch_size)],
        ["repeated-input fraction", f"{s.cache_hit_fraction:g}"],
        ["tenants (API keys)", str(s.tenants)],
        ["locust workers", str(s.workers) if s.workers else "none (one process)"],
        ["p99 SLO", f"{s.slo_p99_ms:g} ms" if s.slo_p99_ms is not None else "none"],
        ["started", result.started_at],
    ]
    unexpected = sum(step.unexpected_errors for step in result.steps)
    blocks: list[Block] = [
        Heading(1, f"Load test: `{s.model}` over {s.protocol}"),
        Paragraph(verdict_text(result)),
        Paragraph(f"Unexpected errors: {unexpected:,}."),
        *_cpu_warning(result.steps),
        *(
            [Paragraph(f"**Interrupted** after {len(result.steps)} of {len(s.users)} steps.")]
            if result.interrupted
            else []
        ),
        Table(["setting", "value"], settings),
        Heading(2, "Steps"),
        _steps_table(result),
        Heading(2, "Errors by status"),
        *_errors_blocks(result.steps),
        *_tenant_blocks(result.steps),
        *_server_blocks(result.server, s.cache_hit_fraction),
        Heading(2, "Plots"),
        *[Image(plot.filename, plot.title) for plot in plots],
        Paragraph("locust's own CSVs and logs for every step are in `locust/`."),
    ]
    return blocks


@dataclass(frozen=True, slots=True)
class ReportFiles:
    markdown: Path
    html: Path
    json: Path
    plots: list[Path]


def write_report(result: LoadTestResult, out: Path) -> ReportFiles:
    """Write results.json, the plots, report.md and report.html into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "results.json"
    results_path.write_text(json.dumps(result.to_dict(), indent=2, allow_nan=False) + "\n")
    plots = draw_all(result, out)
    blocks = build(result, plots)
    markdown_path = out / "report.md"
    markdown_path.write_text(to_markdown(blocks))
    html_path = out / "report.html"
    html_path.write_text(to_html(blocks, out))
    return ReportFiles(markdown_path, html_path, results_path, [out / p.filename for p in plots])
