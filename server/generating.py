"""One generation request in the data plane (`DataPlane.generation_call`): a completion with
several choices (`n`, a list of prompts) is one request of several streams. From the moment the
plane lets it in, it is timed and traced, and it is counted once (metrics, debug log line, span
end: server/ledger.py): when it is refused, or when the last of its streams ends. Its status is
the first error one of its streams ended with, else 499 when one was left before its end (the
client went away), else 200.

    call = plane.generation_call(GenerationRoute("http", span, access, headers))  # 401, 503
    try:
        with call.reading():     # what the route raises here is the request's refusal
            body = await read(request)
            call.choose(body["model"])       # 400 / 403 / 404 before a stream starts
        streams = await call.start([GenerateRequest("tiny", call.tenant, "Hello")])
    except EngineError as exc:   # refused: counted already
        ...
    # the route reads each stream to its end, or cancels it; the last one ends the request
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass

from engine.auth import Principal
from engine.errors import BackendError, EngineError, ModelNotFound, ShuttingDown
from engine.generation.sequence import Chunk
from engine.generation.service import GenerateRequest, TokenStream
from server.errors import INTERNAL_ERROR, http_status
from server.fields import refused
from server.ledger import CLIENT_GONE, Headers, Ledger

_LOG = logging.getLogger("sluice.generation")


@dataclass(frozen=True, slots=True)
class GenerationRoute:
    """Where a generation request came in: its protocol ("http" or "grpc"), root span name
    (the route's template), access text (the path, or `gRPC ModelStreamInfer <model>`) and the
    headers or metadata carrying its W3C trace context."""

    protocol: str
    span_name: str
    access: str
    headers: Headers


class GenerationCall:
    """A generation request of an authenticated caller, from its arrival in the plane (see the
    module docstring); `tenant` is the one its GenerateRequests carry."""

    def __init__(self, ledger: Ledger, route: GenerationRoute, started: float) -> None:
        self.model = ""  # until `choose`: the metrics label of a request refused before it
        self.protocol = route.protocol
        self.access = route.access
        self.caller: Principal | None = None
        self._ledger = ledger
        self._started = started
        self._span = ledger.begin(route.span_name, route.protocol, "", route.headers)
        self._open = 0  # streams started and not yet ended
        self._started_all = False  # until then a stream's end does not count the request
        self._status = 200
        self._counted = False

    @property
    def tenant(self) -> str:
        assert self.caller is not None, "the plane authenticates the call before a route has it"
        return self.caller.tenant

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """Count the request as refused with what the route raises while it reads it."""
        try:
            yield
        except BaseException as exc:
            self.refused(exc)
            raise

    def choose(self, model: object) -> None:
        """The model the request names (ABSENT when it left it out), once the caller may use
        it; ShuttingDown while draining (the one place generation is refused for it)."""
        if not isinstance(model, str) or not model:
            raise refused("model", "a model name (string)", model)
        self.model = model
        if self._span is not None:
            self._span.span.set_attribute("sluice.model", model)
        assert self.caller is not None
        self.caller.check_model(model)
        if self._ledger.engine.draining:
            raise ShuttingDown()

    async def start(self, requests: Sequence[GenerateRequest]) -> list[TokenStream]:
        """Admit and queue each request, in order (one stream each, in order), or raise the
        EngineError refusing the first refused (the ones queued before it are cancelled): a bug
        is logged here with its traceback and becomes BackendError(INTERNAL_ERROR)."""
        streams: list[TokenStream] = []
        began = time.monotonic()
        tracing = self._ledger.engine.tracing
        try:
            for request in requests:
                streams.append(CountedStream(await self._generate(request), self))
                self._open += 1
        except BaseException as exc:
            for stream in streams:
                stream.cancel()
            if tracing is not None:
                tracing.record("start", began, time.monotonic(), exc)
            self.refused(exc)
            raise
        if tracing is not None and self._span is not None:
            tracing.record("start", began, time.monotonic())
            tracing.detach(self._span)  # the streams are read by another task
        self._started_all = True
        if not streams:  # nothing to wait for
            self._count()
        return streams

    async def _generate(self, request: GenerateRequest) -> TokenStream:
        generation = self._ledger.engine.generation
        if generation is None:
            raise ModelNotFound(request.model)
        try:
            return await generation.generate(request)
        except EngineError:
            raise
        except Exception as exc:  # a bug: the traceback goes to the log, the caller a 500
            _LOG.error("unhandled error in generation", exc_info=exc, extra={"model": self.model})
            raise BackendError(INTERNAL_ERROR) from exc

    def refused(self, exc: BaseException) -> None:
        """Count the request as refused with `exc` (an EngineError's status; a cancelled caller
        499; anything else 500), unless it was counted already."""
        if isinstance(exc, EngineError):
            self._status = http_status(exc)
        else:
            self._status = 500 if isinstance(exc, Exception) else CLIENT_GONE
        self._count()

    def ended(self, status: int) -> None:
        """One of its streams ended with `status`; the last one counts the request."""
        if status != 200 and (self._status == 200 or self._status == CLIENT_GONE):
            self._status = status
        self._open -= 1
        if self._open == 0 and self._started_all:
            self._count()

    def _count(self) -> None:
        if not self._counted:
            self._counted = True
            elapsed = time.monotonic() - self._started
            self._ledger.count(self, "", self._status, elapsed, self._span)


class CountedStream:
    """A stream of a GenerationCall: it tells the call how it ended, once (its last chunk's
    error, its finish, or a consumer that left or cancelled it first)."""

    __slots__ = ("_call", "_ended", "_status", "_stream")

    def __init__(self, stream: TokenStream, call: GenerationCall) -> None:
        self._stream = stream
        self._call = call
        self._ended = False
        self._status: int | None = None  # known once its last chunk was read

    @property
    def headers(self) -> dict[str, str]:
        return self._stream.headers

    @property
    def prompt_tokens(self) -> int:
        return self._stream.prompt_tokens

    @property
    def completion_tokens(self) -> int:
        return self._stream.completion_tokens

    @property
    def finish_reason(self) -> str | None:
        return self._stream.finish_reason

    async def chunks(self) -> AsyncIterator[Chunk]:
        try:
            async for chunk in self._stream.chunks():
                if chunk.finish_reason is not None:
                    self._status = 200 if chunk.error is None else http_status(chunk.error)
                yield chunk
        except EngineError as exc:
            self._status = http_status(exc)
            raise
        except Exception:
            self._status = 500
            raise
        finally:
            self._end()

    def cancel(self) -> None:
        self._stream.cancel()
        self._end()

    def _end(self) -> None:
        """Tell the call, once: the status of its last chunk, or 499 when it was left first."""
        if not self._ended:
            self._ended = True
            self._call.ended(CLIENT_GONE if self._status is None else self._status)
