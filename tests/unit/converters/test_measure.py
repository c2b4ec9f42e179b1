from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pytest

from converters.measure import Timing, measure, speedups


class FakeClock:
    """`time` as converters.measure uses it: perf_counter, moved on by the runners."""

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


def test_measure_alternates_runners_and_times_the_requested_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A clock that moves only when a runner runs (1 ms a source run, 4 ms a converted one, and
    # one converted run in three 10 ms slower): the figures are exact, whatever the machine's
    # load (timed for real, one pause of the process had broken the mean-based throughput).
    clock = FakeClock()
    monkeypatch.setattr("converters.measure.time", clock)
    first, second = CountingRunner(clock, [0.001]), CountingRunner(clock, [0.004, 0.004, 0.014])
    feeds = {"x": np.random.default_rng(0).standard_normal((4, 1000))}
    source, converted = measure([("source", first), ("converted", second)], feeds, 4, 30)
    assert first.calls == second.calls == 33  # 3 warm-up runs, then 30 timed
    assert (source.model, converted.model) == ("source", "converted")
    assert (converted.batch, converted.iterations) == (4, 30)
    assert (source.p50_ms, converted.p50_ms) == (pytest.approx(1.0), pytest.approx(4.0))
    # rows per second over all the timed runs: 4 rows a run, 30 runs, 30 ms and 220 ms in all
    assert source.throughput_rows_s == pytest.approx(4 * 30 / 0.030)
    assert converted.throughput_rows_s == pytest.approx(4 * 30 / 0.220)


def test_speedups_divide_converted_by_source_throughput_per_batch() -> None:
    timings = [
        Timing("source", 1, 2.0, 500.0, 10),
        Timing("converted", 1, 1.0, 1000.0, 10),
        Timing("source", 8, 4.0, 2000.0, 10),
        Timing("converted", 8, 4.0, 3000.0, 10),
        Timing("converted", 16, 4.0, 3000.0, 10),
    ]
    assert speedups(timings) == {1: 2.0, 8: 1.5}
