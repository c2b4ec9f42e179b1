from __future__ import annotations

import pytest

from engine.errors import InvalidInput, QuotaExceeded, RateLimited
from engine.limits.plan import Cap, Check, Level
from engine.limits.quota import iso_utc
from engine.limits.verdict import (
    concurrency_limited,
    headers,
    number,
    rejection,
    report,
    tightest,
    too_large,
)

BUCKET = Check("bucket", None, rate_per_s=4.0, burst=10.0)
NOW = 1_742_040_000.0  # 2025-03-15T12:00:00Z
DAY = Check("day", None, limit=100)
DAY_END = 1_742_083_200.0  # 2025-03-16T00:00:00Z


def test_bucket_report_after_charge() -> None:
    item = report(Level(BUCKET, 3.0), 1, charged=True, now_unix_s=NOW)
    assert (item.passed, item.remaining, item.retry_after_s, item.reset_after_s) == (
        True,
        2.0,
        0.0,
        2.0,
    )
    assert headers(item) == {
        "X-RateLimit-Limit": "10",
        "X-RateLimit-Remaining": "2",
        "X-RateLimit-Reset": "2",
    }


def test_rate_rejection_has_exact_retry_after_and_headers() -> None:
    item = report(Level(BUCKET, 0.5), 3, charged=False, now_unix_s=NOW)
    reason, error = rejection("acme", [item], 3, "rows")
    assert reason == "rate"
    assert type(error) is RateLimited
    assert error.retry_after_s == 0.625
    assert error.retry_after_header == "1"
    assert error.headers == {
        "X-RateLimit-Limit": "10",
        "X-RateLimit-Remaining": "0",
        "X-RateLimit-Reset": "3",
    }
    assert error.message == (
        "tenant 'acme' is over its rate limit of 4 rows/s (burst 10): this request needs 3, "
        "0.50 available; retry in 0.625 s"
    )


def test_exhausted_quota_wins_over_an_empty_bucket() -> None:
    reports = [
        report(Level(BUCKET, 0.0), 1, charged=False, now_unix_s=NOW),
        report(Level(DAY, 100, DAY_END), 1, charged=False, now_unix_s=NOW),
    ]
    reason, error = rejection("acme", reports, 1, "requests")
    assert reason == "quota_day"
    assert isinstance(error, QuotaExceeded)
    assert error.retry_after_s == 43200.0
    assert error.message == (
        "tenant 'acme' used its daily quota of 100 requests (100 used); "
        "it resets at 2025-03-16T00:00:00Z"
    )
    assert error.headers["X-RateLimit-Reset"] == "43200"
    assert error.headers["X-RateLimit-Remaining"] == "0"


def test_quota_message_when_the_request_is_bigger_than_what_is_left() -> None:
    month = Check("month", "resnet", limit=100)
    item = report(Level(month, 95, DAY_END), 10, charged=False, now_unix_s=NOW)
    assert item.remaining == 5
    _, error = rejection("acme", [item], 10, "rows")
    assert error.message == (
        "tenant 'acme' on model 'resnet' has 5 of its monthly quota of 100 rows left and this "
        f"request needs 10; it resets at {iso_utc(DAY_END)}"
    )


def test_tightest_is_the_report_with_least_left() -> None:
    reports = [
        report(Level(BUCKET, 9.0), 1, charged=True, now_unix_s=NOW),
        report(Level(DAY, 97, DAY_END), 1, charged=True, now_unix_s=NOW),
    ]
    best = tightest(reports)
    assert best is not None
    assert headers(best) == {
        "X-RateLimit-Limit": "100",
        "X-RateLimit-Remaining": "2",
        "X-RateLimit-Reset": "43200",
    }
    assert tightest([]) is None


def test_concurrency_and_too_large_messages() -> None:
    error = concurrency_limited("acme", Cap("resnet", 4))
    assert error.message == (
        "tenant 'acme' already has 4 requests in flight on model 'resnet', its max_concurrent "
        "limit; retry when one finishes"
    )
    assert error.retry_after_header == "1"
    big = too_large("acme", BUCKET, 12, "rows")
    assert isinstance(big, InvalidInput)
    assert big.message == (
        "request of 12 rows exceeds tenant 'acme''s burst of 10 rows, so it can never pass; "
        "send at most 10 rows per request"
    )


@pytest.mark.parametrize(("value", "text"), [(100.0, "100"), (2.5, "2.5"), (7, "7")])
def test_number(value: float, text: str) -> None:
    assert number(value) == text
