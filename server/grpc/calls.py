"""What every gRPC call of the servicer (server/grpc/service.py) goes through around its own
work: the `Context` it is given, its invocation metadata and request id, and how an engine error
ends it (the status code of the one table in server/errors.py, the engine's message, and
trailing metadata such as `retry-after` and `x-request-id`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NoReturn, Protocol

import grpc

from engine.errors import EngineError
from server.errors import error_headers, grpc_code
from server.ledger import Metadata
from server.logs import choose_request_id, request_id

Trailing = Sequence[tuple[str, str]]


class Context(Protocol):
    """What the servicer uses of grpc.aio's ServicerContext (grpcio ships no type hints)."""

    def invocation_metadata(self) -> Metadata | None:
        """The caller's metadata as (key, value) pairs."""
        ...

    def set_trailing_metadata(self, trailing_metadata: Trailing) -> None:
        """Metadata sent with the status."""
        ...

    def set_code(self, code: grpc.StatusCode) -> None:
        """The status the call ends with once its handler returns."""
        ...

    def set_details(self, details: str) -> None:
        """The status message the call ends with."""
        ...

    async def abort(
        self, code: grpc.StatusCode, details: str = "", trailing_metadata: Trailing = ()
    ) -> NoReturn:
        """End the call with `code` (raises grpc.aio.AbortError)."""
        ...

    def time_remaining(self) -> float | None:
        """Seconds left before the call's deadline; None without one."""
        ...


async def abort(context: Context, exc: EngineError) -> NoReturn:
    """End the call with the error's status code, message and trailing metadata."""
    await context.abort(grpc_code(exc), exc.message, trailing_metadata=_trailing(exc))


def fail(context: Context, exc: EngineError) -> None:
    """Set the error's status code, message and trailing metadata for the call to end with when
    its handler returns. Unlike `abort`, nothing is raised: grpc keeps the AbortError that abort
    raises in the call's state, which the error's traceback holds (a cycle), and one raised while
    an engine error is handled holds that error as its context, whose traceback holds every frame
    of the request, its inputs too, until the cyclic collector runs (seldom: see tune_gc)."""
    context.set_code(grpc_code(exc))
    context.set_details(exc.message)
    context.set_trailing_metadata(_trailing(exc))


def _trailing(exc: EngineError) -> Trailing:
    metadata = tuple((key.lower(), value) for key, value in error_headers(exc).items())
    rid = request_id.get()
    if rid is not None:  # this metadata replaces what was set before: repeat the id
        metadata = (*metadata, ("x-request-id", rid))
    return metadata


def metadata(context: Context) -> Metadata:
    """The call's invocation metadata ((key, value) pairs, possibly none)."""
    return context.invocation_metadata() or ()


def bind_request_id(context: Context, caller: Metadata) -> str:
    """The call's request id (the caller's `x-request-id` if sane), also sent back as trailing
    metadata."""
    given = None
    for key, value in caller:  # a loop: a generator would cost more than the search
        if key == "x-request-id":
            given = value
            break
    rid = choose_request_id(given if isinstance(given, str) else None)
    context.set_trailing_metadata((("x-request-id", rid),))
    return rid
