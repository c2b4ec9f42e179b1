from __future__ import annotations

import asyncio
from typing import Any

import pytest

from engine.errors import InvalidInput, Overloaded, QuotaExceeded, RateLimited
from engine.limits import Limiter, MemoryBackend, build_limiter
from engine.limits.plan import BackendUnavailable, Check, Outcome
from engine.settings import RateLimitSettings, SettingsError


def make(clock, wall_clock, **settings: Any) -> Limiter:
    return Limiter(
        RateLimitSettings.model_validate(settings),
        local=MemoryBackend(clock=clock, wall_clock=wall_clock),
        clock=clock,
    )


async def test_burst_then_exact_retry_after(clock, wall_clock) -> None:
    limiter = make(clock, wall_clock, tenants={"acme": {"rate_per_s": 4, "burst": 2}})
    first = await limiter.admit("acme", "m")
    assert first.headers == {
        "X-RateLimit-Limit": "2",
        "X-RateLimit-Remaining": "1",
        "X-RateLimit-Reset": "1",
    }
    await limiter.admit("acme", "m")
    clock.advance(0.1)
    with pytest.raises(RateLimited) as caught:
        await limiter.admit("acme", "m")
    assert caught.value.retry_after_s == 0.15
    assert caught.value.retry_after_header == "1"
    assert caught.value.headers["X-RateLimit-Remaining"] == "0"
    clock.advance(0.15)
    await limiter.admit("acme", "m")
    assert limiter.counters.rejections == {("acme", "rate"): 1}


async def test_rows_unit_charges_the_batch_size(clock, wall_clock) -> None:
    limiter = make(
        clock, wall_clock, unit="rows", tenants={"acme": {"rate_per_s": 10, "burst": 10}}
    )
    admission = await limiter.admit("acme", "m", rows=8)
    assert admission.headers["X-RateLimit-Remaining"] == "2"
    with pytest.raises(RateLimited) as caught:
        await limiter.admit("acme", "m", rows=4)
    assert caught.value.retry_after_s == 0.2
    with pytest.raises(InvalidInput, match="request of 11 rows exceeds tenant 'acme''s burst"):
        await limiter.admit("acme", "m", rows=11)
    assert limiter.counters.rejections[("acme", "too_large")] == 1


async def test_requests_unit_ignores_rows(clock, wall_clock) -> None:
    limiter = make(clock, wall_clock, tenants={"acme": {"rate_per_s": 1, "burst": 2}})
    admission = await limiter.admit("acme", "m", rows=64)
    assert admission.headers["X-RateLimit-Remaining"] == "1"


async def test_daily_quota_has_its_own_error(clock, wall_clock) -> None:
    limiter = make(clock, wall_clock, tenants={"acme": {"quota_per_day": 2}})
    await limiter.admit("acme", "m")
    await limiter.admit("acme", "m")
    with pytest.raises(QuotaExceeded) as caught:
        await limiter.admit("acme", "m")
    assert caught.value.message == (
        "tenant 'acme' used its daily quota of 2 requests (2 used); "
        "it resets at 2025-03-16T00:00:00Z"
    )
    assert caught.value.retry_after_s == 12 * 3600
    assert limiter.counters.rejections == {("acme", "quota_day"): 1}
    wall_clock.advance(12 * 3600)
    await limiter.admit("acme", "m")


async def test_per_model_limit_applies_on_top_of_the_tenant_one(clock, wall_clock) -> None:
    tenants = {"acme": {"rate_per_s": 100, "models": {"resnet": {"rate_per_s": 1}}}}
    limiter = make(clock, wall_clock, tenants=tenants)
    await limiter.admit("acme", "resnet")
    with pytest.raises(RateLimited, match="tenant 'acme' on model 'resnet' is over"):
        await limiter.admit("acme", "resnet")
    for _ in range(5):
        await limiter.admit("acme", "bert")


async def test_unlisted_tenants_get_the_defaults(clock, wall_clock) -> None:
    limiter = make(clock, wall_clock, default={"rate_per_s": 1})
    await limiter.admit("anonymous", "m")
    with pytest.raises(RateLimited, match="tenant 'anonymous'"):
        await limiter.admit("anonymous", "m")


async def test_unlimited_tenant_admits_with_no_headers(clock, wall_clock) -> None:
    limiter = make(clock, wall_clock, tenants={"acme": {"priority": 3}})
    admission = await limiter.admit("acme", "m", rows=10_000)
    assert (admission.headers, admission.priority) == ({}, 3)


async def test_concurrency_cap_and_release(clock, wall_clock) -> None:
    limiter = make(clock, wall_clock, tenants={"acme": {"max_concurrent": 2}})
    first = await limiter.admit("acme", "m")
    second = await limiter.admit("acme", "m")
    with pytest.raises(RateLimited, match="already has 2 requests in flight"):
        await limiter.admit("acme", "m")
    first.release()
    first.release()  # twice is harmless: must not free the other request's slot
    assert limiter.in_flight("acme") == 1
    with second:
        pass
    assert limiter.in_flight("acme") == 0
    assert limiter.counters.rejections == {("acme", "concurrency"): 1}


async def test_slot_released_when_the_request_raises(clock, wall_clock) -> None:
    limiter = make(clock, wall_clock, tenants={"acme": {"max_concurrent": 1}})

    async def failing_request() -> None:
        async with await limiter.admit("acme", "m"):
            assert limiter.in_flight("acme") == 1
            raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        await failing_request()
    assert limiter.in_flight("acme") == 0


async def test_slot_released_when_the_request_is_cancelled(clock, wall_clock) -> None:
    limiter = make(clock, wall_clock, tenants={"acme": {"max_concurrent": 1}})
    started = asyncio.Event()

    async def request() -> None:
        with await limiter.admit("acme", "m"):
            started.set()
            await asyncio.Event().wait()

    task = asyncio.create_task(request())
    await started.wait()
    assert limiter.in_flight("acme") == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert limiter.in_flight("acme") == 0


async def test_slot_released_when_the_bucket_refuses(clock, wall_clock) -> None:
    tenants = {"acme": {"max_concurrent": 5, "rate_per_s": 1}}
    limiter = make(clock, wall_clock, tenants=tenants)
    held = await limiter.admit("acme", "m")
    with pytest.raises(RateLimited, match="rate limit"):
        await limiter.admit("acme", "m")
    assert limiter.in_flight("acme") == 1
    held.release()


class DownBackend:
    name = "redis"

    def __init__(self) -> None:
        self.calls = 0

    async def apply(self, tenant: str, checks: list[Check], units: int, *, commit: bool) -> Outcome:
        self.calls += 1
        raise BackendUnavailable("redis at 127.0.0.1:1 failed: ConnectionError: refused")

    async def aclose(self) -> None:
        pass


async def test_fail_open_falls_back_to_the_local_limiter(clock, wall_clock, caplog) -> None:
    settings = RateLimitSettings(tenants={"acme": {"rate_per_s": 1}}, error_log_interval_s=30)
    local = MemoryBackend(clock=clock, wall_clock=wall_clock)
    limiter = Limiter(settings, DownBackend(), local=local, clock=clock)
    admission = await limiter.admit("acme", "m")
    assert admission.headers["X-RateLimit-Remaining"] == "0"
    with pytest.raises(RateLimited):
        await limiter.admit("acme", "m")
    assert (limiter.counters.backend_failures, limiter.counters.fallback_admissions) == (2, 2)
    assert [r.message for r in caplog.records] == [
        "rate limiter backend failed 1 time(s) since the last report, using the local limiter: "
        "redis at 127.0.0.1:1 failed: ConnectionError: refused"
    ]
    usage = await limiter.usage("acme")
    assert usage["source"] == "memory (fallback: redis unavailable)"


async def test_fail_closed_answers_overloaded(clock, wall_clock) -> None:
    settings = RateLimitSettings(tenants={"acme": {"rate_per_s": 1, "max_concurrent": 1}})
    settings = settings.model_copy(update={"fail_open": False})
    limiter = Limiter(settings, DownBackend(), clock=clock)
    with pytest.raises(
        Overloaded, match=r"rate limiter unavailable: redis at 127\.0\.0\.1:1"
    ) as caught:
        await limiter.admit("acme", "m")
    assert caught.value.retry_after_s == settings.redis_retry_interval_s
    assert limiter.in_flight("acme") == 0
    assert limiter.counters.rejections == {("acme", "unavailable"): 1}


async def test_usage_reports_quotas_buckets_and_slots(clock, wall_clock) -> None:
    tenants = {
        "acme": {
            "rate_per_s": 2,
            "burst": 4,
            "max_concurrent": 3,
            "quota_per_day": 100,
            "models": {"resnet": {"quota_per_month": 50}},
        }
    }
    limiter = make(clock, wall_clock, tenants=tenants)
    held = await limiter.admit("acme", "resnet")
    (await limiter.admit("acme", "bert")).release()
    usage = await limiter.usage("acme")
    assert usage == {
        "tenant": "acme",
        "unit": "requests",
        "source": "memory",
        "rate": {"rate_per_s": 2.0, "burst": 4.0, "available": 2.0, "full_after_s": 1},
        "day": {
            "used": 2,
            "limit": 100,
            "remaining": 98,
            "resets_at": "2025-03-16T00:00:00Z",
            "reset_after_s": 43200,
        },
        "month": None,
        "concurrency": {"in_flight": 1, "max_concurrent": 3},
        "models": {
            "resnet": {
                "rate": None,
                "day": None,
                "month": {
                    "used": 1,
                    "limit": 50,
                    "remaining": 49,
                    "resets_at": "2025-04-01T00:00:00Z",
                    "reset_after_s": 17 * 86400 - 43200,
                },
                "concurrency": None,
            }
        },
        "as_of": "2025-03-15T12:00:00Z",
    }
    held.release()
    # Reading usage charges nothing.
    assert (await limiter.usage("acme"))["day"]["used"] == 2


def test_build_limiter_needs_a_redis_url_for_redis() -> None:
    with pytest.raises(SettingsError, match=r"rate_limit\.redis_url is not set"):
        build_limiter(RateLimitSettings(backend="redis"))
    assert isinstance(build_limiter(RateLimitSettings()), Limiter)


async def test_usage_of_an_unlimited_tenant(clock, wall_clock) -> None:
    limiter = make(clock, wall_clock)
    usage = await limiter.usage("anonymous")
    assert {key: usage[key] for key in ("rate", "day", "month", "concurrency", "models")} == {
        "rate": None,
        "day": None,
        "month": None,
        "concurrency": None,
        "models": {},
    }
