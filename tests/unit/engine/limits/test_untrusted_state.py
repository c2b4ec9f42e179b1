"""Bucket and quota state in Redis is untrusted: whatever another writer planted at a key, the
script and the limiter answer with finite numbers, start that check fresh and repair the key."""

from __future__ import annotations

import logging
import math
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from redis.asyncio import Redis

from engine.errors import QuotaExceeded, RateLimited
from engine.limits import Limiter
from engine.limits.plan import BackendUnavailable, Check, Level, Outcome
from engine.limits.redis_backend import CHARGE, READ, REFUND, RedisBackend, _outcome
from engine.settings import RateLimitSettings

BUCKET = Check("bucket", None, rate_per_s=0.01, burst=2.0)
DAY = Check("day", None, limit=3)
NOW_US = 1_742_040_000_000_000  # 2025-03-15T12:00:00Z
TODAY = NOW_US // 1_000_000 // 86_400

Plant = Callable[[Redis, str], Awaitable[Any]]


def hash_of(**fields: str | int) -> Plant:
    return lambda client, key: client.hset(key, mapping=fields)


def a_list() -> Plant:
    return lambda client, key: client.rpush(key, "tokens", "1")


def a_string() -> Plant:
    return lambda client, key: client.set(key, "1e999")


GARBAGE_BUCKETS = {
    "tokens -1e999": hash_of(tokens="-1e999", ts=NOW_US),
    "tokens 1e999": hash_of(tokens="1e999", ts=NOW_US),
    "tokens nan": hash_of(tokens="nan", ts=NOW_US),
    "tokens inf": hash_of(tokens="inf", ts=NOW_US),
    "tokens -inf": hash_of(tokens="-inf", ts=NOW_US),
    "tokens abc": hash_of(tokens="abc", ts=NOW_US),
    "tokens negative": hash_of(tokens="-5", ts=NOW_US),
    "ts nan": hash_of(tokens="0", ts="nan"),
    "ts -1e999": hash_of(tokens="0", ts="-1e999"),
    "ts far future": hash_of(tokens="0", ts=NOW_US + 10**15),
    "ts missing": hash_of(tokens="0"),
    "wrong fields": hash_of(foo="1"),
    "a list": a_list(),
    "a string": a_string(),
}
GARBAGE_QUOTAS = {
    "used -1e999": hash_of(window=TODAY, used="-1e999"),
    "used 1e999": hash_of(window=TODAY, used="1e999"),
    "used nan": hash_of(window=TODAY, used="nan"),
    "used abc": hash_of(window=TODAY, used="abc"),
    "used negative": hash_of(window=TODAY, used="-2"),
    "used non-integer": hash_of(window=TODAY, used="2.5"),
    "used huge": hash_of(window=TODAY, used="1e300"),
    "used missing": hash_of(window=TODAY),
    "window abc": hash_of(window="abc", used="1"),
    "window nan": hash_of(window="nan", used="1"),
    "a list": a_list(),
}


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[Redis]:
    connection = Redis.from_url(redis_url)
    yield connection
    await connection.aclose()


@pytest.fixture
async def backend(redis_url: str) -> AsyncIterator[RedisBackend]:
    made = RedisBackend(redis_url, namespace=f"t{uuid.uuid4().hex[:12]}", now_us=lambda: NOW_US)
    yield made
    await made.aclose()


@pytest.mark.parametrize("plant", GARBAGE_BUCKETS.values(), ids=GARBAGE_BUCKETS.keys())
async def test_a_garbage_bucket_is_a_fresh_bucket_and_is_repaired(
    backend: RedisBackend, client: Redis, plant: Plant
) -> None:
    key = backend.key("acme", BUCKET)
    await plant(client, key)
    # A read (the usage endpoint) already repairs the key: nothing stored is left to trust.
    read = await backend.apply("acme", [BUCKET], 0, commit=False)
    assert (read.allowed, read.levels[0].level, read.repaired) == (True, 2.0, (BUCKET,))
    assert await client.exists(key) == 0
    await plant(client, key)
    first = await backend.apply("acme", [BUCKET], 1, commit=True)
    assert (first.allowed, first.levels[0].level, first.repaired) == (True, 2.0, (BUCKET,))
    assert await client.hget(key, "tokens") == b"1"
    # The key now holds a real bucket: one token left, then empty (rate 0.01/s, no refill).
    second = await backend.apply("acme", [BUCKET], 1, commit=True)
    third = await backend.apply("acme", [BUCKET], 1, commit=True)
    assert [second.allowed, third.allowed] == [True, False]
    assert (second.repaired, third.repaired, third.levels[0].level) == ((), (), 0.0)


@pytest.mark.parametrize("plant", GARBAGE_QUOTAS.values(), ids=GARBAGE_QUOTAS.keys())
async def test_a_garbage_quota_counter_starts_fresh_and_is_repaired(
    backend: RedisBackend, client: Redis, plant: Plant
) -> None:
    key = backend.key("acme", DAY)
    await plant(client, key)
    read = await backend.apply("acme", [DAY], 0, commit=False)
    assert (read.allowed, read.levels[0].level, read.repaired) == (True, 0.0, (DAY,))
    await plant(client, key)
    results = [await backend.apply("acme", [DAY], 1, commit=True) for _ in range(4)]
    assert [r.allowed for r in results] == [True, True, True, False]
    assert [r.levels[0].level for r in results] == [0.0, 1.0, 2.0, 3.0]
    assert [r.repaired for r in results] == [(DAY,), (), (), ()]
    assert await client.hmget(key, "window", "used") == [str(TODAY).encode(), b"3"]


async def test_a_counter_of_an_older_window_is_not_garbage(
    backend: RedisBackend, client: Redis
) -> None:
    await client.hset(backend.key("acme", DAY), mapping={"window": TODAY - 1, "used": 3})
    outcome = await backend.apply("acme", [DAY], 1, commit=True)
    assert (outcome.allowed, outcome.levels[0].level, outcome.repaired) == (True, 0.0, ())


def limiter_for(url: str, **extra: Any) -> tuple[Limiter, str]:
    """A fail-closed limiter (a script error would be an Overloaded) and its key prefix."""
    namespace = f"t{uuid.uuid4().hex[:12]}"
    settings = RateLimitSettings.model_validate(
        {
            "backend": "redis",
            "redis_url": url,
            "namespace": namespace,
            "fail_open": False,
            "tenants": {"acme": {"rate_per_s": 0.01, "burst": 2, "quota_per_day": 5}},
            **extra,
        }
    )
    backend = RedisBackend(url, namespace=namespace, timeout_s=2.0)
    return Limiter(settings, backend), f"{namespace}:rl:{{acme}}:*"


@pytest.mark.parametrize("tokens", ["-1e999", "1e999", "nan", "inf", "abc", "-3"])
async def test_the_limit_still_holds_over_a_planted_bucket(
    redis_url: str, client: Redis, tokens: str, caplog: pytest.LogCaptureFixture
) -> None:
    limiter, prefix = limiter_for(redis_url)
    key = f"{prefix}:bucket"
    await client.hset(key, mapping={"tokens": tokens, "ts": "0"})
    with caplog.at_level(logging.WARNING, logger="sluice.limits"):
        usage = await limiter.usage("acme")
        admitted, retry_after_s = 0, []
        for _ in range(50):
            try:
                with await limiter.admit("acme", "m"):
                    admitted += 1
            except RateLimited as exc:
                retry_after_s.append(exc.retry_after_s)
    await limiter.aclose()
    assert usage["rate"]["available"] == 2.0
    assert admitted == 2
    assert all(math.isfinite(s) and 0 < s <= 100 for s in retry_after_s)
    assert len(retry_after_s) == 48
    assert limiter.counters.garbage_state == 1
    assert limiter.counters.backend_failures == 0
    logged = [r.getMessage() for r in caplog.records if "garbage" in r.getMessage()]
    assert len(logged) == 1, logged
    assert "tenant 'acme', *:bucket" in logged[0]


async def test_garbage_is_logged_at_most_once_per_interval(
    redis_url: str, client: Redis, caplog: pytest.LogCaptureFixture
) -> None:
    limiter, prefix = limiter_for(
        redis_url, error_log_interval_s=60, tenants={"acme": {"quota_per_day": 5}}
    )
    key = f"{prefix}:day"
    with caplog.at_level(logging.WARNING, logger="sluice.limits"):
        for _ in range(3):
            await client.hset(key, mapping={"window": "x", "used": "nan"})
            with await limiter.admit("acme", "m"):
                pass
    await limiter.aclose()
    assert limiter.counters.garbage_state == 3
    assert len([r for r in caplog.records if "garbage" in r.getMessage()]) == 1


async def test_a_planted_huge_quota_counter_is_no_exhausted_quota(
    redis_url: str, client: Redis
) -> None:
    limiter, prefix = limiter_for(redis_url, tenants={"acme": {"quota_per_day": 2}})
    key = f"{prefix}:day"
    seconds, _ = await client.time()
    day = seconds // 86_400
    await client.hset(key, mapping={"window": day, "used": "1e999"})
    usage = await limiter.usage("acme")
    assert (usage["day"]["used"], usage["day"]["remaining"]) == (0, 2)
    with await limiter.admit("acme", "m"), await limiter.admit("acme", "m"):
        pass
    with pytest.raises(QuotaExceeded, match="used its daily quota of 2"):
        await limiter.admit("acme", "m")
    await limiter.aclose()


REPLY_OK = [1, "1742040000000000", "2", "0", "0", "0", "1742083200", "0"]


@pytest.mark.parametrize(
    ("index", "value"),
    [(0, 7), (1, "nan"), (1, "-1e999"), (2, "inf"), (2, "-1"), (2, "3"), (2, "abc"), (4, "2"),
     (5, "nan"), (5, "-2"), (5, "0.5"), (5, "1e300"), (6, "1e999"), (7, None)],
)  # fmt: skip
def test_a_malformed_script_reply_is_a_backend_failure(index: int, value: object) -> None:
    assert _outcome([BUCKET, DAY], REPLY_OK, units=1, mode=CHARGE) == Outcome(
        True, (Level(BUCKET, 2.0), Level(DAY, 0.0, 1742083200.0)), 1742040000.0
    )
    reply = list(REPLY_OK)
    reply[index] = value
    with pytest.raises(BackendUnavailable, match="malformed"):
        _outcome([BUCKET, DAY], reply, units=1, mode=CHARGE)
    with pytest.raises(BackendUnavailable, match="malformed"):
        _outcome([BUCKET, DAY], REPLY_OK[:-1], units=1, mode=CHARGE)


# (allowed, tokens, used, units, mode): an `allowed` the reported levels contradict.
CONTRADICTIONS = {
    "refused, every check passes": (0, "2", "0", 1, CHARGE),
    "refused, a read with room": (0, "0", "3", 0, READ),
    "admitted over an empty bucket": (1, "0.5", "0", 1, CHARGE),
    "admitted over a used quota": (1, "2", "3", 1, CHARGE),
}


@pytest.mark.parametrize(
    ("allowed", "tokens", "used", "units", "mode"),
    CONTRADICTIONS.values(),
    ids=CONTRADICTIONS.keys(),
)
def test_a_reply_whose_allowed_contradicts_its_levels_is_a_backend_failure(
    allowed: int, tokens: str, used: str, units: int, mode: int
) -> None:
    reply = [allowed, REPLY_OK[1], tokens, "0", "0", used, REPLY_OK[6], "0"]
    with pytest.raises(BackendUnavailable, match=f"malformed.*allowed is {allowed} for {units}"):
        _outcome([BUCKET, DAY], reply, units=units, mode=mode)
    reply[0] = 1 - allowed  # what the script answers for these levels
    assert _outcome([BUCKET, DAY], reply, units=units, mode=mode).allowed is (allowed == 0)
    reply[0] = 1  # a refund always applies, whatever the levels
    assert _outcome([BUCKET, DAY], reply, units=units, mode=REFUND).allowed is True
