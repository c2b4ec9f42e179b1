"""The exact final statistics of a locust run, written by the locust process as it quits.

locust's `--csv` files are rewritten once a second and not at exit, so their totals can miss the
last second; its `--json` output resets the stats it reads and carries no errors. The user
modules therefore call `install(events)`: at quit the standalone or master process writes
everything the report needs to the file named by `--sluice-summary-file`. The harness reads it
back with `read_summary`.

`install` also refreshes gevent's cached loop time at init. libev timers count from the time
cached at the last loop iteration; the imports before locust's first iteration take about a
second, and without the refresh `--run-time` ends that much early.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtests.failures import status_of
from loadtests.results import Latency, RequestStats

SUMMARY_OPTION = "--sluice-summary-file"
PERCENTILES = {"p50_ms": 0.5, "p95_ms": 0.95, "p99_ms": 0.99, "p999_ms": 0.999}


def install(events: Any) -> None:
    """Register the summary option and the init/quit listeners on locust's `events`."""
    import gevent

    def add_option(parser: Any, **_: Any) -> None:
        parser.add_argument(
            SUMMARY_OPTION,
            default="",
            include_in_web_ui=False,
            help="Write the run's final statistics to this JSON file.",
        )

    def on_init(environment: Any, **_: Any) -> None:
        gevent.get_hub().loop.update_now()

        def on_quit(**_: Any) -> None:
            path = getattr(environment.parsed_options, "sluice_summary_file", "")
            if path and type(environment.runner).__name__ != "WorkerRunner":
                Path(path).write_text(json.dumps(summarize(environment), indent=1))

        environment.events.quit.add_listener(on_quit)

    events.init_command_line_parser.add_listener(add_option)
    events.init.add_listener(on_init)


def _entry(entry: Any) -> dict[str, Any]:
    """A locust StatsEntry as plain data (percentiles computed, nothing reset)."""
    has_samples = entry.num_requests > 0
    percentiles = {
        key: float(entry.get_response_time_percentile(q)) if has_samples else None
        for key, q in PERCENTILES.items()
    }
    return {
        "name": entry.name,
        "requests": entry.num_requests,
        "failures": entry.num_failures,
        "rps": float(entry.total_rps),
        "failures_per_s": float(entry.total_fail_per_sec),
        "latency": {
            **percentiles,
            "avg_ms": float(entry.avg_response_time) if has_samples else None,
            "max_ms": float(entry.max_response_time) if has_samples else None,
        },
    }


def summarize(environment: Any) -> dict[str, Any]:
    """Everything the report needs from a finished locust environment."""
    stats = environment.stats
    runner = environment.runner
    exceptions = getattr(runner, "exceptions", {}) or {}
    cpu_bound = getattr(runner, "cpu_warning_emitted", False) or getattr(
        runner, "worker_cpu_warning_emitted", False
    )
    return {
        "cpu_bound": bool(cpu_bound),
        "total": _entry(stats.total),
        "entries": [_entry(e) for e in stats.entries.values()],
        "errors": [
            {"name": e.name, "error": str(e.parse_error(e.error)), "occurrences": e.occurrences}
            for e in stats.errors.values()
        ],
        "exceptions": [
            {"count": int(x["count"]), "message": str(x["msg"])} for x in exceptions.values()
        ],
    }


@dataclass(frozen=True, slots=True)
class Summary:
    """A step's final statistics."""

    total: RequestStats
    entries: list[RequestStats]
    errors: dict[str, int]
    """Failed requests by status."""
    exceptions: int
    exception_messages: list[str]
    cpu_bound: bool = False
    """locust saw a load-generator process above 90% CPU: the numbers understate the server."""

    @property
    def infer_entries(self) -> list[RequestStats]:
        """The inference request names (one per tenant), without set-up calls."""
        return [entry for entry in self.entries if entry.name.startswith("infer")]


def _stats(raw: dict[str, Any]) -> RequestStats:
    return RequestStats(
        name=str(raw["name"]),
        requests=int(raw["requests"]),
        failures=int(raw["failures"]),
        rps=float(raw["rps"]),
        failures_per_s=float(raw["failures_per_s"]),
        latency=Latency(**raw["latency"]),
    )


def read_summary(path: Path) -> Summary:
    """Read a summary file; FileNotFoundError when locust did not write one."""
    raw = json.loads(path.read_text())
    errors: dict[str, int] = {}
    for error in raw["errors"]:
        status = status_of(error["error"])
        errors[status] = errors.get(status, 0) + int(error["occurrences"])
    return Summary(
        total=_stats(raw["total"]),
        entries=[_stats(e) for e in raw["entries"]],
        errors=errors,
        exceptions=sum(int(x["count"]) for x in raw["exceptions"]),
        exception_messages=[str(x["message"]) for x in raw["exceptions"]],
        cpu_bound=bool(raw.get("cpu_bound", False)),
    )
