"""Latency and throughput of the source and the converted model on this machine: sequential
runs of one batch on the same number of threads for both, after a short warm-up.

The two models' runs alternate, so a burst of load from elsewhere on a shared machine slows both
alike instead of skewing the ratio between them."""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from converters.runners import Runner


@dataclass(frozen=True)
class Timing:
    """One measurement: which model, the batch size, median latency and rows per second."""

    model: str
    batch: int
    p50_ms: float
    throughput_rows_s: float
    iterations: int


def measure(
    runners: Sequence[tuple[str, Runner]],
    feeds: Mapping[str, np.ndarray],
    batch: int,
    iterations: int,
) -> list[Timing]:
    """Time `iterations` runs of `feeds` (a batch of `batch` rows) on each labelled runner."""
    for _ in range(max(1, iterations // 10)):
        for _, runner in runners:
            runner.run(feeds)
    durations: list[list[float]] = [[] for _ in runners]
    for _ in range(iterations):
        for (_, runner), spent in zip(runners, durations, strict=True):
            # perf_counter measures durations; no deadline depends on it.
            start = time.perf_counter()
            runner.run(feeds)
            spent.append(time.perf_counter() - start)
    return [
        Timing(
            model=label,
            batch=batch,
            p50_ms=statistics.median(spent) * 1000.0,
            throughput_rows_s=batch * iterations / sum(spent) if sum(spent) > 0 else float("inf"),
            iterations=iterations,
        )
        for (label, _), spent in zip(runners, durations, strict=True)
    ]


def speedups(timings: list[Timing]) -> dict[int, float]:
    """Converted throughput over source throughput, per batch size measured for both."""
    source = {t.batch: t.throughput_rows_s for t in timings if t.model == "source"}
    converted = {t.batch: t.throughput_rows_s for t in timings if t.model == "converted"}
    return {
        batch: converted[batch] / source[batch]
        for batch in sorted(source.keys() & converted.keys())
        if source[batch] > 0
    }
