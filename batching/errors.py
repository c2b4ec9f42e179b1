"""The errors the batcher and its queue raise. batching/ imports nothing from engine/: the engine
translates these where it calls the batcher (engine.errors.from_batching), keeping each message.

    BatchingError                  .message: what the caller is told
    ├── QueueFull                  the queue, or the tenant's share of it, has no room (retry)
    ├── BatcherClosed              the batcher is closing or closed: the server shuts down
    ├── DeadlinePassed             the request's deadline passed before it ran; it was not run
    └── BatchFailed                run_batch raised, or returned outputs that do not split;
                                   .cause is what it raised
"""

from __future__ import annotations


class BatchingError(Exception):
    """Base of every error the batcher answers a request with."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class QueueFull(BatchingError):
    """No room for the request's rows in the queue or in its tenant's share; `retry_after_s`
    says when to try again."""

    retry_after_s = 1.0


class BatcherClosed(BatchingError):
    """The batcher takes no more requests, or was closed while this one waited or ran."""

    def __init__(self, message: str = "server is shutting down") -> None:
        super().__init__(message)


class DeadlinePassed(BatchingError):
    """The request's deadline passed (or its batch could not meet it) before it ran."""


class BatchFailed(BatchingError):
    """The batch the request was in failed; `cause` is what run_batch raised (or the split
    error when its outputs did not match the batch)."""

    def __init__(self, message: str, cause: Exception) -> None:
        super().__init__(message)
        self.cause = cause
