"""Buckets and quotas in this process: the `memory` backend, and the Redis fallback."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from engine.limits import bucket, quota
from engine.limits.backend import Level, Outcome
from engine.limits.plan import Check


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

    async def aclose(self) -> None:
        """Nothing to release."""
