"""The contract between the `Limiter` and where buckets and quotas are stored.

A backend evaluates every check of a plan at once and, when all pass and `commit` is set,
charges them all: a request rejected by one limit uses up none of the others. It reports the
raw levels (tokens before the request, units used before it); the limiter derives what clients
are told from them, the same way for every backend.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from engine.limits.plan import Check


class BackendUnavailable(Exception):
    """The backend could not answer (Redis down, slow or failing); `str()` says why."""


@dataclass(frozen=True, slots=True)
class Level:
    """One check's state when the request was evaluated."""

    check: Check
    level: float
    """Bucket: tokens available before this request. Quota: units used before it."""
    window_end_s: float = 0.0
    """Quota: Unix time at which the current window ends (the counter resets)."""


@dataclass(frozen=True, slots=True)
class Outcome:
    """The backend's answer for one admission."""

    allowed: bool
    """Every check passed (and, if committed, every check was charged)."""
    levels: tuple[Level, ...]
    now_unix_s: float
    """The backend's clock (Redis `TIME` for Redis) at evaluation."""


class LimitBackend(Protocol):
    """Stores buckets and quotas; `memory` for one process, `redis` across replicas."""

    name: str

    async def apply(
        self, tenant: str, checks: Sequence[Check], units: int, *, commit: bool
    ) -> Outcome:
        """Evaluate `checks` for `units`; charge all of them only if all pass and `commit`."""
        ...

    async def aclose(self) -> None:
        """Release connections."""
        ...
