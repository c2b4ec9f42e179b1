"""What to check for one tenant (and model), and what a backend answered.

`Plan` is resolved from `RateLimitSettings`; `LimitBackend` is the contract of where buckets
and quotas are stored; `Outcome` is its answer.

A plan lists token buckets and quotas (`Check`, evaluated by a backend) and concurrency caps
(`Cap`, always local to this process). Tenant-wide limits come from `rate_limit.tenants[tenant]`
or, for unlisted tenants, `rate_limit.default`; a model listed under that tenant's `models`
adds its own rate, burst, concurrency and quotas on top (both must pass).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from engine.limits.bucket import effective_burst
from engine.settings import RateLimitSettings, TenantLimits

CheckKind = Literal["bucket", "day", "month"]


@dataclass(frozen=True, slots=True)
class Check:
    """One token bucket (`rate_per_s`, `burst`) or one quota (`limit` per day or month)."""

    kind: CheckKind
    model: str | None
    """The model this check is scoped to; None for the tenant as a whole."""
    rate_per_s: float = 0.0
    burst: float = 0.0
    limit: int = 0

    @property
    def slot(self) -> str:
        """Names the check within its tenant (a Redis key suffix, a memory dict key)."""
        return f"{self.model or '*'}:{self.kind}"


@dataclass(frozen=True, slots=True)
class Cap:
    """A cap on requests in flight at once, for the tenant or one of its models."""

    model: str | None
    limit: int


@dataclass(frozen=True, slots=True)
class Plan:
    """Every limit that applies to one tenant's requests for one model."""

    tenant: str
    checks: tuple[Check, ...]
    caps: tuple[Cap, ...]
    priority: int
    """The tenant's batching level as in Triton (1 is the highest; 0: each model's default)."""
    max_queue_share: float

    @property
    def unlimited(self) -> bool:
        """No check and no cap: admission costs nothing."""
        return not self.checks and not self.caps

    @property
    def smallest_bucket(self) -> Check | None:
        """The bucket with the fewest tokens when full: the largest request that can ever pass."""
        buckets = [check for check in self.checks if check.kind == "bucket"]
        return min(buckets, key=lambda check: check.burst, default=None)


def tenant_limits(settings: RateLimitSettings, tenant: str) -> TenantLimits:
    """The tenant's own limits, or the defaults for tenants not listed."""
    return settings.tenants.get(tenant, settings.default)


def build_plan(settings: RateLimitSettings, tenant: str, model: str | None) -> Plan:
    """The plan for `tenant` calling `model` (None: the tenant-wide part only)."""
    limits = tenant_limits(settings, tenant)
    checks, caps = _scope(limits, None)
    if model is not None and model in limits.models:
        model_checks, model_caps = _scope(limits.models[model], model)
        checks += model_checks
        caps += model_caps
    return Plan(tenant, checks, caps, limits.priority, limits.max_queue_share)


def full_plan(settings: RateLimitSettings, tenant: str) -> Plan:
    """Every limit of `tenant`, tenant-wide and for each model it has limits on (for usage)."""
    limits = tenant_limits(settings, tenant)
    checks, caps = _scope(limits, None)
    for model, model_limits in limits.models.items():
        model_checks, model_caps = _scope(model_limits, model)
        checks += model_checks
        caps += model_caps
    return Plan(tenant, checks, caps, limits.priority, limits.max_queue_share)


def _scope(limits: TenantLimits, model: str | None) -> tuple[tuple[Check, ...], tuple[Cap, ...]]:
    checks: list[Check] = []
    if limits.rate_per_s is not None:
        burst = effective_burst(limits.rate_per_s, limits.burst)
        checks.append(Check("bucket", model, rate_per_s=limits.rate_per_s, burst=burst))
    if limits.quota_per_day is not None:
        checks.append(Check("day", model, limit=limits.quota_per_day))
    if limits.quota_per_month is not None:
        checks.append(Check("month", model, limit=limits.quota_per_month))
    caps = (Cap(model, limits.max_concurrent),) if limits.max_concurrent is not None else ()
    return tuple(checks), caps


# -- the backend contract ---------------------------------------------------------------------
# A backend evaluates every check of a plan at once and, when all pass and `commit` is set,
# charges them all: a request rejected by one limit uses up none of the others. It reports the
# raw levels (tokens before the request, units used before it); `verdict` derives what clients
# are told from them, the same way for every backend.


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
    repaired: tuple[Check, ...] = ()
    """Checks whose stored state was garbage (planted or corrupt): each was evaluated as fresh
    and its stored state reset. Always empty for the memory backend."""


class LimitBackend(Protocol):
    """Stores buckets and quotas; `memory` for one process, `redis` across replicas."""

    name: str

    async def apply(
        self, tenant: str, checks: Sequence[Check], units: int, *, commit: bool
    ) -> Outcome:
        """Evaluate `checks` for `units`; charge all of them only if all pass and `commit`."""
        ...

    async def refund(
        self, tenant: str, checks: Sequence[Check], units: int, charged_at_unix_s: float
    ) -> None:
        """Give back `units` that an admission at `charged_at_unix_s` (its Outcome's clock)
        charged: each bucket gains them (never past its burst), each quota counter loses them
        (never below zero, and only while it still counts the window that was charged)."""
        ...

    async def aclose(self) -> None:
        """Release connections."""
        ...
