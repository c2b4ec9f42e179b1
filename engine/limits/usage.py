"""The body of `GET /v2/tenants/self/usage`: a tenant's limits and how much of them is used."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.limits import quota
from engine.limits.bucket import whole_seconds
from engine.limits.concurrency import ConcurrencyGate
from engine.limits.plan import Cap
from engine.limits.verdict import Report


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
                "full_after_s": whole_seconds(item.reset_after_s),
            }
        else:
            scope[check.kind] = {
                "used": item.used,
                "limit": check.limit,
                "remaining": max(0, check.limit - item.used),
                "resets_at": quota.iso_utc(item.resets_at_s),
                "reset_after_s": whole_seconds(item.reset_after_s),
            }
    for cap in caps:
        if cap.model == model:
            scope["concurrency"] = {
                "in_flight": gate.in_flight(tenant, model),
                "max_concurrent": cap.limit,
            }
    return scope
