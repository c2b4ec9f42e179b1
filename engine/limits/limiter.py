"""The admission facade: `Limiter.admit` says whether a tenant's request may run now.

    admission = await limiter.admit(principal.tenant, request.model_name, rows)
    with admission:                      # gives the concurrency slot back, whatever happens
        response = await run(request)    # admission.headers: X-RateLimit-* for the reply

Order within `admit`: the local concurrency slot first (free to undo), then one backend call
that evaluates and charges every bucket and quota together. A rejection, an exception or a
cancellation while waiting for Redis hands the slot back before `admit` returns.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from types import TracebackType
from typing import Any

from engine.errors import Overloaded
from engine.limits import verdict
from engine.limits.local import ConcurrencyGate, MemoryBackend
from engine.limits.plan import (
    BackendUnavailable,
    Check,
    LimitBackend,
    Outcome,
    Plan,
    build_plan,
    full_plan,
    tenant_limits,
)
from engine.settings import RateLimitSettings, SettingsError, TenantLimits

# Under "sluice." like every other logger of the server, so one filter selects them all.
logger = logging.getLogger("sluice.limits")


@dataclass
class LimiterCounters:
    """Running totals for metrics; read them, never reset them."""

    rejections: Counter[tuple[str, str]] = field(default_factory=Counter)
    """(tenant, reason) -> requests refused. Reasons: `rate`, `quota_day`, `quota_month`,
    `concurrency`, `too_large`, `unavailable` (Redis down with fail_open false)."""
    backend_failures: int = 0
    """Admissions and usage reads that Redis did not answer."""
    fallback_admissions: int = 0
    """Of those, the ones the local limiter decided instead (fail_open)."""
    garbage_state: int = 0
    """Buckets and quota counters found in Redis holding garbage (planted, or a wrong type),
    evaluated as fresh and reset."""
    late_refunds: int = 0
    """Admissions Redis charged whose reply came after the caller stopped waiting (fail_open
    false: the request was refused with 503), given back by a refund call."""


class Admission:
    """A granted request. Holds its concurrency slots until `release()` (or the end of a
    `with`/`async with` block); releasing twice is harmless."""

    __slots__ = ("_holds", "_left", "_refund", "_release", "charged", "headers", "priority")

    def __init__(
        self,
        release: Callable[[], None] | None = None,
        headers: dict[str, str] | None = None,
        priority: int = 0,
    ) -> None:
        self._release = release
        self._holds = 0
        self._left = False  # the `with` block is over
        self._refund: Callable[[int], Awaitable[None]] | None = None
        self.charged = 0
        """Units charged to the tenant's buckets and quotas (0 when none applies)."""
        self.headers: dict[str, str] = headers or {}
        """X-RateLimit-Limit/-Remaining/-Reset of the tightest limit (empty if unlimited)."""
        self.priority = priority
        """The tenant's batching priority level (`TenantLimits.priority`)."""

    def release(self) -> None:
        """Give the concurrency slots back."""
        release, self._release = self._release, None
        if release is not None:
            release()

    def hold(self) -> Callable[[], None]:
        """Keep the concurrency slots past the end of the `with` block until the function
        returned is called: the batcher calls it when it is done with the request, which for a
        request whose caller left (or timed out) while it ran is once its batch is over."""
        if self._release is None:
            return _nothing
        self._holds += 1

        def let_go() -> None:
            self._holds -= 1
            if self._left and not self._holds:
                self.release()

        return let_go

    async def refund(self, units: int) -> None:
        """Give back `units` of the `charged` ones, once (later calls do nothing): for a request
        charged up front for more than it used, such as a generation that stopped before
        max_tokens. Never raises: when the backend cannot be reached the charge stands."""
        refund, self._refund = self._refund, None
        units = min(units, self.charged)
        if refund is not None and units > 0:
            await refund(units)

    def __enter__(self) -> Admission:
        return self

    def __exit__(self, *exc: object) -> None:
        self._left = True
        if not self._holds:
            self.release()

    async def __aenter__(self) -> Admission:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.__exit__()


def _nothing() -> None:
    pass


class Limiter:
    """Rate limits, quotas and concurrency caps for every tenant (see `build_limiter`)."""

    def __init__(
        self,
        settings: RateLimitSettings,
        backend: LimitBackend | None = None,
        *,
        local: MemoryBackend | None = None,
        clock: Callable[[], float] = time.monotonic,
        counters: LimiterCounters | None = None,
    ) -> None:
        """`backend` defaults to `local`, the in-process backend that is also the fallback.
        `counters`: the running totals, when the backend adds to them too (build_limiter)."""
        self._settings = settings
        self._local = local or MemoryBackend()
        self._backend: LimitBackend = backend or self._local
        self._clock = clock
        self._gate = ConcurrencyGate()
        self._plans: dict[tuple[str, str | None], Plan] = {}
        self._unlogged_failures = 0
        self._logged_at = -float("inf")
        self._unlogged_garbage = 0
        self._garbage_logged_at = -float("inf")
        self.counters = counters or LimiterCounters()

    @property
    def unit(self) -> str:
        """`requests`, `rows` or `tokens`: what a token and a quota unit count."""
        return self._settings.unit

    def limits_for(self, tenant: str) -> TenantLimits:
        """The tenant's configured limits (priority, max_queue_share, ...)."""
        return tenant_limits(self._settings, tenant)

    def in_flight(self, tenant: str, model: str | None = None) -> int:
        """Requests of `tenant` (on `model`, if given and capped) holding a slot now."""
        return self._gate.in_flight(tenant, model)

    async def admit(self, tenant: str, model: str, rows: int = 1) -> Admission:
        """Admit one request of `rows` rows (batch dimension) or raise.

        Raises RateLimited (bucket empty, or `max_concurrent` reached), QuotaExceeded (daily or
        monthly quota used), InvalidInput (more rows than the bucket can ever hold) or
        Overloaded (Redis unavailable and `fail_open` false).
        """
        plan = self._plan(tenant, model)
        if plan.unlimited:
            return Admission(priority=plan.priority)
        units = max(1, rows) if self._settings.unit in ("rows", "tokens") else 1
        smallest = plan.smallest_bucket
        if smallest is not None and units > smallest.burst:
            self._reject(tenant, "too_large")
            raise verdict.too_large(tenant, smallest, units, self.unit)
        full = self._gate.try_acquire(tenant, plan.caps)
        if full is not None:
            self._reject(tenant, "concurrency")
            raise verdict.concurrency_limited(tenant, full)
        admission = Admission(lambda: self._gate.release(tenant, plan.caps), priority=plan.priority)
        try:
            if plan.checks:
                admission.headers, charged_at, backend = await self._charge(
                    tenant, plan.checks, units
                )
                admission.charged = units
                admission._refund = partial(self._refund, tenant, plan.checks, charged_at, backend)
        except BaseException:
            admission.release()  # rejected, failed or cancelled: the slot must not leak
            raise
        return admission

    async def usage(self, tenant: str) -> dict[str, Any]:
        """The tenant's quotas, buckets and slots now, for `GET /v2/tenants/self/usage`."""
        plan = full_plan(self._settings, tenant)
        if plan.checks:
            outcome, source, _ = await self._apply(tenant, plan.checks, 0, commit=False)
        else:  # nothing stored anywhere: no round trip to Redis
            outcome, source = Outcome(True, (), time.time()), self._backend.name
        reports = [verdict.report(level, 0, False, outcome.now_unix_s) for level in outcome.levels]
        return verdict.usage_report(
            tenant, self.unit, source, reports, plan.caps, self._gate, outcome.now_unix_s
        )

    async def aclose(self) -> None:
        """Close the backend's connections."""
        await self._backend.aclose()

    def _plan(self, tenant: str, model: str) -> Plan:
        # Only models with limits of their own get a plan each, so clients sending made-up
        # model names cannot grow this cache; tenants are bounded by the configured keys.
        scoped = model if model in self.limits_for(tenant).models else None
        plan = self._plans.get((tenant, scoped))
        if plan is None:
            plan = self._plans[(tenant, scoped)] = build_plan(self._settings, tenant, scoped)
        return plan

    async def _charge(
        self, tenant: str, checks: Sequence[Check], units: int
    ) -> tuple[dict[str, str], float, LimitBackend]:
        """The headers of an admission charged `units`, the backend's clock then, and the
        backend that charged them (the local one when Redis failed open)."""
        outcome, _, backend = await self._apply(tenant, checks, units, commit=True)
        reports = [
            verdict.report(level, units, outcome.allowed, outcome.now_unix_s)
            for level in outcome.levels
        ]
        if not outcome.allowed:
            reason, error = verdict.rejection(tenant, reports, units, self.unit)
            self._reject(tenant, reason)
            raise error
        tightest = verdict.tightest(reports)
        headers = verdict.headers(tightest) if tightest is not None else {}
        return headers, outcome.now_unix_s, backend

    async def _refund(
        self,
        tenant: str,
        checks: Sequence[Check],
        charged_at_unix_s: float,
        backend: LimitBackend,
        units: int,
    ) -> None:
        try:
            await backend.refund(tenant, checks, units, charged_at_unix_s)
        except BackendUnavailable as exc:
            self._note_failure(exc)  # the tenant keeps paying what it did not use, no more

    async def _apply(
        self, tenant: str, checks: Sequence[Check], units: int, *, commit: bool
    ) -> tuple[Outcome, str, LimitBackend]:
        try:
            outcome = await self._backend.apply(tenant, checks, units, commit=commit)
        except BackendUnavailable as exc:
            self._note_failure(exc)
            if not self._settings.fail_open:
                self._reject(tenant, "unavailable")
                raise Overloaded(
                    f"rate limiter unavailable: {exc}", self._settings.redis_retry_interval_s
                ) from exc
            self.counters.fallback_admissions += 1
            outcome = await self._local.apply(tenant, checks, units, commit=commit)
            fallback = f"{self._local.name} (fallback: {self._backend.name} unavailable)"
            return outcome, fallback, self._local
        if outcome.repaired:
            self._note_garbage(tenant, outcome.repaired)
        return outcome, self._backend.name, self._backend

    def _note_garbage(self, tenant: str, repaired: Sequence[Check]) -> None:
        self.counters.garbage_state += len(repaired)
        self._unlogged_garbage += len(repaired)
        now = self._clock()
        if now - self._garbage_logged_at >= self._settings.error_log_interval_s:
            logger.warning(
                "%s rate limiter state held garbage %d time(s) since the last report (planted or "
                "corrupt values are evaluated as a fresh bucket or counter and reset); this "
                "time: tenant '%s', %s",
                self._backend.name,
                self._unlogged_garbage,
                tenant,
                ", ".join(check.slot for check in repaired),
            )
            self._garbage_logged_at = now
            self._unlogged_garbage = 0

    def _note_failure(self, exc: BackendUnavailable) -> None:
        self.counters.backend_failures += 1
        self._unlogged_failures += 1
        now = self._clock()
        if now - self._logged_at >= self._settings.error_log_interval_s:
            action = "using the local limiter" if self._settings.fail_open else "answering 503"
            logger.warning(
                "rate limiter backend failed %d time(s) since the last report, %s: %s",
                self._unlogged_failures,
                action,
                exc,
            )
            self._logged_at = now
            self._unlogged_failures = 0

    def _reject(self, tenant: str, reason: str) -> None:
        self.counters.rejections[(tenant, reason)] += 1


def build_limiter(settings: RateLimitSettings) -> Limiter:
    """The limiter `settings` describe: in-process, or Redis with the in-process fallback."""
    if settings.backend == "memory":
        return Limiter(settings)
    if not settings.redis_url:
        raise SettingsError("rate_limit.backend is 'redis' but rate_limit.redis_url is not set")
    from engine.limits.redis_backend import RedisBackend  # the redis client: only when used

    counters = LimiterCounters()

    def count_late_refund() -> None:
        counters.late_refunds += 1

    backend = RedisBackend(
        settings.redis_url,
        namespace=settings.namespace,
        timeout_s=settings.redis_timeout_s,
        retry_interval_s=settings.redis_retry_interval_s,
        charge_late=settings.fail_open,
        on_late_refund=count_late_refund,
    )
    return Limiter(settings, backend, counters=counters)
