"""Buckets and quotas in Redis: one limit across every replica that shares it.

Each admission is one `EVALSHA` of `admit.lua` (a second round trip, `EVAL`, only after Redis
lost its script cache). The script reads the clock with Redis `TIME`, so replicas whose clocks
disagree still share one bucket and one UTC day. Every call runs under
`asyncio.timeout(timeout_s)`; a failure raises BackendUnavailable and, for `retry_interval_s`,
later calls fail at once instead of each waiting for the timeout again.

An admission that times out has still been sent: a stalled Redis runs it when it resumes, and
one whose reply was merely late ran already. Unless the caller admits such requests anyway
(`charge_late`, for fail_open), it refused this one, so it must not be charged:

- The script gets a deadline on Redis's own clock, the moment the caller stops waiting, and
  charges nothing when it runs after it (it answers "late"). This process learns Redis's clock
  from every reply (each carries Redis `TIME`) and estimates it low, so the deadline errs
  early: a call refused as late while its caller still waits is sent again, once, with the
  clock it just learned (the first call, and the first after a long idle or a clock step).
- A script that ran before the deadline charged, and its reply came after the caller gave up
  (a network hiccup, a busy event loop): the call is not dropped but waited for a while
  longer, and a reply that says "charged" is given back with a refund call.

Whatever is stored at these keys is untrusted (anyone who can write to Redis can plant it): the
script treats a wrong type, a missing field or a value that is not a finite number in range as a
fresh bucket or counter, deletes the key and flags the check (`Outcome.repaired`); the reply is
checked again here, and one that is not what the script returns (a number out of range, or an
`allowed` that the levels it reports contradict) is a failed call.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from importlib import resources
from typing import Any
from urllib.parse import urlsplit

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import NoScriptError, RedisError

from engine.limits import bucket, quota
from engine.limits.plan import BackendUnavailable, Check, Level, Outcome

SCRIPT = resources.files("engine.limits").joinpath("admit.lua").read_text()
SCRIPT_SHA = hashlib.sha1(SCRIPT.encode()).hexdigest()

# The script's modes (ARGV[3]) and its `allowed` for a charge that ran past its deadline.
READ, CHARGE, REFUND = 0, 1, 2
LATE = 2

# This process's monotonic clock and Redis's clock may drift apart (NTP slews each by up to
# 500 ppm): the estimate of Redis's clock counts the time since it was learned this much short,
# so it errs low and a deadline errs early (a call refused as late is sent again, not charged).
CLOCK_DRIFT = 0.001

# How long a call whose caller was refused at the timeout is still waited for, to give back
# what it charged. A script that ran before its deadline has answered already: its reply is late
# only by the network or this event loop. Past this the connection is dropped (any later run
# of the script is past its deadline and charges nothing).
LATE_REPLY_WAIT_S = 10.0


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
        charge_late: bool = False,
        clock: Callable[[], float] = time.monotonic,
        now_us: Callable[[], int] | None = None,
        on_late_refund: Callable[[], None] | None = None,
    ) -> None:
        """`charge_late`: an admission that Redis runs after `timeout_s` still charges; true when
        the caller admits such requests anyway (fail_open: they ran, so they count), false when
        it refuses them (then they are never charged). `now_us` overrides Redis `TIME` (tests
        with a fake clock); leave it None in service. `on_late_refund` is called each time the
        charge of a reply that came too late is given back (a metric: how often it happens)."""
        # No client-side retries: an admission is not idempotent (a retried EVALSHA whose first
        # reply was lost would charge twice), and the retry interval already paces reconnects.
        self._client = Redis.from_url(url, retry=Retry(NoBackoff(), 0))
        self._where = redacted(url)
        self._namespace = namespace
        self._timeout_s = timeout_s
        self._retry_interval_s = retry_interval_s
        self._charge_late = charge_late
        self._clock = clock
        self._now_us = now_us
        self._on_late_refund = on_late_refund
        self._down_until = 0.0
        self._last_error = ""
        # Redis's clock (Unix seconds) in the latest reply, and `clock()` when it came.
        self._learned: tuple[float, float] | None = None
        self._settling: set[asyncio.Task[None]] = set()

    def key(self, tenant: str, check: Check) -> str:
        """The Redis key holding `check` for `tenant`."""
        return f"{self._namespace}:rl:{{{tenant}}}:{check.slot}"

    async def apply(
        self, tenant: str, checks: Sequence[Check], units: int, *, commit: bool
    ) -> Outcome:
        """Evaluate and (if all pass and `commit`) charge `checks` in one script call."""
        self._check_up()
        if commit and not self._charge_late:
            return await self._charge(tenant, checks, units)
        mode = CHARGE if commit else READ
        return await self._script(tenant, checks, self._args(checks, units, mode))

    async def refund(
        self, tenant: str, checks: Sequence[Check], units: int, charged_at_unix_s: float
    ) -> None:
        """Give back `units` of an admission's charge (see LimitBackend.refund), in one script
        call; its reply is checked like an admission's."""
        self._check_up()
        await self._script(tenant, checks, self._args(checks, units, REFUND, charged_at_unix_s))

    async def aclose(self) -> None:
        """Stop waiting for late replies and close the connection pool."""
        for task in self._settling:
            task.cancel()
        await asyncio.gather(*self._settling, return_exceptions=True)
        await self._client.aclose()

    def _check_up(self) -> None:
        wait_s = self._down_until - self._clock()
        if wait_s > 0:
            raise BackendUnavailable(
                f"{self._last_error}; not retrying redis for another {wait_s:.2f} s"
            )

    async def _script(
        self, tenant: str, checks: Sequence[Check], args: list[str | int | float]
    ) -> Outcome:
        try:
            async with asyncio.timeout(self._timeout_s):
                outcome, _ = await self._call(tenant, checks, args)
        except TimeoutError as exc:
            raise self._timed_out() from exc
        except (RedisError, OSError) as exc:
            raise self._broken(exc) from exc
        return outcome

    async def _charge(self, tenant: str, checks: Sequence[Check], units: int) -> Outcome:
        """An admission whose caller refuses it if Redis does not answer in time: the call
        charges only before its deadline, and a charge whose reply came too late is given
        back (see the module docstring)."""
        call = asyncio.create_task(self._charge_by_deadline(tenant, checks, units))
        try:
            async with asyncio.timeout(self._timeout_s):
                return await asyncio.shield(call)
        except TimeoutError as exc:
            task = asyncio.create_task(self._give_back(call, tenant, checks, units))
            self._settling.add(task)
            task.add_done_callback(self._settling.discard)
            raise self._timed_out() from exc
        except (RedisError, OSError) as exc:
            raise self._broken(exc) from exc
        except asyncio.CancelledError:
            # The caller left: drop the call, as without the shield (redis-py closes its
            # connection, so a half-read reply never reaches another caller).
            call.cancel()
            if call.done() and not call.cancelled():
                call.exception()  # it ended just before: retrieved, so never reported
            raise
        finally:
            # The call's task keeps the error it ended with, whose traceback holds this frame:
            # a cycle (until the collector runs) unless this frame lets go of the task.
            del call

    async def _charge_by_deadline(
        self, tenant: str, checks: Sequence[Check], units: int
    ) -> Outcome:
        started_s = self._clock()
        repaired: tuple[Check, ...] = ()  # by a late call: the next finds nothing to repair
        for _ in range(2):  # the second only when our idea of Redis's clock was behind
            deadline_us = self._deadline_us(started_s)
            if deadline_us is None:
                break
            args = self._args(checks, units, CHARGE, deadline_us=deadline_us)
            try:
                outcome, late = await self._call(tenant, checks, args)
            except (RedisError, OSError) as exc:
                # Without redis-py's frames: one holds the asyncio.timeout of its read, which
                # holds this task, which keeps this error (a cycle, until the collector runs).
                raise exc.with_traceback(None)  # noqa: B904 (the same error, re-raised)
            if not late:
                return replace(outcome, repaired=repaired + outcome.repaired)
            repaired += outcome.repaired
        raise BackendUnavailable(
            f"redis at {self._where} ran the admission after its deadline ({self._timeout_s} s)"
        )

    def _deadline_us(self, started_s: float) -> int | None:
        """Redis's clock when a call started at `started_s` times out, estimated early; 0 while
        Redis's clock is unknown (that call only learns it); None once the call has timed out."""
        now_s = self._clock()
        left_s = started_s + self._timeout_s - now_s
        if left_s <= 0:
            return None
        if self._learned is None:
            return 0
        redis_s, learned_at_s = self._learned
        since_s = max(0.0, now_s - learned_at_s) * (1 - CLOCK_DRIFT)
        return math.floor((redis_s + since_s + left_s) * 1_000_000)

    async def _give_back(
        self, call: asyncio.Task[Outcome], tenant: str, checks: Sequence[Check], units: int
    ) -> None:
        """Wait for the reply of an admission whose caller was refused at the timeout and, if
        Redis charged it, refund the charge. When Redis cannot tell or take it, it stands."""
        try:
            async with asyncio.timeout(LATE_REPLY_WAIT_S):
                outcome = await call
            if outcome.allowed:
                args = self._args(checks, units, REFUND, outcome.now_unix_s)
                async with asyncio.timeout(self._timeout_s):
                    await self._call(tenant, checks, args)
                if self._on_late_refund is not None:
                    self._on_late_refund()
        except (TimeoutError, RedisError, OSError, BackendUnavailable):
            pass
        finally:
            del call  # as in _charge: its error's traceback holds this frame

    def _args(
        self,
        checks: Sequence[Check],
        units: int,
        mode: int,
        charged_at_unix_s: float = 0,
        *,
        deadline_us: int | None = None,
    ) -> list[str | int | float]:
        """The script's ARGV (admit.lua's header describes them)."""
        args: list[str | int | float] = ["" if self._now_us is None else self._now_us(), units]
        args += [mode, "" if deadline_us is None else deadline_us]
        for check in checks:
            if check.kind == "bucket":
                args += [check.kind, check.rate_per_s, check.burst]
            else:
                args += [check.kind, check.limit, charged_at_unix_s]
        return args

    async def _call(
        self, tenant: str, checks: Sequence[Check], args: list[str | int | float]
    ) -> tuple[Outcome, bool]:
        """The script's checked reply, and whether it ran past its deadline (then it charged
        nothing). Every reply tells Redis's clock and that Redis is up."""
        keys = [self.key(tenant, check) for check in checks]
        reply = await self._run(keys, args)
        # ARGV[2] units, ARGV[3] mode, ARGV[4] the deadline
        outcome = _outcome(
            checks, reply, units=int(args[1]), mode=int(args[2]), late_ok=args[3] != ""
        )
        self._learned = (outcome.now_unix_s, self._clock())
        self._down_until = 0.0
        return outcome, reply[0] == LATE

    async def _run(self, keys: list[str], args: list[str | int | float]) -> Any:
        try:
            return await self._client.evalsha(SCRIPT_SHA, len(keys), *keys, *args)
        except NoScriptError:
            # Redis restarted or ran SCRIPT FLUSH: EVAL runs the script and caches it again.
            return await self._client.eval(SCRIPT, len(keys), *keys, *args)

    def _timed_out(self) -> BackendUnavailable:
        return self._failed(f"redis at {self._where} did not answer within {self._timeout_s} s")

    def _broken(self, exc: Exception) -> BackendUnavailable:
        return self._failed(f"redis at {self._where} failed: {type(exc).__name__}: {exc}")

    def _failed(self, message: str) -> BackendUnavailable:
        self._last_error = message
        self._down_until = self._clock() + self._retry_interval_s
        return BackendUnavailable(message)


# Above this a double no longer counts units exactly; the script treats bigger counters as garbage.
MAX_COUNT = 2**53


def _outcome(
    checks: Sequence[Check], reply: Any, *, units: int, mode: int, late_ok: bool = False
) -> Outcome:
    """The script's reply to a call of `units` in `mode`, checked: it comes over a socket, so a
    reply that is not exactly what `admit.lua` returns (finite numbers in range, and `allowed`
    as its levels say) is a failed call, never a crash later on. `late_ok`: the call had a
    deadline, so `allowed` may be 2 (late: refused, nothing charged)."""
    try:
        return _parse(checks, reply, units, mode, late_ok)
    except (TypeError, ValueError, IndexError, OverflowError) as exc:
        raise BackendUnavailable(f"redis answered a malformed admission reply: {exc}") from exc


def _parse(checks: Sequence[Check], reply: Any, units: int, mode: int, late_ok: bool) -> Outcome:
    if not isinstance(reply, list) or len(reply) != 2 + 3 * len(checks):
        raise ValueError(f"expected {2 + 3 * len(checks)} values, got {reply!r:.200}")
    if reply[0] not in ((0, 1, LATE) if late_ok else (0, 1)):
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
    if mode != REFUND and reply[0] != LATE:  # a refund always applies; a late call was refused
        failing = [level.check.slot for level in levels if not _passes(level, units)]
        if (reply[0] == 1) == bool(failing):
            # Refused with every check passing would leave no reason to tell the client (and
            # admitted over a failing check would overspend it): the script says neither.
            raise ValueError(
                f"allowed is {reply[0]} for {units} units, but "
                + (f"{', '.join(failing)} fails" if failing else "every check passes")
            )
    return Outcome(reply[0] == 1, tuple(levels), now_us / 1_000_000, tuple(repaired))


def _passes(level: Level, units: int) -> bool:
    """Whether `level` passes a request of `units`, as the script and `verdict.report` judge."""
    if level.check.kind == "bucket":
        return bucket.passes(level.level, units)
    return quota.passes(round(level.level), units, level.check.limit)


def _number(raw: Any, name: str, low: float, high: float) -> float:
    value = float(raw)  # float() of bytes is fine: b"2.5", but also b"nan" and b"inf"
    if not (math.isfinite(value) and low <= value <= high):
        raise ValueError(f"{name} is {value}, outside [{low}, {high}]")
    return value
