"""Reading locust's per-second history (`--csv PREFIX --csv-full-history`) into a timeline.

locust writes PREFIX_stats_history.csv: one row per second and request name plus an `Aggregated`
row, with percentiles over a sliding window. (The step's totals come from the exact summary that
`locust_summary` writes at quit, not from PREFIX_stats.csv, which can lag by a second.)
"""

from __future__ import annotations

import csv
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from loadtests.results import Latency, TimePoint

AGGREGATED = "Aggregated"


@dataclass(frozen=True, slots=True)
class StepFiles:
    """The CSV files of one locust run."""

    prefix: Path

    @property
    def stats(self) -> Path:
        return self.prefix.with_name(self.prefix.name + "_stats.csv")

    @property
    def history(self) -> Path:
        return self.prefix.with_name(self.prefix.name + "_stats_history.csv")

    @property
    def summary(self) -> Path:
        """Written by `locust_summary` when locust quits."""
        return self.prefix.with_name(self.prefix.name + "_summary.json")


def _rows(path: Path) -> Iterator[dict[str, str]]:
    if not path.exists():
        return
    with path.open(newline="") as handle:
        yield from csv.DictReader(handle)


def _number(text: str | None) -> float | None:
    """A CSV cell as a float; locust writes `N/A` (and empty cells) where it has no samples."""
    if text is None or text.strip() in ("", "N/A"):
        return None
    return float(text)


def _latency(row: dict[str, str], prefix: str = "") -> Latency:
    return Latency(
        p50_ms=_number(row.get("50%")),
        p95_ms=_number(row.get("95%")),
        p99_ms=_number(row.get("99%")),
        p999_ms=_number(row.get("99.9%")),
        avg_ms=_number(row.get(f"{prefix}Average Response Time")),
        max_ms=_number(row.get(f"{prefix}Max Response Time")),
    )


def read_timeline(files: StepFiles, origin: float) -> list[TimePoint]:
    """Per-second points of the `Aggregated` history rows.

    Throughput is the change of the total request count between rows (exact), not locust's
    smoothed `Requests/s`; percentiles are locust's sliding-window ones. `origin` is the Unix time
    the load test started: points are placed at `timestamp - origin`.
    """
    points: list[TimePoint] = []
    previous: tuple[float, float, float] | None = None  # timestamp, requests, failures
    for row in _rows(files.history):
        if row["Name"] != AGGREGATED:
            continue
        stamp = float(row["Timestamp"])
        requests = float(row["Total Request Count"])
        failures = float(row["Total Failure Count"])
        if previous is None:
            previous = (stamp, requests, failures)
            continue
        elapsed = stamp - previous[0]
        if elapsed <= 0:
            continue
        # --reset-stats zeroes the totals once users are spawned: count from zero then.
        done = requests - previous[1] if requests >= previous[1] else requests
        failed = failures - previous[2] if failures >= previous[2] else failures
        previous = (stamp, requests, failures)
        latency = _latency(row)
        if not _number(row.get("100%")):
            # locust writes 0 for every windowed percentile until the window has samples.
            latency = Latency()
        points.append(
            TimePoint(
                t_s=stamp - origin,
                users=int(row["User Count"]),
                rps=done / elapsed,
                failures_per_s=failed / elapsed,
                p50_ms=latency.p50_ms,
                p95_ms=latency.p95_ms,
                p99_ms=latency.p99_ms,
            )
        )
    return points
