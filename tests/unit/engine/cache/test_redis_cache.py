from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import numpy as np
import pytest
from redis.asyncio import Redis

from engine.cache.codec import encode
from engine.cache.contract import CachedResult, ResultCache
from engine.cache.key import cache_key
from engine.cache.redis_cache import RedisCache
from engine.settings import CacheSettings
from tests.redis_process import RedisProcess, free_port


def result(values: list[float]) -> CachedResult:
    return CachedResult(
        {"y": np.array(values, dtype=np.float32), "s": np.array([b"tag"], dtype=object)},
        {"y": "FP32", "s": "BYTES"},
    )


def values(found: CachedResult | None) -> list[float]:
    assert found is not None
    assert found.outputs["s"].tolist() == [b"tag"]
    return [float(v) for v in found.outputs["y"].tolist()]


@pytest.fixture
def prefix() -> bytes:
    return f"test:{uuid.uuid4().hex}:".encode()


@pytest.fixture
async def raw(redis_url: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_url)
    yield client
    await client.aclose()


@pytest.fixture
async def cache(redis_url: str) -> AsyncIterator[RedisCache]:
    # A generous timeout: these tests want Redis to answer on a loaded machine.
    cache = RedisCache(redis_url, timeout_s=2.0, retry_interval_s=0)
    yield cache
    await cache.close()


async def until(condition: Callable[[], Awaitable[bool]], timeout_s: float = 10.0) -> None:
    """Poll `condition` until true; fail after `timeout_s` (a bound, not a synchronisation)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"condition not reached within {timeout_s} s")


async def test_miss_then_hit_round_trip(cache: RedisCache, prefix: bytes, raw: Redis) -> None:
    assert isinstance(cache, ResultCache)
    assert await cache.get(prefix + b"k") is None
    await cache.put(prefix + b"k", result([1.5, -2.0]), ttl_s=60)
    await cache.flush()
    assert await raw.exists(prefix + b"k") == 1
    assert values(await cache.get(prefix + b"k")) == [1.5, -2.0]
    stats = cache.stats
    assert (stats.hits, stats.misses, stats.errors, stats.stores) == (1, 1, 0, 1)


async def test_put_encodes_before_returning(cache: RedisCache, prefix: bytes) -> None:
    original = result([1.0, 2.0])
    await cache.put(prefix + b"k", original, ttl_s=60)
    original.outputs["y"][:] = 0  # the caller may reuse its arrays as soon as put returns
    await cache.flush()
    assert values(await cache.get(prefix + b"k")) == [1.0, 2.0]


async def test_ttl_is_redis_expiry(cache: RedisCache, prefix: bytes, raw: Redis) -> None:
    await cache.put(prefix + b"long", result([1.0]), ttl_s=60)
    await cache.put(prefix + b"short", result([2.0]), ttl_s=0.2)
    await cache.flush()
    assert 55_000 < await raw.pttl(prefix + b"long") <= 60_000
    found = await cache.get_with_ttl(prefix + b"long")
    assert found is not None
    assert values(found[0]) == [1.0]
    assert found[1] is not None
    assert 55 < found[1] <= 60

    async def gone() -> bool:
        return await cache.get(prefix + b"short") is None

    await until(gone)
    assert await raw.exists(prefix + b"short") == 0


@pytest.mark.parametrize("damage", ["truncated", "garbage", "bit flip"])
async def test_corrupt_entry_is_a_miss_and_deleted(
    cache: RedisCache, prefix: bytes, raw: Redis, damage: str
) -> None:
    good = encode(result([1.0, 2.0, 3.0]))
    bad = {
        "truncated": good[:-3],
        "garbage": b"\x80\x04not a cache entry",
        "bit flip": good[:-1] + bytes([good[-1] ^ 0x10]),
    }[damage]
    await raw.set(prefix + b"k", bad, px=60_000)
    assert await cache.get(prefix + b"k") is None
    await cache.flush()  # the DEL runs in the background
    assert await raw.exists(prefix + b"k") == 0
    assert (cache.stats.misses, cache.stats.errors, cache.stats.hits) == (1, 1, 0)


@pytest.mark.parametrize("with_ttl", [False, True])
async def test_a_key_of_another_type_is_a_rejected_entry_not_an_outage(
    cache: RedisCache, prefix: bytes, raw: Redis, with_ttl: bool
) -> None:
    """A hash planted under a cache key answered WRONGTYPE, taken for Redis being down: every
    request was a miss for retry_interval_s, again and again, and the key was never deleted."""
    await raw.hset(prefix + b"planted", mapping={"a": "b"})
    get = cache.get_with_ttl if with_ttl else cache.get
    assert await get(prefix + b"planted") is None
    await cache.flush()
    assert await raw.exists(prefix + b"planted") == 0
    assert (cache.stats.rejected, cache.stats.misses) == (1, 1)
    await cache.put(prefix + b"good", result([1.0]), ttl_s=60)
    await cache.flush()
    assert await cache.get(prefix + b"good") is not None  # the cache is not off


async def test_oversized_result_is_not_stored(redis_url: str, prefix: bytes, raw: Redis) -> None:
    cache = RedisCache(redis_url, timeout_s=2.0, max_entry_bytes=16)
    await cache.put(prefix + b"k", result([1.0] * 8), ttl_s=60)  # 32 + 3 bytes
    await cache.close()
    assert (cache.stats.skipped, cache.stats.stores) == (1, 0)
    assert await raw.exists(prefix + b"k") == 0


async def test_new_version_or_generation_never_reads_old_entries(cache: RedisCache) -> None:
    ns = f"test-{uuid.uuid4().hex}"
    request: tuple[Any, ...] = ({"x": np.arange(4, dtype=np.int64)}, {"x": "INT64"}, None, {})
    old = cache_key(ns, "m", "1", "gen-a", *request)
    await cache.put(old, result([9.0]), ttl_s=60)
    await cache.flush()
    assert values(await cache.get(old)) == [9.0]
    assert await cache.get(cache_key(ns, "m", "2", "gen-a", *request)) is None
    assert await cache.get(cache_key(ns, "m", "1", "gen-b", *request)) is None
    assert old.startswith(f"{ns}:m:1:gen-a:".encode())


async def test_unreachable_redis_is_a_counted_miss_logged_once_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [100.0]
    cache = RedisCache(
        f"redis://127.0.0.1:{free_port()}/0",
        timeout_s=1.0,
        retry_interval_s=0,
        error_log_interval_s=30,
        clock=lambda: now[0],
    )
    with caplog.at_level(logging.WARNING, logger="sluice.cache"):
        assert await cache.get(b"k") is None
        assert await cache.get(b"k") is None
        await cache.put(b"k", result([1.0]), ttl_s=60)
        await cache.flush()
        assert len(caplog.records) == 1
        now[0] += 30
        assert await cache.get(b"k") is None
    await cache.close()
    assert [r.getMessage().split(" failed")[0] for r in caplog.records] == ["redis cache get"] * 2
    assert "2 more failures since the last report" in caplog.records[1].getMessage()
    assert (cache.stats.errors, cache.stats.misses, cache.stats.hits) == (4, 3, 0)


async def test_backs_off_after_a_failure(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    cache = RedisCache(
        f"redis://127.0.0.1:{free_port()}/0", retry_interval_s=5, clock=lambda: now[0]
    )
    with caplog.at_level(logging.WARNING, logger="sluice.cache"):
        assert await cache.get(b"k") is None  # tries, fails, backs off
        started = time.monotonic()
        assert await cache.get(b"k") is None  # inside the back-off: no attempt at all
        assert time.monotonic() - started < 0.5
    await cache.close()
    assert (cache.stats.errors, cache.stats.misses) == (2, 2)
    assert len(caplog.records) == 1


async def test_redis_killed_and_restarted(redis_process: RedisProcess) -> None:
    cache = RedisCache(redis_process.url, timeout_s=2.0, retry_interval_s=0.05)
    await cache.put(b"before", result([1.0]), ttl_s=60)
    await cache.flush()
    assert values(await cache.get(b"before")) == [1.0]
    redis_process.stop()
    for _ in range(20):  # every request is still answered: a miss, never an exception
        assert await cache.get(b"before") is None
        await cache.put(b"during", result([2.0]), ttl_s=60)
    await cache.flush()
    assert cache.stats.errors >= 1
    await asyncio.to_thread(redis_process.start)  # same port, empty data set

    async def hit_resumes() -> bool:
        await cache.put(b"after", result([3.0]), ttl_s=60)
        await cache.flush()
        return await cache.get(b"after") is not None

    await until(hit_resumes)
    assert values(await cache.get(b"after")) == [3.0]
    await cache.close()


@pytest.mark.parametrize("method", ["get", "get_with_ttl"])
@pytest.mark.parametrize("interruption", ["cancel", "timeout"])
async def test_interrupted_call_never_leaves_its_reply_to_the_next_caller(
    holding_proxy: Any, redis_url: str, prefix: bytes, method: str, interruption: str
) -> None:
    writer = RedisCache(redis_url, timeout_s=2.0)
    await writer.put(prefix + b"A", result([1.0]), ttl_s=60)
    await writer.put(prefix + b"B", result([2.0]), ttl_s=60)
    await writer.close()
    # One connection, so a half-read connection would be reused by the next call if kept.
    timeout_s = 2.0 if interruption == "cancel" else 0.2
    cache = RedisCache(holding_proxy.url, timeout_s=timeout_s, max_connections=1,
                       retry_interval_s=0)  # fmt: skip

    async def fetch(key: bytes) -> CachedResult | None:
        if method == "get":
            return await cache.get(key)
        found = await cache.get_with_ttl(key)
        return None if found is None else found[0]

    assert values(await fetch(prefix + b"B")) == [2.0]
    holding_proxy.hold()
    holding_proxy.request_seen.clear()
    if interruption == "cancel":
        task = asyncio.get_running_loop().create_task(fetch(prefix + b"A"))
        await holding_proxy.request_seen.wait()  # A's request reached Redis; its reply is held
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    else:
        assert await fetch(prefix + b"A") is None
        assert cache.stats.errors == 1
    holding_proxy.release()
    assert values(await fetch(prefix + b"B")) == [2.0]
    assert values(await fetch(prefix + b"A")) == [1.0]
    await cache.close()


async def test_pending_writes_are_bounded(holding_proxy: Any, prefix: bytes, raw: Redis) -> None:
    cache = RedisCache(holding_proxy.url, timeout_s=5.0, max_pending_writes=2)
    holding_proxy.hold()
    for name in (b"1", b"2", b"3"):
        await cache.put(prefix + name, result([1.0]), ttl_s=60)
    assert (cache.pending_writes, cache.stats.skipped) == (2, 1)
    holding_proxy.release()
    await cache.close()  # close waits for the writes in flight
    assert cache.stats.stores == 2
    assert await raw.exists(prefix + b"1", prefix + b"2", prefix + b"3") == 2


def test_from_settings_requires_a_url() -> None:
    with pytest.raises(ValueError, match=r"cache backend 'redis' needs cache\.redis_url"):
        RedisCache.from_settings(CacheSettings(backend="redis"))
