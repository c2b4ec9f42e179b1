"""The engine's error tree. Transport-neutral: `server/errors.py` maps each class once to an HTTP
status and a gRPC code.

    EngineError                      base; never raised itself
    ├── InvalidInput                 400 / INVALID_ARGUMENT
    │   └── ContextLengthExceeded    400 / INVALID_ARGUMENT (prompt past the model's context)
    ├── ModelNotFound                404 / NOT_FOUND
    ├── RegionNotFound               404 / NOT_FOUND
    ├── Unauthenticated              401 / UNAUTHENTICATED
    │   └── InvalidApiKey            401 / UNAUTHENTICATED (a key sent, not valid)
    ├── Forbidden                    403 / PERMISSION_DENIED
    │   └── ModelForbidden           403 / PERMISSION_DENIED (a model the key may not use)
    ├── RateLimited                  429 / RESOURCE_EXHAUSTED (+ Retry-After)
    │   └── QuotaExceeded            429 / RESOURCE_EXHAUSTED (distinct message)
    ├── Overloaded                   503 / UNAVAILABLE (+ Retry-After)
    │   └── ShuttingDown             503 / UNAVAILABLE
    ├── DeadlineExceeded             504 / DEADLINE_EXCEEDED
    ├── ModelNotReady                503 / UNAVAILABLE
    ├── PayloadTooLarge              413 / RESOURCE_EXHAUSTED
    └── BackendError                 500 / INTERNAL (message is generic; cause is logged)

An error carries what the core knows: its class (why), its message, the request field at fault
(`param`) where there is one, and for a 429 what the limit counts (`tokens`). What a protocol
makes of them (statuses, OpenAI's error `type` and `code`) is the front-ends' to say.

The batcher raises its own errors (batching/errors.py); `from_batching` translates them where
the engine calls it, keeping their messages.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence

from batching import errors as batching

log = logging.getLogger("sluice.engine")


class EngineError(Exception):
    """Base of every error the engine reports to a client."""

    retry_after_s: float | None = None
    headers: Mapping[str, str] = {}
    param: str | None = None
    """The request field the error is about, when it is about one ("temperature",
    "messages[0].role")."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    @property
    def retry_after_header(self) -> str | None:
        """Whole seconds for a Retry-After header, rounded up (never 0)."""
        if self.retry_after_s is None:
            return None
        return str(max(1, math.ceil(self.retry_after_s)))


class InvalidInput(EngineError):
    """The request is malformed or does not fit the model.

    `param` names the one request field at fault, where there is one."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ContextLengthExceeded(InvalidInput):
    """A prompt, or a prompt and the completion asked for, that does not fit the model's context
    (engine/generation/context.py)."""


class ModelNotFound(EngineError):
    """No such model, or no such version of it."""

    def __init__(
        self, name: str, version: str | None = None, available: Sequence[str] = ()
    ) -> None:
        what = f"model '{name}'" if version is None else f"version '{version}' of model '{name}'"
        hint = f"; available: {', '.join(available)}" if available else ""
        super().__init__(f"unknown {what}{hint}")
        self.name = name
        self.version = version


class RegionNotFound(EngineError):
    """No shared-memory region of this name is registered by the caller's tenant (another
    tenant's region of that name is answered the same: its existence is not told)."""

    def __init__(self, name: str) -> None:
        super().__init__(f"no shared memory region '{name:.200}' is registered by this tenant")
        self.name = name


class ModelNotReady(EngineError):
    """The model exists but is not loaded (loading, unloading or failed)."""

    def __init__(self, name: str, version: str, state: str) -> None:
        super().__init__(f"model '{name}' version '{version}' is not ready ({state})")


class Unauthenticated(EngineError):
    """No credentials, or unknown credentials."""


class InvalidApiKey(Unauthenticated):
    """An API key was sent and is not valid here (unknown, or expired)."""


class Forbidden(EngineError):
    """Valid credentials that are not allowed to do this."""


class ModelForbidden(Forbidden):
    """The caller's key may not use this model (its `models` allow-list leaves it out)."""

    def __init__(self, tenant: str, allowed: Sequence[str], model: str) -> None:
        super().__init__(f"tenant '{tenant}' may use models [{', '.join(allowed)}]; got '{model}'")
        self.model = model


class RateLimited(EngineError):
    """The tenant sent more than its rate allows; retry after `retry_after_s`."""

    tokens: bool = False
    """Whether the limit counts text tokens (else requests or rows)."""

    def __init__(
        self,
        message: str,
        retry_after_s: float,
        headers: Mapping[str, str] | None = None,
        *,
        tokens: bool = False,
    ) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.headers = dict(headers or {})
        self.tokens = tokens


class QuotaExceeded(RateLimited):
    """The tenant used its daily or monthly quota."""


class Overloaded(EngineError):
    """The server cannot take this request now (queue full); retry after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ShuttingDown(Overloaded):
    """The server is draining and accepts no new work."""

    def __init__(self, message: str = "server is shutting down") -> None:
        super().__init__(message, retry_after_s=1.0)


class DeadlineExceeded(EngineError):
    """The request's deadline passed before it could be answered."""


class PayloadTooLarge(EngineError):
    """The request body is over the configured limit."""

    def __init__(
        self,
        size_bytes: int | None,
        limit_bytes: int,
        coding: str | None = None,
        message: str | None = None,
    ) -> None:
        if message is not None:  # another limit than the body's (a worker's arena)
            super().__init__(message)
        elif coding is not None:  # inflation stops at the limit: the whole size is never known
            super().__init__(
                f"request body exceeds the limit of {limit_bytes} bytes once inflated ({coding})"
            )
        else:
            super().__init__(
                f"request body of {size_bytes} bytes exceeds the limit of {limit_bytes} bytes"
            )


class BackendError(EngineError):
    """The backend failed to run a batch. The client sees `message`; the cause goes to logs."""


def from_batching(exc: batching.BatchingError) -> EngineError:
    """The engine error for what the batcher answered: a full queue is Overloaded, a closed
    batcher ShuttingDown, a passed deadline DeadlineExceeded, a failed batch the EngineError its
    run function raised, else BackendError (its cause logged with the traceback)."""
    if isinstance(exc, batching.QueueFull):
        return Overloaded(exc.message, exc.retry_after_s)
    if isinstance(exc, batching.BatcherClosed):
        return ShuttingDown(exc.message)
    if isinstance(exc, batching.DeadlinePassed):
        return DeadlineExceeded(exc.message)
    cause = exc.cause if isinstance(exc, batching.BatchFailed) else exc
    if isinstance(cause, EngineError):  # the run function's own answer (a pipeline step's)
        return cause
    log.error("%s", exc.message, exc_info=cause)
    return BackendError(exc.message)
