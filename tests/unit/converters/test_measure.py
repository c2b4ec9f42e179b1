from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pytest

from converters.cli import convert
from converters.measure import (
    MEASURE_SECONDS,
    MIN_RUNS,
    Timing,
    measure,
    measure_detail,
    runs_note,
    speedups,
)


class FakeClock:
    """A clock for measure(): it moves only when a runner runs."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class CountingRunner:
    """A runner whose runs take, on `clock`, each of `durations` in turn."""

    def __init__(self, clock: FakeClock, durations: list[float]) -> None:
        self.output_names = ["y"]
        self.calls = 0
        self._clock, self._durations = clock, durations

    def run(self, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        self._clock.now += self._durations[self.calls % len(self._durations)]
        self.calls += 1
        return [np.sort(feeds["x"], axis=None)]


FEEDS = {"x": np.random.default_rng(0).standard_normal((4, 1000))}


def test_measure_alternates_runners_and_times_the_requested_runs() -> None:
    # A clock that moves only when a runner runs (1 ms a source run, 4 ms a converted one, and
    # one converted run in three 10 ms slower): the figures are exact, whatever the machine's
    # load (timed for real, one pause of the process had broken the mean-based throughput).
    clock = FakeClock()
    first, second = CountingRunner(clock, [0.001]), CountingRunner(clock, [0.004, 0.004, 0.014])
    runners = [("source", first), ("converted", second)]
    source, converted = measure(runners, FEEDS, 4, 30, clock=clock.perf_counter)
    assert first.calls == second.calls == 33  # 3 warm-up runs, then 30 timed
    assert (source.model, converted.model) == ("source", "converted")
    assert (converted.batch, converted.iterations) == (4, 30)
    assert (source.p50_ms, converted.p50_ms) == (pytest.approx(1.0), pytest.approx(4.0))
    # rows per second over all the timed runs: 4 rows a run, 30 runs, 30 ms and 220 ms in all
    assert source.throughput_rows_s == pytest.approx(4 * 30 / 0.030)
    assert converted.throughput_rows_s == pytest.approx(4 * 30 / 0.220)


def test_measure_stops_a_batch_size_once_its_time_is_spent() -> None:
    # 1 s a source run, 3 s a converted one: 4 s a round against a 20 s bound.
    clock = FakeClock()
    first, second = CountingRunner(clock, [1.0]), CountingRunner(clock, [3.0])
    runners = [("source", first), ("converted", second)]
    source, converted = measure(runners, FEEDS, 32, 50, seconds=20.0, clock=clock.perf_counter)
    # One warm-up round (4 s is past a tenth of the bound, so not the 5 that 50 runs ask for),
    # then timed rounds while under 20 s since the warm-up began: at 4, 8, 12 and 16 s.
    assert first.calls == second.calls == 1 + 4
    assert source.iterations == converted.iterations == 4
    assert clock.now == 20.0
    assert (source.p50_ms, converted.p50_ms) == (1000.0, 3000.0)
    assert converted.throughput_rows_s == pytest.approx(32 * 4 / 12.0)


def test_measure_makes_a_few_runs_even_when_one_outlasts_the_bound() -> None:
    clock = FakeClock()
    first, second = CountingRunner(clock, [5.0]), CountingRunner(clock, [5.0])
    runners = [("source", first), ("converted", second)]
    timings = measure(runners, FEEDS, 1, 50, seconds=1.0, clock=clock.perf_counter)
    assert [t.iterations for t in timings] == [MIN_RUNS, MIN_RUNS]
    assert first.calls == 1 + MIN_RUNS
    # ... unless fewer runs are asked for.
    timings = measure(runners, FEEDS, 1, 2, seconds=1.0, clock=clock.perf_counter)
    assert [t.iterations for t in timings] == [2, 2]


def test_the_report_says_how_many_runs_each_batch_size_got() -> None:
    cut_short = [
        Timing("source", 1, 1.0, 1.0, 50),
        Timing("converted", 1, 1.0, 1.0, 50),
        Timing("source", 32, 9.0, 1.0, 4),
        Timing("converted", 32, 9.0, 1.0, 4),
    ]
    assert runs_note(cut_short) == "runs each: 50 at batch 1, 4 at batch 32"
    assert measure_detail(cut_short, 50, 10.0) == (
        "runs each: 50 at batch 1, 4 at batch 32 (bound: 50 runs or 10 s per batch size)"
    )
    every_run = [Timing("source", 1, 1.0, 1.0, 20), Timing("converted", 1, 1.0, 1.0, 20)]
    assert runs_note(every_run) == "20 runs each"
    assert measure_detail(every_run, 20, 10.0) == "20 runs per model and batch size"
    three = [Timing("source", 1, 1.0, 1.0, 3), Timing("source", 8, 1.0, 1.0, 3)]
    assert measure_detail(three, 50, 2.5) == "3 runs each (bound: 50 runs or 2.5 s per batch size)"


def test_the_command_bounds_measurement_by_the_default_time() -> None:
    [option] = [param for param in convert.params if param.name == "measure_seconds"]
    assert option.default == MEASURE_SECONDS


def test_speedups_divide_converted_by_source_throughput_per_batch() -> None:
    timings = [
        Timing("source", 1, 2.0, 500.0, 10),
        Timing("converted", 1, 1.0, 1000.0, 10),
        Timing("source", 8, 4.0, 2000.0, 10),
        Timing("converted", 8, 4.0, 3000.0, 10),
        Timing("converted", 16, 4.0, 3000.0, 10),
    ]
    assert speedups(timings) == {1: 2.0, 8: 1.5}
