"""Limits kept in this process: the `memory` backend (also the Redis fallback) and the
concurrency caps.

Caps on requests in flight are never shared through Redis: a slot must be given back when its
request ends, and a replica that dies would leak its slots in a shared counter. So
`max_concurrent` holds per replica.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from engine.limits import bucket, quota
from engine.limits.plan import Cap, Check, Level, Outcome


class MemoryBackend:
    """Per-process limits. Buckets run on `clock` (monotonic, immune to wall-clock steps);
    quota windows on `wall_clock` (Unix time, since they reset at UTC midnight).

    Nothing awaits between reading and charging, so one event loop needs no lock. State grows
    with the number of tenants and configured per-model limits, both bounded by the settings.
    """

    name = "memory"

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._clock = clock
        self._wall_clock = wall_clock
        self._buckets: dict[tuple[str, str], bucket.BucketState] = {}
        self._quotas: dict[tuple[str, str], quota.QuotaState] = {}

    async def apply(
        self, tenant: str, checks: Sequence[Check], units: int, *, commit: bool
    ) -> Outcome:
        """Evaluate and (if all pass and `commit`) charge `checks` for `units`."""
        return self.apply_now(tenant, checks, units, commit=commit)

    def apply_now(
        self, tenant: str, checks: Sequence[Check], units: int, *, commit: bool
    ) -> Outcome:
        """`apply` without the coroutine, for callers outside an event loop."""
        now_s = self._clock()
        now_unix_s = self._wall_clock()
        levels: list[Level] = []
        allowed = True
        for check in checks:
            key = (tenant, check.slot)
            if check.kind == "bucket":
                tokens = bucket.refill(self._buckets.get(key), now_s, check.rate_per_s, check.burst)
                allowed &= bucket.passes(tokens, units)
                levels.append(Level(check, tokens))
            else:
                current = quota.window(check.kind, now_unix_s)
                used = quota.used_in(self._quotas.get(key), current)
                allowed &= quota.passes(used, units, check.limit)
                levels.append(Level(check, used, current.end_s))
        if allowed and commit:
            for level in levels:
                key = (tenant, level.check.slot)
                if level.check.kind == "bucket":
                    self._buckets[key] = bucket.BucketState(level.level - units, now_s)
                else:
                    current = quota.window(level.check.kind, now_unix_s)
                    self._quotas[key] = quota.QuotaState(current.id, int(level.level) + units)
        return Outcome(allowed, tuple(levels), now_unix_s)

    async def refund(
        self, tenant: str, checks: Sequence[Check], units: int, charged_at_unix_s: float
    ) -> None:
        """Give back `units` of an admission's charge (see LimitBackend.refund)."""
        now_s = self._clock()
        for check in checks:
            key = (tenant, check.slot)
            if check.kind == "bucket":
                state = self._buckets.get(key)
                if state is not None:  # no state is a full bucket already
                    tokens = bucket.refill(state, now_s, check.rate_per_s, check.burst)
                    self._buckets[key] = bucket.BucketState(min(check.burst, tokens + units), now_s)
            else:
                charged = quota.window(check.kind, charged_at_unix_s)
                counter = self._quotas.get(key)
                if counter is not None and counter.window_id == charged.id:
                    self._quotas[key] = quota.QuotaState(charged.id, max(0, counter.used - units))

    async def aclose(self) -> None:
        """Nothing to release."""


class ConcurrencyGate:
    """Counts requests in flight by (tenant, model or None) and enforces their caps."""

    def __init__(self) -> None:
        self._in_flight: dict[tuple[str, str | None], int] = {}

    def in_flight(self, tenant: str, model: str | None = None) -> int:
        """Requests holding a slot for `tenant` (for `model`, or tenant-wide when None)."""
        return self._in_flight.get((tenant, model), 0)

    def try_acquire(self, tenant: str, caps: Sequence[Cap]) -> Cap | None:
        """Take one slot under every cap, or none: returns the cap that is full, else None."""
        for cap in caps:
            if self.in_flight(tenant, cap.model) >= cap.limit:
                return cap
        for cap in caps:
            key = (tenant, cap.model)
            self._in_flight[key] = self._in_flight.get(key, 0) + 1
        return None

    def release(self, tenant: str, caps: Sequence[Cap]) -> None:
        """Give back the slots `try_acquire` took (callers make sure this happens once)."""
        for cap in caps:
            key = (tenant, cap.model)
            count = self._in_flight.get(key, 0) - 1
            if count > 0:
                self._in_flight[key] = count
            else:
                self._in_flight.pop(key, None)
