"""Build the configured cache backend from the server's `cache` settings section."""

from __future__ import annotations

from engine.cache.contract import ResultCache
from engine.cache.memory import MemoryCache
from engine.cache.tiered import TieredCache
from engine.settings import CacheSettings


def build_cache(settings: CacheSettings) -> ResultCache:
    """The backend named by `settings.backend`.

    `redis` and `tiered` need `redis_url`; ValueError says so. No connection is made here: the
    pool connects on first use, so a server starts (and serves misses) while Redis is down. Call
    it inside the running event loop and `await cache.close()` on shutdown.
    """
    memory = MemoryCache(settings.memory_bytes, settings.max_entry_bytes)
    if settings.backend == "memory":
        return memory
    from engine.cache.redis_cache import RedisCache  # the redis client: only when used

    redis = RedisCache.from_settings(settings)
    if settings.backend == "redis":
        return redis
    return TieredCache(memory, redis)
