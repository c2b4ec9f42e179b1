"""How users name failures, and how the report reads them back.

Users record a failed request as `status=<code>` (an HTTP status such as 429, or a gRPC status
name such as RESOURCE_EXHAUSTED), followed by the server's error text for unexpected statuses.
locust groups failures by that text, so the report can break errors down by status. Rejections
that a loaded server is meant to answer (429 / RESOURCE_EXHAUSTED for rate limits and quotas,
503 / UNAVAILABLE for a full queue) are expected; everything else is unexpected.
"""

from __future__ import annotations

import re

EXPECTED_STATUSES = frozenset({"429", "503", "RESOURCE_EXHAUSTED", "UNAVAILABLE"})
"""Backpressure answers: counted in the breakdown, never treated as a broken run."""

BAD_RESPONSE = "bad_response"
"""A 200 whose body is not the answer the request asked for."""

CONNECTION = "connection_error"
"""No HTTP status at all: refused, reset or timed out."""

EXCEPTION = "exception"
"""The user code raised (the traceback is in locust's exceptions CSV)."""

_DETAIL_CHARS = 160
_STATUS = re.compile(r"status=([A-Za-z0-9_]+)")


def failure_message(status: int | str, detail: str = "") -> str:
    """The failure text a user records: the status, plus the server's words when unexpected."""
    code = str(status)
    if code in EXPECTED_STATUSES or not detail:
        return f"status={code}"
    return f"status={code}: {' '.join(detail.split())[:_DETAIL_CHARS]}"


def status_of(error_text: str) -> str:
    """The status a locust failure row is about (`status=...` anywhere in its text).

    Errors that a user did not format (a raw exception repr from a dropped connection) count as
    `connection_error`.
    """
    match = _STATUS.search(error_text)
    if match is not None:
        return match.group(1)
    return CONNECTION


def is_expected(status: str) -> bool:
    """Whether a status is a backpressure answer rather than a fault."""
    return status in EXPECTED_STATUSES


def error_detail(body: bytes) -> str:
    """The `error` text of a v2 error body, or the start of the body when it is not one."""
    text = body[:2048].decode("utf-8", "replace")
    match = re.search(r'"error"\s*:\s*"((?:[^"\\]|\\.)*)"', text)
    return match.group(1) if match is not None else text
