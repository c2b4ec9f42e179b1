from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pytest

from converters.measure import Timing, measure, speedups


class CountingRunner:
    def __init__(self) -> None:
        self.output_names = ["y"]
        self.calls = 0

    def run(self, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        self.calls += 1
        return [np.sort(feeds["x"], axis=None)]


def test_measure_alternates_runners_and_times_the_requested_runs() -> None:
    first, second = CountingRunner(), CountingRunner()
    feeds = {"x": np.random.default_rng(0).standard_normal((4, 1000))}
    source, converted = measure([("source", first), ("converted", second)], feeds, 4, 30)
    assert first.calls == second.calls == 33  # 3 warm-up runs, then 30 timed
    assert (source.model, converted.model) == ("source", "converted")
    assert (converted.batch, converted.iterations) == (4, 30)
    assert converted.p50_ms > 0
    # rows per second from the same runs: about batch / median latency
    assert converted.throughput_rows_s == pytest.approx(4 / (converted.p50_ms / 1000), rel=0.9)


def test_speedups_divide_converted_by_source_throughput_per_batch() -> None:
    timings = [
        Timing("source", 1, 2.0, 500.0, 10),
        Timing("converted", 1, 1.0, 1000.0, 10),
        Timing("source", 8, 4.0, 2000.0, 10),
        Timing("converted", 8, 4.0, 3000.0, 10),
        Timing("converted", 16, 4.0, 3000.0, 10),
    ]
    assert speedups(timings) == {1: 2.0, 8: 1.5}
