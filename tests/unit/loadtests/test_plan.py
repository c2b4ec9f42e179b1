from __future__ import annotations

import pytest

from loadtests.plan import best_step, meets_slo, parse_ramp
from tests.unit.loadtests.samples import step


@pytest.mark.parametrize(
    ("text", "users"),
    [
        ("4:16:4", [4, 8, 12, 16]),
        ("1:10:4", [1, 5, 9]),
        ("3:3:1", [3]),
        ("1:64:x2", [1, 2, 4, 8, 16, 32, 64]),
        ("1:10:x1.5", [1, 2, 3, 4, 6, 9]),
    ],
)
def test_parse_ramp(text: str, users: list[int]) -> None:
    assert parse_ramp(text) == users


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("4:16", "is not START:STOP:STEP"),
        ("a:16:4", "START and STOP must be whole numbers"),
        ("0:16:4", "need 1 <= START <= STOP, got START=0 STOP=16"),
        ("8:4:1", "need 1 <= START <= STOP, got START=8 STOP=4"),
        ("1:8:0", "STEP must be >= 1, got 0"),
        ("1:8:x1", "a multiplying STEP must be > 1, got x1"),
        ("1:1000:1", "more than 100 steps"),
    ],
)
def test_bad_ramps_say_why(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_ramp(text)


def test_meets_slo_needs_latency_few_errors_and_goodput() -> None:
    assert meets_slo(step(0, 1, 100.0, 10.0), 10.0, 0.01)
    assert not meets_slo(step(0, 1, 100.0, 10.5), 10.0, 0.01)
    assert not meets_slo(step(0, 1, 100.0, 1.0, failures=20), 10.0, 0.01)  # 2% failed
    assert meets_slo(step(0, 1, 100.0, 1.0, failures=20), 10.0, 0.05)
    assert not meets_slo(step(0, 1, 100.0, None), 10.0, 0.01)


def test_best_step_with_an_slo_takes_the_highest_goodput_within_it() -> None:
    steps = [
        step(0, 1, 100.0, 5.0),
        step(1, 2, 300.0, 9.0),
        step(2, 4, 250.0, 8.0),
        step(3, 8, 500.0, 30.0),
    ]
    best, verdict = best_step(steps, 10.0, 0.01)
    assert verdict == "pass"
    assert best is not None
    assert best.users == 2


def test_best_step_fails_when_no_step_meets_the_slo() -> None:
    assert best_step([step(0, 1, 100.0, 50.0)], 10.0, 0.01) == (None, "fail")
    assert best_step([], 10.0, 0.01) == (None, "fail")


def test_without_an_slo_the_highest_goodput_wins() -> None:
    steps = [step(0, 1, 100.0, 5.0), step(1, 2, 300.0, 900.0)]
    best, verdict = best_step(steps, None, 0.01)
    assert verdict == "no_slo"
    assert best is not None
    assert best.users == 2
    assert best_step([], None, 0.01) == (None, "no_slo")
