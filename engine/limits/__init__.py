"""Admission control: per-tenant token buckets, daily and monthly quotas, concurrency caps.

`build_limiter(settings.rate_limit)` gives the `Limiter`; `await limiter.admit(tenant, model,
rows)` returns an `Admission` to hold while the request runs, or raises RateLimited,
QuotaExceeded, InvalidInput or Overloaded (see engine/errors.py). Buckets and quotas live in
this process (`memory`) or in Redis (`redis`, one atomic Lua script per admission, Redis time);
concurrency caps are always per process.
"""

from typing import TYPE_CHECKING

from engine.limits.limiter import Admission, Limiter, LimiterCounters, build_limiter
from engine.limits.local import MemoryBackend
from engine.limits.plan import BackendUnavailable, LimitBackend, Outcome

if TYPE_CHECKING:
    from engine.limits.redis_backend import RedisBackend

__all__ = [
    "Admission",
    "BackendUnavailable",
    "LimitBackend",
    "Limiter",
    "LimiterCounters",
    "MemoryBackend",
    "Outcome",
    "RedisBackend",
    "build_limiter",
]


def __getattr__(name: str) -> object:
    # RedisBackend imports the redis client: a server that uses no Redis starts without it.
    if name == "RedisBackend":
        from engine.limits.redis_backend import RedisBackend

        return RedisBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
