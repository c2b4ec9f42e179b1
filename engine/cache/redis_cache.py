"""Result cache in Redis, shared by replicas. Values use the binary layout of `codec`; TTL is
Redis expiry (SET ... PX). (Named redis_cache, not redis, so it never shadows the redis package.)

Redis is untrusted: anyone who can write to it can plant a value with a valid CRC. An entry is
served only if it decodes, is no larger than `max_entry_bytes`, fits the request (`Expected`:
output names, datatypes, shapes, rows) and, with a `signing_key`, carries this key's signature
for the Redis key it is read from; anything else is a miss, counted in `stats.rejected` and
`stats.errors`, logged like a failure, and deleted before the miss is answered.

Failure policy: Redis is an optimisation, never a dependency. Every call runs inside
`asyncio.timeout(timeout_s)`; a failure or timeout is a miss (get) or a skipped store (put),
counted in `stats.errors` and logged at most once per `error_log_interval_s`. After a failure
Redis is left alone for `retry_interval_s` (calls are instant misses, also counted as errors),
then the next call tries again: the connection pool reconnects by itself when Redis is back.

Cancellation: redis-py closes a connection whose reply was not fully read when a call is
cancelled or times out, so a late reply can never be read by the next caller on that connection
(tests/unit/engine/cache/test_redis_cache.py checks this through a delaying proxy).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, cast

from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError, ResponseError

from engine.cache import codec
from engine.cache.contract import CachedResult, CacheStats, Expected
from engine.settings import CacheSettings

T = TypeVar("T")
log = logging.getLogger("sluice.cache")

# Encoding or decoding more than this runs in a worker thread, off the event loop.
OFFLOAD_BYTES = 1 << 20
# Signing adds a SHA-256 pass (about 1 ms per MiB): signed entries go off the loop sooner.
SIGNED_OFFLOAD_BYTES = 256 << 10


class _Failed:
    """Marks a Redis call that failed (distinct from a None reply)."""


_FAILED = _Failed()


NOT_A_STRING = b"(not a string)"
"""Stands for an entry whose key holds another Redis type (a hash, a list): rejected and deleted
as a corrupt entry would be, not taken for Redis being down (which turned the cache off for
everyone while the key stayed)."""


def _entry_error(exc: ResponseError) -> bytes:
    if str(exc).startswith("WRONGTYPE"):
        return NOT_A_STRING
    raise exc


class RedisCache:
    """The `redis` backend. Keys are used verbatim (build them with `key.cache_key`)."""

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 0.05,
        max_entry_bytes: int = 16 << 20,
        error_log_interval_s: float = 30.0,
        retry_interval_s: float = 0.5,
        max_pending_writes: int = 1024,
        max_connections: int = 64,
        signing_key: bytes | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """With `signing_key`, entries are written signed and only signed ones are read."""
        self.url = url
        self._signer = None if signing_key is None else codec.Signer(signing_key)
        self._offload_bytes = OFFLOAD_BYTES if signing_key is None else SIGNED_OFFLOAD_BYTES
        self.timeout_s = timeout_s
        self.max_entry_bytes = max_entry_bytes
        self.error_log_interval_s = error_log_interval_s
        self.retry_interval_s = retry_interval_s
        self.max_pending_writes = max_pending_writes
        self._clock = clock
        # Retries are ours to decide (after retry_interval_s), so redis-py must not add any.
        self._pool = BlockingConnectionPool.from_url(
            url,
            max_connections=max_connections,
            timeout=timeout_s,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
        )
        self._client = Redis(connection_pool=self._pool)
        self._stats = CacheStats()
        self._writes: set[asyncio.Task[None]] = set()
        self._down_until = float("-inf")
        self._next_log = float("-inf")
        self._unlogged = 0
        self._closed = False
        self._disconnected = False

    @classmethod
    def from_settings(cls, settings: CacheSettings) -> RedisCache:
        """A RedisCache configured by the server's `cache` section (`redis_url` must be set)."""
        if not settings.redis_url:
            raise ValueError(f"cache backend '{settings.backend}' needs cache.redis_url")
        return cls(
            settings.redis_url,
            timeout_s=settings.redis_timeout_s,
            max_entry_bytes=settings.max_entry_bytes,
            error_log_interval_s=settings.error_log_interval_s,
            retry_interval_s=settings.redis_retry_interval_s,
            max_pending_writes=settings.redis_max_pending_writes,
            max_connections=settings.redis_max_connections,
            signing_key=(
                None
                if settings.signing_key is None
                else settings.signing_key.get_secret_value().encode()
            ),
        )

    @property
    def stats(self) -> CacheStats:
        """Hits, misses, errors, stores and skipped stores of this process's calls."""
        return self._stats

    @property
    def pending_writes(self) -> int:
        """Stores still on their way to Redis."""
        return len(self._writes)

    async def get(self, key: bytes, expected: Expected | None = None) -> CachedResult | None:
        """The stored result (read-only arrays) or None on a miss, a failure or an entry that is
        corrupt, wrongly signed or does not fit `expected`."""
        found = await self._fetch(key, expected, with_ttl=False)
        return None if found is None else found[0]

    async def get_with_ttl(
        self, key: bytes, expected: Expected | None = None
    ) -> tuple[CachedResult, float | None] | None:
        """Like `get`, plus the entry's remaining lifetime in seconds (one round trip)."""
        return await self._fetch(key, expected, with_ttl=True)

    async def put(self, key: bytes, result: CachedResult, ttl_s: float) -> None:
        """Encode `result` now (the caller may reuse its arrays at once); write it in the
        background. Skipped (and counted) when too large, when Redis is down or when
        `max_pending_writes` writes are already in flight."""
        if (
            self._closed
            or ttl_s <= 0
            or result.nbytes > self.max_entry_bytes
            or len(self._writes) >= self.max_pending_writes
        ):
            self._stats.skipped += 1
            return
        if self._clock() < self._down_until:
            self._stats.errors += 1
            return
        try:
            encode = functools.partial(codec.encode, result, signer=self._signer, key=key)
            offload = result.nbytes > self._offload_bytes
            value = await asyncio.to_thread(encode) if offload else encode()
        except (TypeError, ValueError, KeyError) as exc:  # not storable: never fail the reply
            self._stats.skipped += 1
            self._failure("encode", exc)
            return
        self._spawn(self._write(key, value, max(1, round(ttl_s * 1000))))

    async def delete(self, key: bytes) -> None:
        """Remove `key` (failures are counted, never raised)."""
        await self._call("delete", lambda: self._client.delete(key))

    async def flush(self) -> None:
        """Wait for the writes in flight (each is bounded by `timeout_s`)."""
        while self._writes:
            await asyncio.gather(*self._writes, return_exceptions=True)

    async def close(self) -> None:
        """Finish pending writes, then close every connection. Later calls are misses."""
        self._closed = True  # no new writes; the ones in flight may still finish
        await self.flush()
        self._disconnected = True
        await self._client.aclose(close_connection_pool=True)

    async def _fetch(
        self, key: bytes, expected: Expected | None, with_ttl: bool
    ) -> tuple[CachedResult, float | None] | None:
        if with_ttl:
            reply = await self._call("get", lambda: self._get_and_pttl(key))
        else:
            reply = await self._call("get", lambda: self._get(key))
        if isinstance(reply, _Failed) or reply[0] is None:
            self._stats.misses += 1
            return None
        raw, ttl_ms = reply[0], reply[1]
        decode = functools.partial(codec.decode, raw, signer=self._signer, key=key)
        try:
            if raw is NOT_A_STRING:
                raise codec.CorruptEntry("the key holds a Redis value that is not a string")
            offload = len(raw) > self._offload_bytes
            result = await asyncio.to_thread(decode) if offload else decode()
            if result.nbytes > self.max_entry_bytes:
                raise codec.CorruptEntry(
                    f"entry holds {result.nbytes} bytes; max_entry_bytes is {self.max_entry_bytes}"
                )
            problem = None if expected is None else expected.mismatch(result)
            if problem is not None:
                raise codec.CorruptEntry(f"entry does not fit the request: {problem}")
        except codec.CorruptEntry as exc:
            self._stats.misses += 1
            self._stats.rejected += 1
            self._failure("decode", exc)
            # Deleted before the miss is answered, so this DEL cannot land after the store of
            # the result computed next (a rare path: corruption, or someone planting entries).
            await self.delete(key)
            return None
        self._stats.hits += 1
        return result, (ttl_ms / 1000 if ttl_ms is not None and ttl_ms > 0 else None)

    async def _get(self, key: bytes) -> tuple[bytes | None, int | None]:
        try:
            raw = await self._client.get(key)
        except ResponseError as exc:
            return _entry_error(exc), None
        return cast("bytes | None", raw), None  # decode_responses is off: always bytes

    async def _get_and_pttl(self, key: bytes) -> tuple[bytes | None, int | None]:
        async with self._client.pipeline(transaction=False) as pipe:
            pipe.get(key)
            pipe.pttl(key)
            raw, ttl_ms = await pipe.execute(raise_on_error=False)
        if isinstance(raw, ResponseError):
            return _entry_error(raw), None
        for reply in (raw, ttl_ms):
            if isinstance(reply, Exception):
                raise reply
        return raw, ttl_ms

    async def _write(self, key: bytes, value: bytes, ttl_ms: int) -> None:
        reply = await self._call("set", lambda: self._client.set(key, value, px=ttl_ms))
        if not isinstance(reply, _Failed):
            self._stats.stores += 1

    async def _call(self, op: str, call: Callable[[], Awaitable[T]]) -> T | _Failed:
        if self._disconnected:
            return _FAILED
        if self._clock() < self._down_until:
            self._stats.errors += 1
            return _FAILED
        try:
            async with asyncio.timeout(self.timeout_s):
                return await call()
        except (RedisError, OSError, TimeoutError) as exc:
            # Not CancelledError: a caller's cancellation propagates (redis-py drops the
            # connection it interrupted). TimeoutError here is our own asyncio.timeout.
            self._down_until = self._clock() + self.retry_interval_s
            self._failure(op, exc)
            return _FAILED

    def _failure(self, op: str, exc: BaseException) -> None:
        self._stats.errors += 1
        now = self._clock()
        if now < self._next_log:
            self._unlogged += 1
            return
        suppressed, self._unlogged = self._unlogged, 0
        self._next_log = now + self.error_log_interval_s
        detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        log.warning(
            "redis cache %s failed (%s); served as a miss. %d more failures since the last report",
            op,
            detail,
            suppressed,
        )

    def _spawn(self, work: Awaitable[Any]) -> None:
        async def run() -> None:
            await work

        task = asyncio.get_running_loop().create_task(run())
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)
