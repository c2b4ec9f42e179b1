from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime

import pytest
from redis.asyncio import Redis

from engine.limits.local import MemoryBackend
from engine.limits.plan import BackendUnavailable, Check, Outcome
from engine.limits.quota import day_window, month_window
from engine.limits.redis_backend import SCRIPT, SCRIPT_SHA, RedisBackend, redacted
from engine.settings_sections import MAX_LIMIT

BUCKET = Check("bucket", None, rate_per_s=2.0, burst=3.0)
MODEL_BUCKET = Check("bucket", "resnet", rate_per_s=0.5, burst=2.0)
DAY = Check("day", None, limit=5)
MONTH = Check("month", "resnet", limit=7)
START = 1_742_040_000.0  # 2025-03-15T12:00:00Z


def unique() -> str:
    return f"t{uuid.uuid4().hex[:12]}"


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def micros(self) -> int:
        return round(self.now * 1_000_000)


@pytest.fixture
async def make_backend(redis_url: str) -> AsyncIterator[Callable[..., RedisBackend]]:
    made: list[RedisBackend] = []

    def make(url: str = redis_url, **options: object) -> RedisBackend:
        backend = RedisBackend(url, namespace=unique(), **options)  # type: ignore[arg-type]
        made.append(backend)
        return backend

    yield make
    for backend in made:
        await backend.aclose()


def same(outcome: Outcome) -> tuple[object, ...]:
    return (outcome.allowed, outcome.now_unix_s, outcome.levels)


# (seconds to advance, units, commit) applied to both backends.
STEPS = [(0, 1, True), (0, 2, True), (0, 1, True), (0.25, 1, True), (0.25, 1, True),
         (0, 1, False), (3.5, 4, True), (0.5, 3, True), (86_400, 1, True), (0.125, 2, True),
         (10, 2, True), (10, 2, True), (10, 1, True)]  # fmt: skip


async def test_script_matches_the_memory_backend_step_by_step(make_backend) -> None:
    clock = Clock(START)
    redis = make_backend(now_us=clock.micros)
    memory = MemoryBackend(clock=clock, wall_clock=clock)
    checks = [BUCKET, MODEL_BUCKET, DAY, MONTH]
    allowed = []
    for advance_s, units, commit in STEPS:
        clock.now += advance_s
        from_redis = await redis.apply("acme", checks, units, commit=commit)
        from_memory = await memory.apply("acme", checks, units, commit=commit)
        assert same(from_redis) == same(from_memory)
        allowed.append(from_redis.allowed)
    # Model bucket empty at 2, 4-6, 8, 10; main bucket short at 7; quotas used up at 13.
    assert allowed == [True, False, True, False, False, False, False, False, True, False,
                       True, True, False]  # fmt: skip


# (seconds to advance, units, admitted) charged against one check at the largest limit the
# settings allow. Half a second refills half the bucket: (2^53 - 1) / 2, half a unit short of 2^52.
NEAR_THE_BOUND = {
    "quota": (Check("day", None, limit=MAX_LIMIT),
              [(0, MAX_LIMIT - 1, True), (0, 2, False), (0, 1, True), (0, 1, False),
               (0, 2**53 + 1, False)]),
    "bucket": (Check("bucket", None, rate_per_s=MAX_LIMIT, burst=MAX_LIMIT),
               [(0, MAX_LIMIT - 1, True), (0, 2, False), (0, 1, True), (0, 2**53 + 1, False),
                (0.5, 2**52, False), (0, 2**52 - 1, True)]),
}  # fmt: skip


@pytest.mark.parametrize(("check", "steps"), NEAR_THE_BOUND.values(), ids=NEAR_THE_BOUND.keys())
async def test_script_matches_the_memory_backend_at_the_largest_limits(
    make_backend, check: Check, steps: list[tuple[float, int, bool]]
) -> None:
    # The script counts in doubles, exact to 2^53; the settings stop limits below it
    # (MAX_LIMIT), so the backends agree to the last unit: a request that would pass the
    # limit by one is refused by both (with a quota of 2^53, Redis admitted it).
    clock = Clock(START)
    redis = make_backend(now_us=clock.micros)
    memory = MemoryBackend(clock=clock, wall_clock=clock)
    for advance_s, units, admitted in steps:
        clock.now += advance_s
        from_redis = await redis.apply("acme", [check], units, commit=True)
        from_memory = await memory.apply("acme", [check], units, commit=True)
        assert same(from_redis) == same(from_memory)
        assert from_redis.allowed is admitted, (advance_s, units)


def month_starts() -> list[float]:
    moments = []
    for year in [*range(2024, 2030), 2100, 2400]:
        for month in range(1, 13):
            start = datetime(year, month, 1, tzinfo=UTC).timestamp()
            moments += [start - 0.000001, start, start + 86_399.5]
    return moments


async def test_script_calendar_matches_python_at_every_month_boundary(make_backend) -> None:
    clock = Clock(START)
    redis = make_backend(now_us=clock.micros)
    for moment in month_starts():
        clock.now = moment
        outcome = await redis.apply("cal", [DAY, MONTH], 0, commit=False)
        day, month = outcome.levels
        assert day.window_end_s == day_window(moment).end_s, moment
        assert month.window_end_s == month_window(moment).end_s, moment


async def test_counter_from_last_month_is_ignored(make_backend) -> None:
    clock = Clock(datetime(2025, 1, 31, 23, 59, 59, tzinfo=UTC).timestamp())
    redis = make_backend(now_us=clock.micros)
    assert (await redis.apply("acme", [MONTH], 7, commit=True)).allowed
    assert not (await redis.apply("acme", [MONTH], 1, commit=True)).allowed
    clock.now += 1
    outcome = await redis.apply("acme", [MONTH], 1, commit=True)
    assert (outcome.allowed, outcome.levels[0].level) == (True, 0.0)


async def test_uses_redis_time_without_an_override(make_backend, redis_url: str) -> None:
    redis = make_backend()
    client = Redis.from_url(redis_url)
    seconds, micros = await client.time()
    await client.aclose()
    outcome = await redis.apply("acme", [BUCKET], 1, commit=True)
    assert 0 <= outcome.now_unix_s - (seconds + micros / 1e6) < 5


async def test_keys_are_tagged_by_tenant_and_expire(make_backend, redis_url: str) -> None:
    redis = make_backend()
    await redis.apply("acme", [BUCKET, MONTH], 1, commit=True)
    client = Redis.from_url(redis_url)
    bucket_key, month_key = redis.key("acme", BUCKET), redis.key("acme", MONTH)
    assert bucket_key.endswith(":rl:{acme}:*:bucket")
    assert month_key.endswith(":rl:{acme}:resnet:month")
    assert 0 < await client.pttl(bucket_key) <= 2500  # full again after burst/rate = 1.5 s
    assert 0 < await client.pttl(month_key) <= 32 * 86_400_000
    assert await client.hget(month_key, "used") == b"1"
    await client.aclose()


@pytest.mark.parametrize("rate_per_s", [1e-9, 5e-324])  # a refill of 1e15 s; of forever
async def test_a_bucket_that_takes_ages_to_refill_is_counted_alike(
    make_backend, redis_url: str, rate_per_s: float
) -> None:
    # Its key lives until the bucket is full again, in milliseconds: Redis writes a script's
    # number as "%.17g", so 1e17 ms and more reached PEXPIRE as "1e+17" and every admission
    # failed (an error reply), while the memory backend counted. The lifetime stops at 2^53 ms.
    check = Check("bucket", None, rate_per_s=rate_per_s, burst=1e6)
    clock = Clock(START)
    redis = make_backend(now_us=clock.micros)
    memory = MemoryBackend(clock=clock, wall_clock=clock)
    for advance_s, units, admitted in [(0, 999_999, True), (0, 2, False), (1e9, 1, True)]:
        clock.now += advance_s
        from_redis = await redis.apply("acme", [check], units, commit=True)
        from_memory = await memory.apply("acme", [check], units, commit=True)
        assert same(from_redis) == same(from_memory)
        assert from_redis.allowed is admitted
    client = Redis.from_url(redis_url)
    assert 2**53 - 60_000 < await client.pttl(redis.key("acme", check)) <= 2**53
    await client.aclose()


async def test_reloads_the_script_after_script_flush(make_backend, redis_url: str) -> None:
    redis = make_backend()
    client = Redis.from_url(redis_url)
    await client.script_flush()
    assert (await redis.apply("acme", [BUCKET], 1, commit=True)).levels[0].level == 3.0
    assert await client.script_exists(SCRIPT_SHA) == [True]
    await client.aclose()


async def test_unreachable_redis_fails_fast_within_the_retry_interval(make_backend) -> None:
    clock = Clock(100.0)
    redis = make_backend("redis://:secret@127.0.0.1:1/0", clock=clock, retry_interval_s=2.0)
    with pytest.raises(BackendUnavailable, match=r"redis at 127\.0\.0\.1:1 failed") as first:
        await redis.apply("acme", [BUCKET], 1, commit=True)
    assert "secret" not in str(first.value)
    clock.now += 1.5
    with pytest.raises(BackendUnavailable, match=r"not retrying redis for another 0\.50 s"):
        await redis.apply("acme", [BUCKET], 1, commit=True)
    clock.now += 0.5
    with pytest.raises(BackendUnavailable, match=r"redis at 127\.0\.0\.1:1 failed"):
        await redis.apply("acme", [BUCKET], 1, commit=True)


def test_redacted_drops_credentials() -> None:
    assert redacted("redis://user:pw@cache.internal:6380/2") == "cache.internal:6380"
    assert redacted("redis://localhost") == "localhost:6379"


async def test_slow_redis_times_out(make_backend, proxy) -> None:
    redis = make_backend(f"redis://127.0.0.1:{proxy.port}/0", timeout_s=0.05)
    await redis.apply("acme", [BUCKET], 1, commit=True)
    proxy.hold()
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(BackendUnavailable, match=r"did not answer within 0\.05 s"):
        await redis.apply("acme", [BUCKET], 1, commit=True)
    assert loop.time() - started < 1.0


async def test_an_admission_is_one_round_trip_and_a_stale_idea_of_redis_time_costs_one_more(
    make_backend, redis_url: str
) -> None:
    """Fail closed, an admission's script gets a deadline on Redis's clock, which the backend
    learns from each reply. Where it was behind (the first call; Redis's clock stepped forward),
    the script charges nothing and answers late, and the call is sent once more: one charge."""
    clock = Clock(START)
    redis = make_backend(now_us=clock.micros, timeout_s=2.0)
    client = Redis.from_url(redis_url)
    await client.script_load(SCRIPT)

    async def charge() -> tuple[float, int]:
        """The day's count before this charge, and the EVALSHAs it took."""
        stats = await client.info("commandstats")
        before = stats["cmdstat_evalsha"]["calls"]
        outcome = await redis.apply("acme", [DAY], 1, commit=True)
        stats = await client.info("commandstats")
        return outcome.levels[0].level, stats["cmdstat_evalsha"]["calls"] - before

    assert await charge() == (0.0, 2)
    assert await charge() == (1.0, 1)
    clock.now += 3600
    assert await charge() == (2.0, 2)
    assert await charge() == (3.0, 1)
    await client.aclose()
