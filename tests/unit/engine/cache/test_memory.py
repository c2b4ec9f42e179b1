from __future__ import annotations

import numpy as np
import pytest

from engine.cache.contract import CachedResult, ResultCache
from engine.cache.memory import MemoryCache


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def result(nbytes: int, fill: int = 1) -> CachedResult:
    return CachedResult({"y": np.full(nbytes, fill, dtype=np.uint8)}, {"y": "UINT8"})


async def test_miss_then_hit_returns_equal_values_and_counts() -> None:
    cache = MemoryCache(1000)
    assert isinstance(cache, ResultCache)
    assert await cache.get(b"k") is None
    await cache.put(b"k", result(10, fill=7), ttl_s=60)
    found = await cache.get(b"k")
    assert found is not None
    assert found.outputs["y"].tolist() == [7] * 10
    assert found.datatypes == {"y": "UINT8"}
    stats = cache.stats
    assert (stats.hits, stats.misses, stats.stores, stats.bytes, stats.entries) == (1, 1, 1, 10, 1)


async def test_stored_result_is_a_frozen_copy() -> None:
    cache = MemoryCache(1000)
    original = result(4, fill=1)
    await cache.put(b"k", original, ttl_s=60)
    original.outputs["y"][:] = 9  # the caller keeps using its arrays
    first = await cache.get(b"k")
    assert first is not None
    assert first.outputs["y"].tolist() == [1, 1, 1, 1]
    with pytest.raises(ValueError, match="read-only"):
        first.outputs["y"][0] = 5
    with pytest.raises(ValueError, match="WRITEABLE"):
        first.outputs["y"].setflags(write=True)
    second = await cache.get(b"k")
    assert second is not None
    assert second.outputs["y"].tolist() == [1, 1, 1, 1]


async def test_ttl_expiry_on_the_injected_clock() -> None:
    clock = FakeClock()
    cache = MemoryCache(1000, clock=clock)
    await cache.put(b"k", result(8), ttl_s=5)
    clock.now += 4.999
    assert await cache.get(b"k") is not None
    assert b"k" in cache
    clock.now += 0.001
    assert b"k" not in cache
    assert await cache.get(b"k") is None
    stats = cache.stats
    assert (stats.expirations, stats.hits, stats.misses) == (1, 1, 1)
    assert (stats.bytes, stats.entries) == (0, 0)


async def test_lru_bounded_by_bytes_not_entries() -> None:
    cache = MemoryCache(100)
    await cache.put(b"a", result(40), ttl_s=60)
    await cache.put(b"b", result(40), ttl_s=60)
    assert await cache.get(b"a") is not None  # now b is the least recently used
    await cache.put(b"c", result(30), ttl_s=60)  # 110 > 100: evicts b only
    assert b"b" not in cache
    assert b"a" in cache
    assert b"c" in cache
    assert (cache.stats.evictions, cache.stats.bytes, cache.stats.entries) == (1, 70, 2)
    await cache.put(b"d", result(100), ttl_s=60)  # fills the cache alone
    assert (cache.stats.evictions, cache.stats.bytes, len(cache)) == (3, 100, 1)
    many_small = MemoryCache(100)
    for i in range(100):
        await many_small.put(bytes([i]), result(1), ttl_s=60)
    assert (many_small.stats.entries, many_small.stats.evictions) == (100, 0)


async def test_bytes_tensors_count_element_lengths() -> None:
    cache = MemoryCache(1000)
    strings = np.array([b"abc", b"de", b""], dtype=object)
    await cache.put(b"s", CachedResult({"s": strings}, {"s": "BYTES"}), ttl_s=60)
    assert cache.stats.bytes == 5
    found = await cache.get(b"s")
    assert found is not None
    assert found.outputs["s"].tolist() == [b"abc", b"de", b""]


async def test_too_large_or_zero_ttl_is_skipped_and_replacing_adjusts_bytes() -> None:
    cache = MemoryCache(100, max_entry_bytes=50)
    await cache.put(b"big", result(51), ttl_s=60)
    await cache.put(b"dead", result(1), ttl_s=0)
    assert (cache.stats.skipped, cache.stats.entries) == (2, 0)
    await cache.put(b"k", result(20), ttl_s=60)
    await cache.put(b"k", result(30, fill=3), ttl_s=60)
    found = await cache.get(b"k")
    assert found is not None
    assert found.outputs["y"].tolist() == [3] * 30
    assert (cache.stats.bytes, cache.stats.entries, cache.stats.evictions) == (30, 1, 0)


async def test_discard_clear_and_close() -> None:
    cache = MemoryCache(100)
    await cache.put(b"a", result(10), ttl_s=60)
    await cache.put(b"b", result(10), ttl_s=60)
    cache.discard(b"a")
    assert (b"a" in cache, cache.stats.bytes) == (False, 10)
    await cache.close()
    assert (len(cache), cache.stats.bytes, cache.stats.entries) == (0, 0, 0)


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError, match="capacity_bytes must be positive, got 0"):
        MemoryCache(0)
