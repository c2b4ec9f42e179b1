"""Buckets and quotas in Redis: one limit across every replica that shares it.

Each admission is one `EVALSHA` of `admit.lua` (a second round trip, `EVAL`, only after Redis
lost its script cache). The script reads the clock with Redis `TIME`, so replicas whose clocks
disagree still share one bucket and one UTC day. Every call runs under
`asyncio.timeout(timeout_s)`; a failure raises BackendUnavailable and, for `retry_interval_s`,
later calls fail at once instead of each waiting for the timeout again.

Whatever is stored at these keys is untrusted (anyone who can write to Redis can plant it): the
script treats a wrong type, a missing field or a value that is not a finite number in range as a
fresh bucket or counter, deletes the key and flags the check (`Outcome.repaired`); the reply is
checked again here, and one that is not what the script returns is a failed call.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
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
        return await self._script(tenant, checks, units, 1 if commit else 0, 0)

    async def refund(
        self, tenant: str, checks: Sequence[Check], units: int, charged_at_unix_s: float
    ) -> None:
        """Give back `units` of an admission's charge (see LimitBackend.refund), in one script
        call; its reply is checked like an admission's."""
        await self._script(tenant, checks, units, 2, charged_at_unix_s)

    async def _script(
        self, tenant: str, checks: Sequence[Check], units: int, mode: int, quota_arg: float
    ) -> Outcome:
        wait_s = self._down_until - self._clock()
        if wait_s > 0:
            raise BackendUnavailable(
                f"{self._last_error}; not retrying redis for another {wait_s:.2f} s"
            )
        keys = [self.key(tenant, check) for check in checks]
        args: list[str | int | float] = ["" if self._now_us is None else self._now_us(), units]
        args.append(mode)
        for check in checks:
            if check.kind == "bucket":
                args += [check.kind, check.rate_per_s, check.burst]
            else:
                args += [check.kind, check.limit, quota_arg]
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


# Above this a double no longer counts units exactly; the script treats bigger counters as garbage.
MAX_COUNT = 2**53


def _outcome(checks: Sequence[Check], reply: Any) -> Outcome:
    """The script's reply, checked: it comes over a socket, so a reply that is not exactly what
    `admit.lua` returns (finite numbers in range) is a failed call, never a crash later on."""
    try:
        return _parse(checks, reply)
    except (TypeError, ValueError, IndexError, OverflowError) as exc:
        raise BackendUnavailable(f"redis answered a malformed admission reply: {exc}") from exc


def _parse(checks: Sequence[Check], reply: Any) -> Outcome:
    if not isinstance(reply, list) or len(reply) != 2 + 3 * len(checks):
        raise ValueError(f"expected {2 + 3 * len(checks)} values, got {reply!r:.200}")
    if reply[0] not in (0, 1):
        raise ValueError(f"allowed is {reply[0]!r}, not 0 or 1")
    now_us = _number(reply[1], "now_us", 0, math.inf)
    levels: list[Level] = []
    repaired: list[Check] = []
    for i, check in enumerate(checks):
        level, end_s, garbage = reply[2 + 3 * i : 5 + 3 * i]
        if check.kind == "bucket":
            levels.append(Level(check, _number(level, "tokens", 0, check.burst)))
        else:
            used = _number(level, "used", 0, MAX_COUNT)
            if not used.is_integer():
                raise ValueError(f"used is {used}, not a whole number")
            levels.append(Level(check, used, _number(end_s, "window_end_s", 0, math.inf)))
        if garbage not in (b"0", b"1", "0", "1"):
            raise ValueError(f"garbage flag is {garbage!r}")
        if garbage in (b"1", "1"):
            repaired.append(check)
    return Outcome(reply[0] == 1, tuple(levels), now_us / 1_000_000, tuple(repaired))


def _number(raw: Any, name: str, low: float, high: float) -> float:
    value = float(raw)  # float() of bytes is fine: b"2.5", but also b"nan" and b"inf"
    if not (math.isfinite(value) and low <= value <= high):
        raise ValueError(f"{name} is {value}, outside [{low}, {high}]")
    return value
