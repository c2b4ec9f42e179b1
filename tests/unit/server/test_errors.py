"""server.errors: the one table from engine errors to HTTP status and gRPC code, and the headers
that go with an error."""

from __future__ import annotations

import re
from collections.abc import Iterator

import grpc
import pytest

from engine import errors
from server.errors import error_headers, grpc_code, http_status


def _subclasses(cls: type[errors.EngineError]) -> Iterator[type[errors.EngineError]]:
    for sub in cls.__subclasses__():
        if sub.__module__ == errors.__name__:  # not the ones tests define
            yield sub
            yield from _subclasses(sub)


def _drawn() -> dict[str, tuple[int, str]]:
    """The tree drawn in engine/errors.py's docstring: each class's status and code."""
    line = re.compile(r"[│├└─\s]*(\w+)\s+(\d{3}) / ([A-Z_]+)")
    return {
        match[1]: (int(match[2]), match[3])
        for match in map(line.match, (errors.__doc__ or "").splitlines())
        if match
    }


def _bare(cls: type[errors.EngineError]) -> errors.EngineError:
    """An instance without running the constructor: the table looks at the class only."""
    return cls.__new__(cls)


ERROR_CLASSES = sorted(_subclasses(errors.EngineError), key=lambda cls: cls.__name__)


def test_the_walk_finds_the_tree() -> None:
    assert {cls.__name__ for cls in ERROR_CLASSES} == set(_drawn())


@pytest.mark.parametrize("cls", ERROR_CLASSES, ids=lambda cls: cls.__name__)
def test_every_error_maps_as_the_tree_draws_it(cls: type[errors.EngineError]) -> None:
    status, code = _drawn()[cls.__name__]
    exc = _bare(cls)
    assert (http_status(exc), grpc_code(exc)) == (status, grpc.StatusCode[code])


def test_a_subclass_is_answered_by_its_own_row_not_its_base() -> None:
    quota = errors.QuotaExceeded("daily quota used", retry_after_s=60)
    assert (http_status(quota), grpc_code(quota)) == (429, grpc.StatusCode.RESOURCE_EXHAUSTED)
    draining = errors.ShuttingDown()
    assert (http_status(draining), grpc_code(draining)) == (503, grpc.StatusCode.UNAVAILABLE)


def test_an_error_outside_the_table_is_an_internal_error() -> None:
    class Unlisted(errors.EngineError):
        pass

    exc = Unlisted("not in the table")
    assert (http_status(exc), grpc_code(exc)) == (500, grpc.StatusCode.INTERNAL)


def test_no_headers_for_an_error_without_a_wait() -> None:
    assert error_headers(errors.InvalidInput("input 'x' has shape [3]")) == {}


def test_retry_after_is_whole_seconds_rounded_up() -> None:
    assert error_headers(errors.Overloaded("queue is full", retry_after_s=0.2)) == {
        "Retry-After": "1"
    }
    assert error_headers(errors.Overloaded("queue is full", retry_after_s=2.5)) == {
        "Retry-After": "3"
    }


def test_a_rate_limit_sends_its_own_headers_beside_retry_after() -> None:
    facts = {"X-RateLimit-Limit": "10", "X-RateLimit-Remaining": "0"}
    exc = errors.RateLimited("over 10 requests/s", retry_after_s=0.4, headers=facts)
    assert error_headers(exc) == {**facts, "Retry-After": "1"}
    assert exc.headers == facts  # the error's own headers are copied, never added to
