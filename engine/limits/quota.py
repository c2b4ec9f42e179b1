"""Quota windows: the UTC day and the UTC month a moment falls in, and the quota arithmetic.

A quota counts units used in the current window and resets when the window ends. Windows are
identified by integers so a stored counter from an older window is recognised and ignored:
the day number since 1970-01-01, and `year * 12 + month - 1`. The Lua script computes the same
numbers from Redis `TIME` (`civil_from_days` there mirrors `datetime` here); a test keeps them
in step.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal

QuotaPeriod = Literal["day", "month"]

SECONDS_PER_DAY = 86_400


@dataclass(frozen=True, slots=True)
class Window:
    """One quota window: its id and its bounds in Unix seconds (end exclusive)."""

    id: int
    start_s: float
    end_s: float


@dataclass(frozen=True, slots=True)
class QuotaState:
    """A stored quota counter: units used in window `window_id`."""

    window_id: int
    used: int


def day_window(now_unix_s: float) -> Window:
    """The UTC day containing `now_unix_s`."""
    day = int(now_unix_s // SECONDS_PER_DAY)
    return Window(day, day * SECONDS_PER_DAY, (day + 1) * SECONDS_PER_DAY)


def month_window(now_unix_s: float) -> Window:
    """The UTC month containing `now_unix_s`."""
    moment = datetime.fromtimestamp(now_unix_s, UTC)
    start = datetime(moment.year, moment.month, 1, tzinfo=UTC)
    if moment.month == 12:
        end = datetime(moment.year + 1, 1, 1, tzinfo=UTC)
    else:
        end = datetime(moment.year, moment.month + 1, 1, tzinfo=UTC)
    return Window(moment.year * 12 + moment.month - 1, start.timestamp(), end.timestamp())


def window(period: QuotaPeriod, now_unix_s: float) -> Window:
    """The window of `period` containing `now_unix_s`."""
    return day_window(now_unix_s) if period == "day" else month_window(now_unix_s)


def used_in(state: QuotaState | None, current: Window) -> int:
    """Units used in `current`: a counter from an earlier window counts as zero."""
    if state is None or state.window_id != current.id:
        return 0
    return state.used


def passes(used: int, units: int, limit: int) -> bool:
    """Whether `units` more fit under `limit` when `used` are already spent."""
    return used + units <= limit


def iso_utc(unix_s: float) -> str:
    """`2025-03-01T00:00:00Z` for a Unix time, as the usage endpoint and messages show it."""
    return datetime.fromtimestamp(unix_s, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
