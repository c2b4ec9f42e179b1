"""Latency and throughput of the source and the converted model on this machine: sequential
runs of one batch on the same number of threads for both, after a short warm-up, up to a number
of runs and within a time bound per batch size.

The two models' runs alternate, so a burst of load from elsewhere on a shared machine slows both
alike instead of skewing the ratio between them."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
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


MEASURE_SECONDS = 10.0
"""Default time bound of one batch size's measurement, both models and the warm-up included: a
large model at a large batch (all-MiniLM-L6-v2 at 32 texts takes seconds a run on one thread)
would otherwise spend minutes on 50 runs."""
MIN_RUNS = 3
"""Timed runs each model makes whatever the time bound (a median needs a few), unless the
number of runs asked for is lower."""
WARMUP_SHARE = 0.1
"""Warm-up runs after the first stop once this share of the time bound is spent."""


def measure(
    runners: Sequence[tuple[str, Runner]],
    feeds: Mapping[str, np.ndarray],
    batch: int,
    iterations: int,
    seconds: float = MEASURE_SECONDS,
    clock: Callable[[], float] = time.perf_counter,
) -> list[Timing]:
    """Time up to `iterations` runs of `feeds` (a batch of `batch` rows) on each labelled runner,
    and stop early once `seconds` have passed since this batch size's warm-up began and each
    runner has made MIN_RUNS timed runs. `clock` (monotonic, like perf_counter) measures the
    durations and the bound; tests pass a fake one."""
    start = clock()
    for warmup in range(max(1, iterations // 10)):
        if warmup and clock() - start > seconds * WARMUP_SHARE:
            break
        for _, runner in runners:
            runner.run(feeds)
    durations: list[list[float]] = [[] for _ in runners]
    runs = 0
    while runs < iterations and (runs < MIN_RUNS or clock() - start < seconds):
        for (_, runner), spent in zip(runners, durations, strict=True):
            began = clock()
            runner.run(feeds)
            spent.append(clock() - began)
        runs += 1
    return [
        Timing(
            model=label,
            batch=batch,
            p50_ms=statistics.median(spent) * 1000.0,
            throughput_rows_s=batch * runs / sum(spent) if sum(spent) > 0 else float("inf"),
            iterations=runs,
        )
        for (label, _), spent in zip(runners, durations, strict=True)
    ]


def runs_note(timings: Sequence[Timing]) -> str:
    """How many timed runs each model made: "20 runs each", or per batch size where they differ
    ("runs each: 50 at batch 1, 4 at batch 32")."""
    runs = {timing.batch: timing.iterations for timing in timings}
    if len(set(runs.values())) == 1:
        return f"{next(iter(runs.values()))} runs each"
    return "runs each: " + ", ".join(f"{n} at batch {b}" for b, n in sorted(runs.items()))


def measure_detail(timings: Sequence[Timing], iterations: int, seconds: float) -> str:
    """The measure step's note: the runs made, and the bounds where they cut runs short."""
    if {timing.iterations for timing in timings} == {iterations}:
        return f"{iterations} runs per model and batch size"
    return f"{runs_note(timings)} (bound: {iterations} runs or {seconds:g} s per batch size)"


def speedups(timings: list[Timing]) -> dict[int, float]:
    """Converted throughput over source throughput, per batch size measured for both."""
    source = {t.batch: t.throughput_rows_s for t in timings if t.model == "source"}
    converted = {t.batch: t.throughput_rows_s for t in timings if t.model == "converted"}
    return {
        batch: converted[batch] / source[batch]
        for batch in sorted(source.keys() & converted.keys())
        if source[batch] > 0
    }
