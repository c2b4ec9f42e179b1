from __future__ import annotations

import pytest

from engine.limits.bucket import (
    BucketState,
    effective_burst,
    passes,
    refill,
    reset_after_s,
    retry_after_s,
    whole_seconds,
)


def test_missing_bucket_is_full() -> None:
    assert refill(None, 5.0, rate_per_s=2.0, burst=3.0) == 3.0


def test_refill_adds_rate_times_elapsed() -> None:
    assert refill(BucketState(0.5, 10.0), 10.25, rate_per_s=2.0, burst=3.0) == 1.0


def test_refill_is_capped_at_burst() -> None:
    assert refill(BucketState(1.0, 10.0), 20.0, rate_per_s=2.0, burst=3.0) == 3.0


def test_clock_going_backwards_adds_nothing() -> None:
    assert refill(BucketState(1.0, 10.0), 9.0, rate_per_s=2.0, burst=3.0) == 1.0


@pytest.mark.parametrize(
    ("tokens", "units", "expected"), [(1.0, 1, True), (0.999, 1, False), (5.0, 5, True)]
)
def test_passes_needs_enough_tokens(tokens: float, units: int, expected: bool) -> None:
    assert passes(tokens, units) is expected


def test_retry_after_is_time_to_missing_tokens() -> None:
    assert retry_after_s(0.5, 2, rate_per_s=4.0) == 0.375
    assert retry_after_s(3.0, 2, rate_per_s=4.0) == 0.0


def test_reset_after_is_time_to_full() -> None:
    assert reset_after_s(1.0, 3.0, rate_per_s=4.0) == 0.5
    assert reset_after_s(3.0, 3.0, rate_per_s=4.0) == 0.0


@pytest.mark.parametrize(
    ("rate", "burst", "expected"), [(50.0, None, 50.0), (0.2, None, 1.0), (5.0, 12.0, 12.0)]
)
def test_effective_burst_defaults_to_one_second_of_rate(
    rate: float, burst: float | None, expected: float
) -> None:
    assert effective_burst(rate, burst) == expected


@pytest.mark.parametrize(
    ("seconds", "expected"),
    [(0.0, 0), (0.001, 1), (1.0, 1), (2.0000000000000004, 2), (2.0000011, 3), (59.5, 60)],
)
def test_whole_seconds_rounds_up_ignoring_float_noise(seconds: float, expected: int) -> None:
    assert whole_seconds(seconds) == expected
