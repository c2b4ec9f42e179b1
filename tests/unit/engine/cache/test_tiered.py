from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import numpy as np
import pytest

from engine.cache.contract import CachedResult, ResultCache
from engine.cache.memory import MemoryCache
from engine.cache.redis_cache import RedisCache
from engine.cache.tiered import TieredCache
from tests.redis_process import free_port


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def result(value: int) -> CachedResult:
    return CachedResult({"y": np.full(4, value, dtype=np.int64)}, {"y": "INT64"})


def value(found: CachedResult | None) -> list[int]:
    assert found is not None
    return [int(v) for v in found.outputs["y"].tolist()]


@pytest.fixture
def key() -> bytes:
    return f"test:{uuid.uuid4().hex}".encode()


@pytest.fixture
async def replicas(redis_url: str) -> AsyncIterator[tuple[TieredCache, TieredCache, FakeClock]]:
    """Two tiered caches sharing one Redis, as two server processes would; the second one's
    memory tier runs on a fake clock."""
    clock = FakeClock()
    first = TieredCache(MemoryCache(1 << 20), RedisCache(redis_url, timeout_s=2.0))
    second = TieredCache(MemoryCache(1 << 20, clock=clock), RedisCache(redis_url, timeout_s=2.0))
    yield first, second, clock
    await first.close()
    await second.close()


async def test_computed_on_one_replica_is_a_hit_on_the_other(
    replicas: tuple[TieredCache, TieredCache, FakeClock], key: bytes
) -> None:
    first, second, _ = replicas
    assert isinstance(first, ResultCache)
    assert await second.get(key) is None
    await first.put(key, result(7), ttl_s=60)
    assert key in first.memory  # the local tier is filled before put returns
    await first.flush()
    assert value(await second.get(key)) == [7] * 4
    assert (second.redis.stats.hits, second.memory.stats.hits) == (1, 0)
    assert value(await second.get(key)) == [7] * 4  # now from memory: no Redis round trip
    assert (second.redis.stats.hits, second.memory.stats.hits) == (1, 1)
    stats = second.stats
    assert (stats.hits, stats.misses, stats.errors, stats.entries) == (2, 1, 0, 1)


async def test_redis_hit_fills_memory_for_the_remaining_redis_ttl(
    replicas: tuple[TieredCache, TieredCache, FakeClock], key: bytes
) -> None:
    first, second, clock = replicas
    await first.put(key, result(3), ttl_s=60)
    await first.flush()
    assert value(await second.get(key)) == [3] * 4
    clock.now += 50
    assert key in second.memory
    clock.now += 11  # past the 60 s Redis gave it
    assert key not in second.memory


async def test_arrays_from_either_tier_are_read_only(
    replicas: tuple[TieredCache, TieredCache, FakeClock], key: bytes
) -> None:
    first, second, _ = replicas
    await first.put(key, result(1), ttl_s=60)
    await first.flush()
    for found in (await first.get(key), await second.get(key), await second.get(key)):
        assert found is not None
        with pytest.raises(ValueError, match="read-only"):
            found.outputs["y"][0] = 0


async def test_redis_down_still_serves_memory_and_counts_errors(key: bytes) -> None:
    cache = TieredCache(
        MemoryCache(1 << 20), RedisCache(f"redis://127.0.0.1:{free_port()}/0", retry_interval_s=0)
    )
    await cache.put(key, result(5), ttl_s=60)
    await cache.flush()
    assert value(await cache.get(key)) == [5] * 4
    assert await cache.get(key + b"-other") is None
    await cache.close()
    stats = cache.stats
    assert (stats.hits, stats.misses) == (1, 1)
    assert stats.errors == 2  # the failed background store and the failed lookup
