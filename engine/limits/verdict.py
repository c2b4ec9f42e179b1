"""What clients are told: per-check reports, X-RateLimit headers, the rejection errors and the
body of `GET /v2/tenants/self/usage`.

Derived from a backend's `Outcome` with the shared arithmetic of `bucket` and `quota`, so the
memory and Redis backends answer with the same numbers and the same words.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from engine.errors import InvalidInput, QuotaExceeded, RateLimited
from engine.limits import bucket, quota
from engine.limits.local import ConcurrencyGate
from engine.limits.plan import Cap, Check, Level

_PERIOD_WORD = {"day": "daily", "month": "monthly"}


@dataclass(frozen=True, slots=True)
class Report:
    """One check after an admission: did it pass, what is left, when does it recover."""

    check: Check
    passed: bool
    remaining: float
    """Bucket: tokens left. Quota: units left in the window."""
    retry_after_s: float
    """Seconds until this check would pass the same request (0 if it passed)."""
    reset_after_s: float
    """Bucket: seconds until full. Quota: seconds until the window ends."""
    used: int = 0
    """Quota: units used in the window."""
    resets_at_s: float = 0.0
    """Quota: Unix time the window ends."""


def report(level: Level, units: int, charged: bool, now_unix_s: float) -> Report:
    """The report for one check of a request of `units`, charged or not."""
    # Durations are rounded to the microsecond (the backends' clock resolution), so float noise
    # such as 0.15000000000000002 never turns into an extra second of Retry-After.
    check = level.check
    if check.kind == "bucket":
        tokens = level.level
        passed = bucket.passes(tokens, units)
        after = tokens - units if charged else tokens
        retry_s = 0.0 if passed else bucket.retry_after_s(tokens, units, check.rate_per_s)
        return Report(
            check,
            passed,
            after,
            round(retry_s, 6),
            round(bucket.reset_after_s(after, check.burst, check.rate_per_s), 6),
        )
    used = round(level.level)
    passed = quota.passes(used, units, check.limit)
    used_after = used + units if charged else used
    reset_after_s = round(max(0.0, level.window_end_s - now_unix_s), 6)
    return Report(
        check,
        passed,
        max(0, check.limit - used_after),
        0.0 if passed else reset_after_s,
        reset_after_s,
        used_after,
        level.window_end_s,
    )


def headers(item: Report) -> dict[str, str]:
    """X-RateLimit-Limit / -Remaining / -Reset (seconds until full or until the window resets)."""
    limit = item.check.burst if item.check.kind == "bucket" else item.check.limit
    return {
        "X-RateLimit-Limit": number(limit),
        "X-RateLimit-Remaining": str(max(0, math.floor(item.remaining + 1e-9))),
        "X-RateLimit-Reset": str(bucket.whole_seconds(item.reset_after_s)),
    }


def tightest(reports: Sequence[Report]) -> Report | None:
    """The report with the least left: the one whose headers describe the request best."""
    return min(reports, key=lambda item: item.remaining, default=None)


def rejection(
    tenant: str, reports: Sequence[Report], units: int, unit: str
) -> tuple[str, RateLimited]:
    """The reason (`quota_day`, `quota_month` or `rate`) and error for a refused request: an
    exhausted quota wins (waiting for tokens would not help); otherwise the bucket that takes
    longest to recover."""
    failed = [item for item in reports if not item.passed]
    quotas = [item for item in failed if item.check.kind != "bucket"]
    if quotas:
        worst = max(quotas, key=lambda item: item.reset_after_s)
        return f"quota_{worst.check.kind}", QuotaExceeded(
            _quota_message(tenant, worst, units, unit), worst.retry_after_s, headers(worst)
        )
    worst = max(failed, key=lambda item: item.retry_after_s)
    check = worst.check
    return "rate", RateLimited(
        f"tenant '{tenant}'{_on(check.model)} is over its rate limit of "
        f"{number(check.rate_per_s)} {unit}/s (burst {number(check.burst)}): this request needs "
        f"{units}, {worst.remaining:.2f} available; retry in {worst.retry_after_s:.3f} s",
        worst.retry_after_s,
        headers(worst),
        tokens=unit == "tokens",
    )


def concurrency_limited(tenant: str, cap: Cap) -> RateLimited:
    """The error for a request over a `max_concurrent` cap."""
    return RateLimited(
        f"tenant '{tenant}' already has {cap.limit} requests in flight{_on(cap.model)}, its "
        f"max_concurrent limit; retry when one finishes",
        retry_after_s=1.0,
    )


def too_large(tenant: str, check: Check, units: int, unit: str) -> InvalidInput:
    """The error for a request bigger than a bucket can ever hold."""
    return InvalidInput(
        f"request of {units} {unit} exceeds tenant '{tenant}''s burst of {number(check.burst)} "
        f"{unit}{_on(check.model)}, so it can never pass; send at most "
        f"{math.floor(check.burst)} {unit} per request"
    )


def number(value: float) -> str:
    """`100` for 100.0, `2.5` for 2.5: limits as people wrote them."""
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def _quota_message(tenant: str, item: Report, units: int, unit: str) -> str:
    check = item.check
    period = _PERIOD_WORD[check.kind]
    resets = f"it resets at {quota.iso_utc(item.resets_at_s)}"
    if item.used >= check.limit:
        return (
            f"tenant '{tenant}'{_on(check.model)} used its {period} quota of {check.limit} "
            f"{unit} ({item.used} used); {resets}"
        )
    return (
        f"tenant '{tenant}'{_on(check.model)} has {check.limit - item.used} of its {period} quota "
        f"of {check.limit} {unit} left and this request needs {units}; {resets}"
    )


def _on(model: str | None) -> str:
    return "" if model is None else f" on model '{model}'"


def usage_report(
    tenant: str,
    unit: str,
    source: str,
    reports: Sequence[Report],
    caps: Sequence[Cap],
    gate: ConcurrencyGate,
    now_unix_s: float,
) -> dict[str, Any]:
    """JSON-ready usage: tenant-wide figures at the top, per-model ones under `models`.

    Each of `rate`, `day`, `month`, `concurrency` is null when that limit is not configured
    (quotas are only counted where configured, so an unlimited tenant costs no Redis writes).
    """
    models = sorted(
        {item.check.model for item in reports if item.check.model is not None}
        | {cap.model for cap in caps if cap.model is not None}
    )
    body: dict[str, Any] = {"tenant": tenant, "unit": unit, "source": source}
    body.update(_scope(tenant, None, reports, caps, gate))
    body["models"] = {model: _scope(tenant, model, reports, caps, gate) for model in models}
    body["as_of"] = quota.iso_utc(now_unix_s)
    return body


def _scope(
    tenant: str,
    model: str | None,
    reports: Sequence[Report],
    caps: Sequence[Cap],
    gate: ConcurrencyGate,
) -> dict[str, Any]:
    scope: dict[str, Any] = {"rate": None, "day": None, "month": None, "concurrency": None}
    for item in reports:
        check = item.check
        if check.model != model:
            continue
        if check.kind == "bucket":
            scope["rate"] = {
                "rate_per_s": check.rate_per_s,
                "burst": check.burst,
                "available": round(item.remaining, 3),
                "full_after_s": bucket.whole_seconds(item.reset_after_s),
            }
        else:
            scope[check.kind] = {
                "used": item.used,
                "limit": check.limit,
                "remaining": max(0, check.limit - item.used),
                "resets_at": quota.iso_utc(item.resets_at_s),
                "reset_after_s": bucket.whole_seconds(item.reset_after_s),
            }
    for cap in caps:
        if cap.model == model:
            scope["concurrency"] = {
                "in_flight": gate.in_flight(tenant, model),
                "max_concurrent": cap.limit,
            }
    return scope
