"""Memory in front of Redis: hits on this replica cost no round trip, results computed on another
replica are still hits here. A Redis hit fills memory for the rest of the entry's Redis TTL."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.cache.contract import CachedResult, CacheStats, Expected, read_only_views
from engine.cache.memory import MemoryCache

if TYPE_CHECKING:
    from engine.cache.redis_cache import RedisCache


class TieredCache:
    """The `tiered` backend. `stats` combines both tiers: a hit is a hit in either, a miss is a
    miss in both; errors are Redis's, evictions/expirations/bytes/entries are memory's, stores are
    memory stores. `memory.stats` and `redis.stats` give each tier on its own."""

    def __init__(self, memory: MemoryCache, redis: RedisCache) -> None:
        self.memory = memory
        self.redis = redis

    @property
    def stats(self) -> CacheStats:
        """A fresh combined snapshot (cheap: a handful of integer additions)."""
        local, remote = self.memory.stats, self.redis.stats
        return CacheStats(
            hits=local.hits + remote.hits,
            misses=remote.misses,
            errors=remote.errors,
            evictions=local.evictions,
            expirations=local.expirations,
            stores=local.stores,
            skipped=local.skipped + remote.skipped,
            rejected=remote.rejected,
            bytes=local.bytes,
            entries=local.entries,
        )

    async def get(self, key: bytes, expected: Expected | None = None) -> CachedResult | None:
        """Memory first; on a memory miss, Redis (and a Redis hit, checked against `expected`
        before anything else, is copied into memory)."""
        found = self.memory.lookup(key)
        if found is not None:
            return found
        remote = await self.redis.get_with_ttl(key, expected)
        if remote is None:
            return None
        result, ttl_s = remote
        # Decoded arrays are read-only views of an immutable bytes object: store them as they are.
        if ttl_s is not None and self.memory.store(key, result, ttl_s, copy=False):
            return read_only_views(result)
        return result

    async def put(self, key: bytes, result: CachedResult, ttl_s: float) -> None:
        """Into memory now, into Redis in the background."""
        self.memory.store(key, result, ttl_s)
        await self.redis.put(key, result, ttl_s)

    async def flush(self) -> None:
        """Wait for the Redis writes in flight."""
        await self.redis.flush()

    async def close(self) -> None:
        """Finish Redis writes, close Redis, drop memory."""
        await self.redis.close()
        await self.memory.close()
