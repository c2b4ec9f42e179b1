"""The many-models benchmark's arithmetic (loadtests/benchmarks/many_models.py), apart from any
server: one run's figures from its answers and the server's counters, the targets met or
missed, and the markdown page."""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from loadtests.benchmarks.harness import markdown_table

MB = 1e6
RSS_SLACK = 0.10
"""Peak RSS may pass the idle server's by the budget plus this share of it."""
WARM_P99_RATIO = 1.2
"""Warm p99 may be this many times the all-loaded server's."""


@dataclass(frozen=True, slots=True)
class Answer:
    """One request: its model, HTTP status ("error" for a transport error, "unanswered" when
    still open at the drain bound) and seconds from its scheduled send time to its answer."""

    model: str
    status: str
    latency_s: float


def quantile(values: Sequence[float], q: float) -> float:
    """The `q` quantile of `values` (nearest rank, as open_loop's); NaN for none."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def split_cold(
    answers: Sequence[Answer], loads: Mapping[str, int]
) -> tuple[dict[str, list[float]], list[float]]:
    """(each model's cold latencies, every warm latency) of the answered (200) requests. The
    server counts each model's loads, not which request paid one: a model's cold starts are
    taken to be its `loads[model]` slowest requests (a load takes longer than any warm answer).
    Requests that shared another request's load count as warm, so the warm tail is if anything
    overstated."""
    by_model: dict[str, list[float]] = defaultdict(list)
    for answer in answers:
        if answer.status == "200":
            by_model[answer.model].append(answer.latency_s)
    cold: dict[str, list[float]] = {}
    warm: list[float] = []
    for model, latencies in by_model.items():
        latencies.sort(reverse=True)
        count = min(loads.get(model, 0), len(latencies))
        if count:
            cold[model] = latencies[:count]
        warm += latencies[count:]
    return cold, warm


def cold_by_size(
    cold: Mapping[str, list[float]], sizes: Mapping[str, int], groups: int = 4
) -> list[dict[str, Any]]:
    """Cold starts of the models in each of `groups` size ranges (the models ordered by their
    measured bytes, cut into groups of as many models): whether a load's time follows its bytes
    (reading and packing weights) or not (a fixed cost a load)."""
    ordered = sorted(sizes, key=sizes.__getitem__)
    rows = []
    for group in range(groups):
        models = ordered[group * len(ordered) // groups : (group + 1) * len(ordered) // groups]
        if not models:
            continue
        latencies = [latency for model in models for latency in cold.get(model, [])]
        rows.append(
            {
                "bytes_low": sizes[models[0]],
                "bytes_high": sizes[models[-1]],
                "cold_starts": len(latencies),
                "p50_ms": quantile(latencies, 0.50) * 1e3,
            }
        )
    return rows


def summarize(
    answers: Sequence[Answer],
    loads: Mapping[str, int],
    evictions: int,
    seconds: float,
    rss: Mapping[str, int],
    sizes: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """One run's figures. `loads`: on-demand loads per requested model during the run (a
    pipeline's own, not its steps'); the hit ratio is the share of requests that needed no load,
    as the offline simulation counts it. `rss`: the server's `idle` and `peak` resident bytes.
    With each model's measured bytes (`sizes`), its cold starts by size as well."""
    cold_per_model, warm = split_cold(answers, loads)
    cold = [latency for latencies in cold_per_model.values() for latency in latencies]
    statuses = Counter(a.status for a in answers)
    requests = len(answers)
    misses = sum(loads.get(model, 0) for model in {a.model for a in answers})
    summary = {
        "requests": requests,
        "hit_ratio": 1 - misses / requests if requests else math.nan,
        "loads": misses,
        "cold_p50_ms": quantile(cold, 0.50) * 1e3,
        "cold_p99_ms": quantile(cold, 0.99) * 1e3,
        "warm_p50_ms": quantile(warm, 0.50) * 1e3,
        "warm_p99_ms": quantile(warm, 0.99) * 1e3,
        "evictions": evictions,
        "evictions_per_s": evictions / seconds,
        "errors": requests - statuses.get("200", 0),
        "statuses": dict(statuses),
        "idle_rss_bytes": rss["idle"],
        "peak_rss_bytes": rss["peak"],
    }
    if sizes is not None:
        summary["cold_by_size"] = cold_by_size(cold_per_model, sizes)
    return summary


def targets(report: Mapping[str, Any]) -> list[tuple[str, bool, str]]:
    """(target, met, the figures) of the on-demand (LRU by bytes) run against the budget, the
    offline LRU-by-bytes simulation, the LRU-by-count run and the all-loaded run."""
    runs, budget = report["runs"], report["budget_bytes"]
    ours = runs["lru_bytes"]
    above = ours["peak_rss_bytes"] - ours["idle_rss_bytes"]
    allowed = budget * (1 + RSS_SLACK)
    simulated = report["simulation"]["lru_bytes"]["hit_ratio"]
    rows = [
        (
            f"peak RSS above idle <= budget + {RSS_SLACK:.0%}",
            above <= allowed,
            f"{above / MB:,.0f} MB vs {allowed / MB:,.0f} MB",
        ),
        ("0 errors", ours["errors"] == 0, f"{ours['errors']} errors"),
        (
            "hit ratio >= offline LRU by bytes",
            ours["hit_ratio"] >= simulated,
            f"{ours['hit_ratio']:.3f} vs {simulated:.3f}",
        ),
    ]
    if "lru_count" in runs:
        counted = runs["lru_count"]["hit_ratio"]
        rows.append(
            (
                "hit ratio > LRU by count",
                ours["hit_ratio"] > counted,
                f"{ours['hit_ratio']:.3f} vs {counted:.3f}",
            )
        )
    if "all_loaded" in runs:
        limit = runs["all_loaded"]["warm_p99_ms"] * WARM_P99_RATIO
        rows.append(
            (
                f"warm p99 <= {WARM_P99_RATIO}x all-loaded",
                ours["warm_p99_ms"] <= limit,
                f"{ours['warm_p99_ms']:.1f} ms vs {limit:.1f} ms",
            )
        )
    return rows


RUN_NAMES = {
    "all_loaded": "all loaded (mode none)",
    "lru_bytes": "on_demand, LRU by bytes",
    "lru_count": "on_demand, LRU by count",
}


def shown(value: float, digits: int) -> str:
    """`value` with `digits` decimals, "-" where there was nothing to measure (NaN)."""
    return "-" if math.isnan(value) else f"{value:.{digits}f}"


def table(report: Mapping[str, Any]) -> str:
    """The results page: the runs, the offline simulation of the same trace, the targets."""
    plan, budget = report["plan"], report["budget_bytes"]
    lines = [
        "# Many-models benchmark",
        "",
        f"Command: `{report['command']}`; {report['machine']}. {plan['models']} MLPs of "
        f"{plan['low'] / MB:g}-{plan['high'] / MB:g} MB of weights and {plan['pipelines']} "
        f"two-step pipelines ({report['repository_bytes'] / MB:,.0f} MB measured loaded); "
        f"budget {budget / MB:,.0f} MB ({report['budget_share']:.0%}); LRU by count holds "
        f"{report['max_models']} models and the same byte budget. Zipf s={report['zipf']}, "
        f"{report['rate_rps']:g} req/s (Poisson) for {report['seconds']:g} s, JSON over HTTP.",
        "",
    ]
    cells = []
    for key, run in report["runs"].items():
        cells.append(
            [
                RUN_NAMES[key],
                f"{run['hit_ratio']:.3f}",
                f"{shown(run['cold_p50_ms'], 0)} / {shown(run['cold_p99_ms'], 0)}",
                shown(run.get("server_cold_mean_ms", math.nan), 0),
                f"{shown(run['warm_p50_ms'], 1)} / {shown(run['warm_p99_ms'], 1)}",
                f"{run['evictions_per_s']:.2f}",
                f"{run['idle_rss_bytes'] / MB:,.0f}",
                f"{run['peak_rss_bytes'] / MB:,.0f}",
                run["errors"],
            ]
        )
    lines += markdown_table(
        [
            "server",
            "hit ratio",
            "cold start p50 / p99 ms",
            "load mean ms (server)",
            "warm p50 / p99 ms",
            "evictions/s",
            "idle RSS MB",
            "peak RSS MB",
            "errors",
        ],
        cells,
    )
    lines += [
        "",
        "Cold start: from the request's send time to its answer (the load, warm-up and first "
        "answer), a model's slowest requests as many as its loads; load mean: the server's "
        "sluice_model_cold_start_seconds (a request finding its model cold to the model "
        "serving); warm: the others. Evictions "
        "count every model unloaded, pipelines' steps included.",
    ]
    by_size = report["runs"].get("lru_bytes", {}).get("cold_by_size", [])
    if by_size:
        lines += ["", "Cold starts of the LRU-by-bytes run by the models' measured size:", ""]
        lines += markdown_table(
            ["models of", "cold starts", "p50 ms"],
            [
                [
                    f"{r['bytes_low'] / MB:.1f}-{r['bytes_high'] / MB:.1f} MB",
                    r["cold_starts"],
                    shown(r["p50_ms"], 0),
                ]
                for r in by_size
            ],
        )
    lines += ["", "Offline simulation of the same trace with the measured sizes:", ""]
    lines += markdown_table(
        ["rule", "hit ratio", "evictions", "MB loaded"],
        [
            [rule, f"{o['hit_ratio']:.3f}", o["evictions"], f"{o['loaded_bytes'] / MB:,.0f}"]
            for rule, o in report["simulation"].items()
        ],
    )
    lines += ["", "Targets (the on_demand LRU-by-bytes run):", ""]
    lines += markdown_table(
        ["target", "met", "figures"],
        [[name, "met" if met else "MISSED", figures] for name, met, figures in targets(report)],
    )
    return "\n".join(lines) + "\n"
