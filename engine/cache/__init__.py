"""Result cache: keys, the binary value codec, memory / Redis / tiered backends and in-flight
coalescing. The engine builds one cache with `build_cache(settings.cache)` and one `Coalescer`,
and looks requests up after admission and validation, before the batcher; `inference.py` is that
path of a request (`CachedInference`: the lookup, coalescing and storing around its computation)."""

from typing import TYPE_CHECKING

from engine.cache.coalesce import Coalescer
from engine.cache.codec import CorruptEntry, decode, encode
from engine.cache.contract import (
    CachedResult,
    CacheStats,
    Expected,
    ResultCache,
    copy_outputs,
    copy_result,
)
from engine.cache.factory import build_cache
from engine.cache.key import (
    TRANSPORT_PARAMETERS,
    cache_key,
    cache_key_async,
    cache_requested,
    namespace,
    request_key,
)
from engine.cache.memory import MemoryCache
from engine.cache.tiered import TieredCache

if TYPE_CHECKING:
    from engine.cache.redis_cache import RedisCache

__all__ = [
    "TRANSPORT_PARAMETERS",
    "CacheStats",
    "CachedResult",
    "Coalescer",
    "CorruptEntry",
    "Expected",
    "MemoryCache",
    "RedisCache",
    "ResultCache",
    "TieredCache",
    "build_cache",
    "cache_key",
    "cache_key_async",
    "cache_requested",
    "copy_outputs",
    "copy_result",
    "decode",
    "encode",
    "namespace",
    "request_key",
]


def __getattr__(name: str) -> object:
    # RedisCache imports the redis client (and, through it, OpenTelemetry's metrics SDK): a
    # server that uses no Redis starts without them.
    if name == "RedisCache":
        from engine.cache.redis_cache import RedisCache

        return RedisCache
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
