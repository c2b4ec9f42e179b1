from __future__ import annotations

import numpy as np
import pytest

from engine.cache.contract import CachedResult
from engine.cache.factory import build_cache
from engine.cache.memory import MemoryCache
from engine.cache.redis_cache import RedisCache
from engine.cache.tiered import TieredCache
from engine.settings import CacheSettings
from server.settings import load_settings


async def test_memory_backend_uses_the_byte_bounds() -> None:
    cache = build_cache(CacheSettings(memory_bytes=1000, max_entry_bytes=100))
    assert isinstance(cache, MemoryCache)
    assert (cache.capacity_bytes, cache.max_entry_bytes) == (1000, 100)
    await cache.close()


async def test_redis_backend_takes_every_setting(redis_url: str) -> None:
    settings = CacheSettings(
        backend="redis",
        redis_url=redis_url,
        redis_timeout_s=0.5,
        redis_retry_interval_s=2,
        redis_max_pending_writes=7,
        max_entry_bytes=1234,
        error_log_interval_s=9,
    )
    cache = build_cache(settings)
    assert isinstance(cache, RedisCache)
    assert (cache.timeout_s, cache.retry_interval_s, cache.max_pending_writes) == (0.5, 2, 7)
    assert (cache.max_entry_bytes, cache.error_log_interval_s) == (1234, 9)
    await cache.put(b"test:factory", CachedResult({"y": np.ones(2)}, {"y": "FP64"}), ttl_s=5)
    await cache.flush()
    assert cache.stats.stores == 1
    await cache.close()


async def test_tiered_backend_from_the_environment(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLUICE_CACHE__BACKEND", "tiered")
    monkeypatch.setenv("SLUICE_CACHE__REDIS_URL", redis_url)
    cache = build_cache(load_settings().cache)
    assert isinstance(cache, TieredCache)
    assert cache.redis.url == redis_url
    await cache.close()


def test_redis_backends_need_a_url() -> None:
    with pytest.raises(ValueError, match=r"cache backend 'tiered' needs cache\.redis_url"):
        build_cache(CacheSettings(backend="tiered"))
