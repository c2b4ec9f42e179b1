from __future__ import annotations

from engine.limits.plan import Cap, Check, build_plan, full_plan, tenant_limits
from engine.settings import RateLimitSettings


def settings() -> RateLimitSettings:
    return RateLimitSettings.model_validate(
        {
            "default": {"rate_per_s": 5},
            "tenants": {
                "acme": {
                    "rate_per_s": 50,
                    "burst": 100,
                    "max_concurrent": 16,
                    "priority": 2,
                    "quota_per_day": 1000,
                    "quota_per_month": 20000,
                    "max_queue_share": 0.5,
                    "models": {"resnet": {"rate_per_s": 10, "max_concurrent": 4}},
                },
                "free": {},
            },
        }
    )


def test_listed_tenant_gets_its_limits_and_unlisted_the_defaults() -> None:
    assert tenant_limits(settings(), "acme").rate_per_s == 50
    assert tenant_limits(settings(), "someone").rate_per_s == 5
    assert tenant_limits(settings(), "free").rate_per_s is None


def test_plan_for_unscoped_model_has_tenant_checks_only() -> None:
    plan = build_plan(settings(), "acme", "bert")
    assert plan.checks == (
        Check("bucket", None, rate_per_s=50, burst=100),
        Check("day", None, limit=1000),
        Check("month", None, limit=20000),
    )
    assert plan.caps == (Cap(None, 16),)
    assert (plan.priority, plan.max_queue_share) == (2, 0.5)


def test_plan_for_scoped_model_adds_its_limits() -> None:
    plan = build_plan(settings(), "acme", "resnet")
    assert plan.checks[-1] == Check("bucket", "resnet", rate_per_s=10, burst=10)
    assert plan.caps == (Cap(None, 16), Cap("resnet", 4))
    assert plan.smallest_bucket == Check("bucket", "resnet", rate_per_s=10, burst=10)


def test_default_burst_is_one_second_of_rate() -> None:
    assert build_plan(settings(), "someone", "m").checks == (
        Check("bucket", None, rate_per_s=5, burst=5),
    )


def test_tenant_without_limits_is_unlimited() -> None:
    plan = build_plan(settings(), "free", "m")
    assert plan.unlimited
    assert plan.smallest_bucket is None


def test_full_plan_covers_every_model() -> None:
    plan = full_plan(settings(), "acme")
    assert [check.slot for check in plan.checks] == [
        "*:bucket",
        "*:day",
        "*:month",
        "resnet:bucket",
    ]
    assert plan.caps == (Cap(None, 16), Cap("resnet", 4))
