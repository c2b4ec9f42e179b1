"""Buckets and quotas in Redis: one limit across every replica that shares it.

Each admission is one `EVALSHA` of `admit.lua` (a second round trip, `EVAL`, only after Redis
lost its script cache). The script reads the clock with Redis `TIME`, so replicas whose clocks
disagree still share one bucket and one UTC day. Every call runs under
`asyncio.timeout(timeout_s)`; a failure raises BackendUnavailable and, for `retry_interval_s`,
later calls fail at once instead of each waiting for the timeout again.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable, Sequence
from importlib import resources
from typing import Any
from urllib.parse import urlsplit

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError, RedisError

from engine.limits.plan import BackendUnavailable, Check, Level, Outcome

SCRIPT = resources.files("engine.limits").joinpath("admit.lua").read_text()
SCRIPT_SHA = hashlib.sha1(SCRIPT.encode()).hexdigest()


def redacted(url: str) -> str:
    """`host:port` of a Redis URL, without the password, for messages and logs."""
    parts = urlsplit(url)
    return f"{parts.hostname or '?'}:{parts.port or 6379}"


class RedisBackend:
    """The `redis` backend. Keys: `<namespace>:rl:{<tenant>}:<model or *>:<kind>`."""

    name = "redis"

    def __init__(
        self,
        url: str,
        *,
        namespace: str = "sluice",
        timeout_s: float = 0.05,
        retry_interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        now_us: Callable[[], int] | None = None,
    ) -> None:
        """`now_us` overrides Redis `TIME` (tests with a fake clock); leave it None in service."""
        # No client-side retries: an admission is not idempotent (a retried EVALSHA whose first
        # reply was lost would charge twice), and the retry interval already paces reconnects.
        self._client = Redis.from_url(url, retry=Retry(NoBackoff(), 0))
        self._where = redacted(url)
        self._namespace = namespace
        self._timeout_s = timeout_s
        self._retry_interval_s = retry_interval_s
        self._clock = clock
        self._now_us = now_us
        self._down_until = 0.0
        self._last_error = ""

    def key(self, tenant: str, check: Check) -> str:
        """The Redis key holding `check` for `tenant`."""
        return f"{self._namespace}:rl:{{{tenant}}}:{check.slot}"

    async def apply(
        self, tenant: str, checks: Sequence[Check], units: int, *, commit: bool
    ) -> Outcome:
        """Evaluate and (if all pass and `commit`) charge `checks` in one script call."""
        wait_s = self._down_until - self._clock()
        if wait_s > 0:
            raise BackendUnavailable(
                f"{self._last_error}; not retrying redis for another {wait_s:.2f} s"
            )
        keys = [self.key(tenant, check) for check in checks]
        args: list[str | int | float] = ["" if self._now_us is None else self._now_us(), units]
        args.append(1 if commit else 0)
        for check in checks:
            if check.kind == "bucket":
                args += [check.kind, check.rate_per_s, check.burst]
            else:
                args += [check.kind, check.limit, 0]
        try:
            async with asyncio.timeout(self._timeout_s):
                reply = await self._run(keys, args)
        except TimeoutError as exc:
            raise self._failed(
                f"redis at {self._where} did not answer within {self._timeout_s} s"
            ) from exc
        except (RedisError, OSError) as exc:
            raise self._failed(
                f"redis at {self._where} failed: {type(exc).__name__}: {exc}"
            ) from exc
        self._down_until = 0.0
        return _outcome(checks, reply)

    async def _run(self, keys: list[str], args: list[str | int | float]) -> Any:
        try:
            return await self._client.evalsha(SCRIPT_SHA, len(keys), *keys, *args)
        except NoScriptError:
            # Redis restarted or ran SCRIPT FLUSH: EVAL runs the script and caches it again.
            return await self._client.eval(SCRIPT, len(keys), *keys, *args)

    def _failed(self, message: str) -> BackendUnavailable:
        self._last_error = message
        self._down_until = self._clock() + self._retry_interval_s
        return BackendUnavailable(message)

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self._client.aclose()


def _outcome(checks: Sequence[Check], reply: Any) -> Outcome:
    values = [float(value) for value in reply[2:]]
    levels = tuple(Level(check, values[2 * i], values[2 * i + 1]) for i, check in enumerate(checks))
    return Outcome(int(reply[0]) == 1, levels, float(reply[1]) / 1_000_000)
