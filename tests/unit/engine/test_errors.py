"""engine.errors.from_batching: the batcher's errors as engine errors, messages kept."""

from __future__ import annotations

import logging

import pytest

from batching import errors as batching
from engine.errors import (
    BackendError,
    DeadlineExceeded,
    EngineError,
    InvalidInput,
    Overloaded,
    ShuttingDown,
    from_batching,
)


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (batching.QueueFull("queue is full: 4 of 4 rows queued, request has 1"), Overloaded),
        (batching.BatcherClosed("server shut down before this request ran"), ShuttingDown),
        (
            batching.DeadlinePassed("request reached m past its timeout; it was not run"),
            DeadlineExceeded,
        ),
    ],
)
def test_each_kind_keeps_its_message(
    error: batching.BatchingError, kind: type[EngineError]
) -> None:
    translated = from_batching(error)
    assert type(translated) is kind
    assert translated.message == error.message


def test_a_full_queue_says_when_to_retry() -> None:
    translated = from_batching(batching.QueueFull("full"))
    assert translated.retry_after_header == "1"


def test_an_engine_error_raised_by_run_batch_is_answered_as_it_is() -> None:
    cause = InvalidInput("pipeline 'p' step 1 ('t'): bad UTF-8")
    assert from_batching(batching.BatchFailed("m failed: InvalidInput: ...", cause)) is cause


def test_a_backend_bug_is_logged_and_answered_backend_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cause = ZeroDivisionError("division by zero")
    with caplog.at_level(logging.ERROR, "sluice.engine"):
        translated = from_batching(batching.BatchFailed("m failed: ZeroDivisionError: ...", cause))
    assert type(translated) is BackendError
    assert translated.message == "m failed: ZeroDivisionError: ..."
    assert [record.exc_info[1] for record in caplog.records if record.exc_info] == [cause]
