from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.redis_proxy import HoldingProxy


class FakeClock:
    """A clock that moves only when told: `clock()` reads it, `clock.advance(s)` moves it."""

    def __init__(self, start: float) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    """A monotonic-style clock starting at 1000 s."""
    return FakeClock(1000.0)


@pytest.fixture
def wall_clock() -> FakeClock:
    """A Unix clock at 2025-03-15T12:00:00Z."""
    return FakeClock(1_742_040_000.0)


@pytest.fixture
async def proxy(redis_url: str) -> AsyncIterator[HoldingProxy]:
    """A HoldingProxy to the session's redis-server."""
    held = HoldingProxy(redis_url)
    await held.start()
    yield held
    await held.close()
