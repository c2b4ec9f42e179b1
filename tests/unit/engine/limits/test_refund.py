"""Refunds (`LimitBackend.refund`, `Admission.refund`): units an admission charged but did not
use come back, never past a bucket's burst, never below a zero quota, never into a window other
than the one charged; the memory and Redis backends agree, and garbage stored in Redis is
repaired, not trusted."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from engine.limits import Limiter
from engine.limits.local import MemoryBackend
from engine.limits.plan import Check, LimitBackend
from engine.limits.redis_backend import RedisBackend
from engine.settings import RateLimitSettings
from tests.unit.engine.limits.test_redis_backend import Clock

BUCKET = Check("bucket", None, rate_per_s=0.001, burst=10.0)
DAY = Check("day", None, limit=20)
START = 1_742_040_000.0  # 2025-03-15T12:00:00Z


@pytest.fixture(params=["memory", "redis"])
async def backend(request: pytest.FixtureRequest, redis_url: str) -> AsyncIterator[LimitBackend]:
    clock = Clock(START)
    if request.param == "memory":
        yield MemoryBackend(clock=clock, wall_clock=clock)
        return
    made = RedisBackend(redis_url, namespace=f"t{uuid.uuid4().hex[:12]}", now_us=clock.micros)
    yield made
    await made.aclose()


async def levels(backend: LimitBackend, tenant: str = "acme") -> list[float]:
    outcome = await backend.apply(tenant, [BUCKET, DAY], 0, commit=False)
    return [level.level for level in outcome.levels]


async def test_a_refund_gives_back_what_was_not_used(backend: LimitBackend) -> None:
    charged = await backend.apply("acme", [BUCKET, DAY], 8, commit=True)
    assert charged.allowed
    await backend.refund("acme", [BUCKET, DAY], 5, charged.now_unix_s)
    assert await levels(backend) == pytest.approx([7.0, 3.0])  # 10 - 8 + 5 tokens; 8 - 5 used


async def test_a_refund_never_passes_the_burst_or_goes_below_zero(backend: LimitBackend) -> None:
    charged = await backend.apply("acme", [BUCKET, DAY], 2, commit=True)
    await backend.refund("acme", [BUCKET, DAY], 50, charged.now_unix_s)
    assert await levels(backend) == pytest.approx([10.0, 0.0])
    assert (await backend.apply("acme", [BUCKET, DAY], 10, commit=True)).allowed
    assert not (await backend.apply("acme", [BUCKET, DAY], 1, commit=True)).allowed


async def test_a_refund_does_not_credit_another_window(backend: LimitBackend) -> None:
    yesterday = START - 86_400
    assert (await backend.apply("acme", [DAY], 6, commit=True)).allowed
    await backend.refund("acme", [DAY], 6, yesterday)  # charged in a window that has ended
    assert (await levels(backend))[1] == 6.0


async def test_refunding_an_untouched_tenant_changes_nothing(backend: LimitBackend) -> None:
    await backend.refund("nobody", [BUCKET, DAY], 4, START)
    assert await levels(backend, "nobody") == pytest.approx([10.0, 0.0])


async def test_a_planted_counter_is_repaired_not_credited(redis_url: str) -> None:
    clock = Clock(START)
    backend = RedisBackend(redis_url, namespace=f"t{uuid.uuid4().hex[:12]}", now_us=clock.micros)
    client = Redis.from_url(redis_url)
    try:
        await client.hset(backend.key("acme", DAY), mapping={"window": "nan", "used": "-5"})
        await backend.refund("acme", [DAY], 3, START)
        assert await client.exists(backend.key("acme", DAY)) == 0
        assert (await levels(backend))[1] == 0.0
    finally:
        await client.aclose()
        await backend.aclose()


async def test_an_admission_refunds_once_and_at_most_its_charge() -> None:
    settings = RateLimitSettings.model_validate(
        {"unit": "tokens", "default": {"quota_per_day": 20}}
    )
    limiter = Limiter(settings)
    admission = await limiter.admit("acme", "m", 12)
    assert admission.charged == 12
    await admission.refund(30)  # more than was charged: only the 12 come back
    await admission.refund(12)  # a second refund does nothing
    usage = await limiter.usage("acme")
    assert usage["day"]["used"] == 0
    again = await limiter.admit("acme", "m", 20)
    await again.refund(5)
    assert (await limiter.usage("acme"))["day"]["used"] == 15
