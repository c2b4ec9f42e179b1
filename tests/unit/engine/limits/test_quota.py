from __future__ import annotations

from datetime import UTC, datetime

import pytest

from engine.limits.quota import (
    QuotaState,
    day_window,
    iso_utc,
    month_window,
    passes,
    used_in,
    window,
)


def ts(text: str) -> float:
    return datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp()


def test_day_window_bounds_and_id() -> None:
    current = day_window(ts("2025-03-15T23:59:59.5"))
    assert current.id == 20162
    assert current.start_s == ts("2025-03-15T00:00:00")
    assert current.end_s == ts("2025-03-16T00:00:00")


def test_day_window_starts_at_midnight() -> None:
    assert day_window(ts("2025-03-16T00:00:00")).id == 20163


@pytest.mark.parametrize(
    ("moment", "start", "end", "window_id"),
    [
        ("2025-03-15T12:00:00", "2025-03-01", "2025-04-01", 2025 * 12 + 2),
        ("2025-12-31T23:59:59", "2025-12-01", "2026-01-01", 2025 * 12 + 11),
        ("2024-02-29T08:00:00", "2024-02-01", "2024-03-01", 2024 * 12 + 1),
        ("2026-01-01T00:00:00", "2026-01-01", "2026-02-01", 2026 * 12),
    ],
)
def test_month_window(moment: str, start: str, end: str, window_id: int) -> None:
    current = month_window(ts(moment))
    assert (current.id, current.start_s, current.end_s) == (window_id, ts(start), ts(end))


def test_window_dispatches_on_period() -> None:
    now = ts("2025-03-15T12:00:00")
    assert window("day", now) == day_window(now)
    assert window("month", now) == month_window(now)


def test_counter_from_an_older_window_counts_as_zero() -> None:
    current = day_window(ts("2025-03-15T12:00:00"))
    assert used_in(QuotaState(current.id, 7), current) == 7
    assert used_in(QuotaState(current.id - 1, 7), current) == 0
    assert used_in(None, current) == 0


def test_passes_up_to_the_limit_inclusive() -> None:
    assert passes(used=8, units=2, limit=10) is True
    assert passes(used=9, units=2, limit=10) is False


def test_iso_utc() -> None:
    assert iso_utc(ts("2025-04-01T00:00:00")) == "2025-04-01T00:00:00Z"
