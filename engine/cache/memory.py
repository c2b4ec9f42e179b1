"""In-process result cache: least-recently-used, bounded by the bytes of the stored arrays, with
a TTL per entry measured on a monotonic clock."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from engine.cache.contract import CachedResult, CacheStats, Expected, frozen_copy, read_only_views


@dataclass(slots=True)
class _Entry:
    result: CachedResult
    nbytes: int
    expires_at: float


class MemoryCache:
    """An LRU dict of frozen results. Everything runs on the event loop, so no lock is needed.

    `capacity_bytes` bounds the summed array bytes (BYTES tensors: element lengths) of all entries;
    storing past it evicts least-recently-used entries first. A result larger than
    `max_entry_bytes` (or the capacity) is not stored. `clock` returns seconds and defaults to
    time.monotonic; tests inject a fake one.
    """

    def __init__(
        self,
        capacity_bytes: int,
        max_entry_bytes: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.max_entry_bytes = min(max_entry_bytes or capacity_bytes, capacity_bytes)
        self._clock = clock
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        self._stats = CacheStats()

    @property
    def stats(self) -> CacheStats:
        """Hits, misses, evictions, expirations, stores, skipped, bytes and entries."""
        return self._stats

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        """Whether `key` is stored and not yet expired (does not count as a hit or touch it)."""
        entry = self._entries.get(key)
        return entry is not None and entry.expires_at > self._clock()

    async def get(self, key: bytes, expected: Expected | None = None) -> CachedResult | None:
        """The stored result as read-only views, or None (expired entries are dropped).
        `expected` is not checked: this process stored every entry itself."""
        return self.lookup(key)

    def lookup(self, key: bytes) -> CachedResult | None:
        """`get` without the coroutine, for callers already on the loop in synchronous code."""
        entry = self._entries.get(key)
        if entry is None:
            self._stats.misses += 1
            return None
        if entry.expires_at <= self._clock():
            self._remove(key, entry)
            self._stats.expirations += 1
            self._stats.misses += 1
            return None
        self._entries.move_to_end(key)
        self._stats.hits += 1
        return read_only_views(entry.result)

    async def put(self, key: bytes, result: CachedResult, ttl_s: float) -> None:
        """Store a frozen copy of `result` for `ttl_s` seconds (visible as soon as this returns)."""
        self.store(key, result, ttl_s)

    def store(self, key: bytes, result: CachedResult, ttl_s: float, *, copy: bool = True) -> bool:
        """Synchronous `put`; False when the result was too large to store.

        `copy=False` stores `result` as is: only for results whose arrays are already read-only
        and referenced by nobody who could write them (e.g. just decoded from Redis).
        """
        nbytes = result.nbytes
        if nbytes > self.max_entry_bytes or ttl_s <= 0:
            self._stats.skipped += 1
            return False
        old = self._entries.get(key)
        if old is not None:
            self._remove(key, old)
        while self._entries and self._stats.bytes + nbytes > self.capacity_bytes:
            victim_key, victim = next(iter(self._entries.items()))
            self._remove(victim_key, victim)
            self._stats.evictions += 1
        stored = frozen_copy(result) if copy else result
        self._entries[key] = _Entry(stored, nbytes, self._clock() + ttl_s)
        self._stats.bytes += nbytes
        self._stats.entries = len(self._entries)
        self._stats.stores += 1
        return True

    def discard(self, key: bytes) -> None:
        """Forget `key` if it is stored."""
        entry = self._entries.get(key)
        if entry is not None:
            self._remove(key, entry)

    def clear(self) -> None:
        """Forget every entry (e.g. when all models are unloaded)."""
        self._entries.clear()
        self._stats.bytes = 0
        self._stats.entries = 0

    async def flush(self) -> None:
        """Nothing is ever pending in memory."""

    async def close(self) -> None:
        """Drop every entry."""
        self.clear()

    def _remove(self, key: bytes, entry: _Entry) -> None:
        del self._entries[key]
        self._stats.bytes -= entry.nbytes
        self._stats.entries = len(self._entries)
