"""The report's PNG plots, drawn with matplotlib's object API on the Agg canvas.

No pyplot: it keeps global figure state and picks a GUI backend; `Figure.savefig` renders PNGs
with Agg on its own, so this module is safe to call from any thread and leaves no state behind.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.figure import Figure

from loadtests.failures import is_expected
from loadtests.results import Histogram, LoadTestResult, TimePoint

SIZE_IN = (8.0, 4.0)
DPI = 100
PERCENTILE_STYLES = (("p50", "tab:green"), ("p95", "tab:orange"), ("p99", "tab:red"))


@dataclass(frozen=True, slots=True)
class Plot:
    """One image of the report."""

    filename: str
    title: str


def _save(figure: Figure, path: Path) -> None:
    figure.tight_layout()
    figure.savefig(path, dpi=DPI, format="png")


def _placeholder(axes: Axes, text: str) -> None:
    axes.text(0.5, 0.5, text, ha="center", va="center", transform=axes.transAxes, fontsize=12)
    axes.set_xticks([])
    axes.set_yticks([])


def _step_lines(axes: Axes, result: LoadTestResult) -> None:
    for step in result.steps[1:]:
        axes.axvline(step.started_s, color="grey", linestyle=":", linewidth=1)


def _segments(result: LoadTestResult) -> list[list[TimePoint]]:
    """Each step's points: plotted as separate lines, so the gap while locust restarts between
    steps is not drawn as a ramp."""
    return [step.timeline for step in result.steps if step.timeline]


def _line(
    axes: Axes,
    segments: list[list[TimePoint]],
    value: Callable[[TimePoint], float | None],
    color: str,
    label: str,
) -> None:
    for n, points in enumerate(segments):
        values = [value(p) for p in points]
        axes.plot(
            [p.t_s for p in points],
            [v if v is not None else float("nan") for v in values],
            color=color,
            label=label if n == 0 else None,
            marker=".",
        )


def _percentile(name: str) -> Callable[[TimePoint], float | None]:
    def value(point: TimePoint) -> float | None:
        result: float | None = getattr(point, f"{name}_ms")
        return result

    return value


def throughput_over_time(result: LoadTestResult, path: Path) -> None:
    figure = Figure(figsize=SIZE_IN)
    axes = figure.subplots()
    segments = _segments(result)
    _line(axes, segments, lambda p: max(0.0, p.rps - p.failures_per_s), "tab:blue", "ok req/s")
    _line(axes, segments, lambda p: p.failures_per_s, "tab:red", "failed req/s")
    axes.set_xlabel("time (s)")
    axes.set_ylabel("requests per second")
    axes.set_ylim(bottom=0)
    users = axes.twinx()
    for points in segments:
        users.step(
            [p.t_s for p in points],
            [p.users for p in points],
            where="post",
            color="grey",
            alpha=0.6,
        )
    users.set_ylabel("users (concurrency)", color="grey")
    users.set_ylim(bottom=0)
    _step_lines(axes, result)
    axes.legend(loc="upper left")
    axes.set_title("Throughput over time")
    _save(figure, path)


def latency_over_time(result: LoadTestResult, path: Path) -> None:
    figure = Figure(figsize=SIZE_IN)
    axes = figure.subplots()
    segments = _segments(result)
    for name, color in PERCENTILE_STYLES:
        _line(axes, segments, _percentile(name), color, name)
    if result.settings.slo_p99_ms is not None:
        axes.axhline(result.settings.slo_p99_ms, color="black", linestyle="--", label="p99 SLO")
    _step_lines(axes, result)
    axes.set_xlabel("time (s)")
    axes.set_ylabel("latency (ms, 10 s window)")
    axes.set_ylim(bottom=0)
    axes.legend(loc="best")
    axes.set_title("Latency over time")
    _save(figure, path)


def against_concurrency(result: LoadTestResult, path: Path) -> None:
    figure = Figure(figsize=(SIZE_IN[0], SIZE_IN[1] * 1.1))
    left, right = figure.subplots(1, 2)
    users = [s.users for s in result.steps]
    left.plot(users, [s.total.ok_rps for s in result.steps], marker="o", label="ok req/s")
    best = result.best
    if best is not None:
        left.plot(
            [best.users],
            [best.total.ok_rps],
            marker="*",
            markersize=16,
            color="gold",
            markeredgecolor="black",
            linestyle="none",
            label="best",
        )
    left.set_xlabel("users (concurrency)")
    left.set_ylabel("requests per second")
    left.set_ylim(bottom=0)
    left.legend(loc="lower right")
    left.set_title("Throughput")
    for name, color in PERCENTILE_STYLES:
        values = [getattr(s.total.latency, f"{name}_ms") for s in result.steps]
        right.plot(
            users,
            [v if v is not None else float("nan") for v in values],
            marker="o",
            color=color,
            label=name,
        )
    if result.settings.slo_p99_ms is not None:
        right.axhline(result.settings.slo_p99_ms, color="black", linestyle="--", label="p99 SLO")
    right.set_xlabel("users (concurrency)")
    right.set_ylabel("latency (ms)")
    right.set_ylim(bottom=0)
    right.legend(loc="best")
    right.set_title("Latency")
    _save(figure, path)


def errors_by_status(result: LoadTestResult, path: Path) -> None:
    figure = Figure(figsize=SIZE_IN)
    axes = figure.subplots()
    totals: dict[str, int] = {}
    for step in result.steps:
        for status, count in step.errors.items():
            totals[status] = totals.get(status, 0) + count
        if step.exceptions:
            totals["exception"] = totals.get("exception", 0) + step.exceptions
    if not totals:
        _placeholder(axes, "no failed requests")
    else:
        statuses = sorted(totals, key=lambda s: -totals[s])
        colors = ["tab:orange" if is_expected(s) else "tab:red" for s in statuses]
        axes.barh(statuses, [totals[s] for s in statuses], color=colors)
        axes.invert_yaxis()
        axes.set_xlabel("failed requests (orange: backpressure, red: unexpected)")
    axes.set_title("Errors by status")
    _save(figure, path)


def _histogram_bars(axes: Axes, histogram: Histogram | None, scale: float, unit: str) -> None:
    if histogram is None:
        _placeholder(axes, "not exported by the server")
        return
    if histogram.count <= 0:
        _placeholder(axes, "no observations")
        return
    counts = histogram.per_bucket()
    # Servers export wide bucket ranges (batch sizes up to 1024): end after the last used one.
    used = max(i for i, count in enumerate(counts) if count > 0) + 1
    labels = [f"≤{bound * scale:g}" for bound in histogram.bounds]
    labels.append(f">{histogram.bounds[-1] * scale:g}" if histogram.bounds else "all")
    axes.bar(range(used), counts[:used], color="tab:blue")
    axes.set_xticks(range(used), labels[:used], rotation=45, ha="right", fontsize=8)
    axes.set_xlabel(unit)
    axes.set_ylabel("count")


def batch_size_distribution(result: LoadTestResult, path: Path) -> None:
    figure = Figure(figsize=SIZE_IN)
    axes = figure.subplots()
    _histogram_bars(
        axes, result.server.batch_size if result.server else None, 1.0, "rows per batch"
    )
    axes.set_title("Server: batch size (rows per execution)")
    _save(figure, path)


def queue_wait_distribution(result: LoadTestResult, path: Path) -> None:
    figure = Figure(figsize=SIZE_IN)
    axes = figure.subplots()
    histogram = result.server.queue_wait_s if result.server else None
    _histogram_bars(axes, histogram, 1000.0, "queue wait (ms)")
    axes.set_title("Server: queue wait")
    _save(figure, path)


def cache_note(result: LoadTestResult) -> str | None:
    """What the cache plot shows instead of bars, when there is nothing to draw."""
    servers = [step.server for step in result.steps if step.server is not None]
    if any(server.cache_hit_ratio is not None for server in servers):
        return None
    if any(server.cache_hits is not None and server.cache_misses is not None for server in servers):
        return "no cache lookups (is the model's result cache enabled?)"
    return "cache counters not exported by the server"


def cache_hit_ratio(result: LoadTestResult, path: Path) -> None:
    figure = Figure(figsize=SIZE_IN)
    axes = figure.subplots()
    ratios = [s.server.cache_hit_ratio if s.server else None for s in result.steps]
    note = cache_note(result)
    if note is not None:
        _placeholder(axes, note)
    else:
        labels = [f"{s.users} users" for s in result.steps]
        axes.bar(labels, [r if r is not None else 0.0 for r in ratios], color="tab:purple")
        axes.axhline(
            result.settings.cache_hit_fraction,
            color="black",
            linestyle="--",
            label="repeated-input fraction sent",
        )
        axes.set_ylim(0, 1)
        axes.set_ylabel("hits / lookups")
        axes.legend(loc="upper right")
    axes.set_title("Server: cache-hit ratio per step")
    _save(figure, path)


PLOTS: Sequence[tuple[Plot, Callable[[LoadTestResult, Path], None]]] = (
    (Plot("throughput_over_time.png", "Throughput over time"), throughput_over_time),
    (Plot("latency_over_time.png", "Latency over time"), latency_over_time),
    (Plot("concurrency.png", "Throughput and latency against concurrency"), against_concurrency),
    (Plot("errors.png", "Errors by status"), errors_by_status),
    (Plot("batch_size.png", "Server-side batch size"), batch_size_distribution),
    (Plot("queue_wait.png", "Server-side queue wait"), queue_wait_distribution),
    (Plot("cache_hit_ratio.png", "Cache-hit ratio"), cache_hit_ratio),
)


def draw_all(result: LoadTestResult, folder: Path) -> list[Plot]:
    """Write every plot into `folder`; returns them in report order."""
    folder.mkdir(parents=True, exist_ok=True)
    drawn = []
    for plot, draw in PLOTS:
        draw(result, folder / plot.filename)
        drawn.append(plot)
    return drawn
