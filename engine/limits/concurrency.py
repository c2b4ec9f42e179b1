"""Caps on requests in flight, per tenant and per tenant+model, in this process.

Unlike buckets and quotas these are never shared through Redis: a slot must be given back
when its request ends, and a replica that dies would leak its slots in a shared counter.
So `max_concurrent` holds per replica.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.limits.plan import Cap


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
