"""The one table from engine errors to HTTP status codes and gRPC status codes."""

from __future__ import annotations

import grpc

from engine import errors

INTERNAL_ERROR = "internal error"
"""What a caller is told about a bug (the traceback is in the server log)."""

# Most specific first: subclasses before their bases.
_TABLE: tuple[tuple[type[errors.EngineError], int, grpc.StatusCode], ...] = (
    (errors.InvalidInput, 400, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.Unauthenticated, 401, grpc.StatusCode.UNAUTHENTICATED),
    (errors.Forbidden, 403, grpc.StatusCode.PERMISSION_DENIED),
    (errors.ModelNotFound, 404, grpc.StatusCode.NOT_FOUND),
    (errors.RegionNotFound, 404, grpc.StatusCode.NOT_FOUND),
    (errors.PayloadTooLarge, 413, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.QuotaExceeded, 429, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.RateLimited, 429, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.BackendError, 500, grpc.StatusCode.INTERNAL),
    (errors.ShuttingDown, 503, grpc.StatusCode.UNAVAILABLE),
    (errors.Overloaded, 503, grpc.StatusCode.UNAVAILABLE),
    (errors.ModelNotReady, 503, grpc.StatusCode.UNAVAILABLE),
    (errors.DeadlineExceeded, 504, grpc.StatusCode.DEADLINE_EXCEEDED),
)


def _entry(exc: errors.EngineError) -> tuple[int, grpc.StatusCode]:
    for cls, status, code in _TABLE:
        if isinstance(exc, cls):
            return status, code
    return 500, grpc.StatusCode.INTERNAL


def http_status(exc: errors.EngineError) -> int:
    """The HTTP status for an engine error."""
    return _entry(exc)[0]


def grpc_code(exc: errors.EngineError) -> grpc.StatusCode:
    """The gRPC status code for an engine error."""
    return _entry(exc)[1]


def error_headers(exc: errors.EngineError) -> dict[str, str]:
    """Headers (HTTP) or trailing metadata (gRPC) that go with an error: Retry-After and the
    error's own (rate-limit facts)."""
    headers = dict(exc.headers)
    retry_after = exc.retry_after_header
    if retry_after is not None:
        headers["Retry-After"] = retry_after
    return headers
