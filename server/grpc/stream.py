"""ModelStreamInfer: one bidirectional stream of inference and generation requests over the data
plane (`InferStream`), and how it answers a failed request or refuses to start.

What a stream guarantees:

- Authentication: once, from the stream's metadata, before any message is read. A stream that
  fails it reads and drops what the client writes (up to the bound, or STREAM_SETTLE_S), then
  ends with the error's status. Each inference message is authorized for its model as that
  principal; a generation request checks the stream's metadata as the generation front-ends do
  (server/grpc/generate.py).
- Bound: at most `max_pending` requests running plus answers not yet sent. A slot is taken
  before each message is read, so none is read without one; an answer frees its slot once grpc
  has sent it. A generation request's first answer uses its request's slot and each
  later answer takes one more, so a generation that outruns its client waits for it. At the
  bound the stream is not read, so HTTP/2 flow control holds the client's writes until it reads.
- Order: each answer is sent as soon as its request completes, not in the order the requests
  came (match them by `id`); a generation request's answers come in order.
- Errors: a message that fails with an engine error, or with a bug (logged with its traceback and
  answered as an internal error, by the data plane for inference and here for generation), answers
  `error_message`, and the stream carries on with the others. A failure outside a message's answer
  (reading the stream fails) ends the stream, cancelling the requests still running. A message
  that does not parse (`malformed`, server/grpc/handlers.py) stops the reading: the requests read
  before it are answered, then the servicer ends the stream with INVALID_ARGUMENT.
- End: once the client stops writing, the stream ends (OK) after every request read has been
  answered. When the client leaves (or its deadline passes), its requests still running are
  cancelled, generation included: the engine drops what it had queued for them.
- Drain: a message read after the server began draining answers the shutdown error, and a
  stream still open when grpc's server stops (server/server.py) ends as if its client had left.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from typing import NoReturn

from engine.auth import Principal
from engine.errors import EngineError
from server.dataplane import DataPlane
from server.errors import INTERNAL_ERROR
from server.grpc.calls import Context, abort, bind_request_id, metadata
from server.grpc.generate import stream_error, stream_generation
from server.grpc.handlers import Malformed
from server.grpc.infer import GrpcCall
from server.grpc.proto import grpc_service_pb2 as pb
from server.ledger import Metadata
from server.logs import request_id

log = logging.getLogger("sluice.grpc")

STREAM_SETTLE_S = 1.0
"""How long a rejected stream is read (and dropped) while waiting for the client to finish
writing, before its status is sent anyway."""


class InferStream:
    """One ModelStreamInfer call: `answers` reads its requests, runs them over the data plane
    and yields their answers, within the bound of the module docstring."""

    def __init__(self, plane: DataPlane, context: Context, max_pending: int) -> None:
        self._plane, self._context, self._max_pending = plane, context, max_pending
        self._results: asyncio.Queue[pb.ModelStreamInferResponse | None] = asyncio.Queue()
        self._slots = asyncio.Semaphore(max_pending)
        self.malformed: Malformed | None = None
        """The message that did not parse, once one has ended the reading."""

    async def answers(
        self, requests: AsyncIterator[pb.ModelInferRequest | Malformed]
    ) -> AsyncGenerator[pb.ModelStreamInferResponse, None]:
        """The stream's answers, each as its request completes. The stream has one request id,
        shared by the log lines and spans of all its requests."""
        context = self._context
        caller = metadata(context)
        request_id.set(bind_request_id(context, caller))  # this call's own context: no reset
        try:
            principal = self._plane.authenticate(caller)
        except EngineError as exc:
            await reject_stream(requests, context, exc, self._max_pending)
        feeder = asyncio.create_task(self._feed(requests, caller, principal))
        try:
            while (answer := await self._results.get()) is not None:
                yield answer  # returns once grpc has sent it: flow control holds us here
                self._slots.release()
            await feeder
        finally:
            if not feeder.done():  # the client went away: stop reading and running its requests
                feeder.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await feeder

    async def _feed(
        self,
        requests: AsyncIterator[pb.ModelInferRequest | Malformed],
        caller: Metadata,
        principal: Principal,
    ) -> None:
        """Read the requests, each once a slot is free, and run each in its own task."""
        slots = self._slots
        try:
            async with asyncio.TaskGroup() as group:
                # A slot per request read, freed once its answer is sent: no slot, no read.
                await slots.acquire()
                async for request in requests:
                    if isinstance(request, Malformed):  # the client is broken: read no more
                        self.malformed = request
                        break
                    group.create_task(self._one(request, caller, principal))
                    await slots.acquire()
        finally:
            self._results.put_nowait(None)  # the reader always ends, also when reading failed

    async def _one(
        self, request: pb.ModelInferRequest, caller: Metadata, principal: Principal
    ) -> None:
        """Run one request and queue its answers: one for inference (`error_message` if it
        failed), one or more for generation (decoupled)."""
        plane, results = self._plane, self._results
        # A loaded generative model, in this process or the engine process (anything else,
        # unknown models included, takes the ordinary inference path and its errors).
        if request.model_name in plane.generative_models():
            first = True
            try:
                async for answer in stream_generation(plane, request, metadata(self._context)):
                    if not first:  # the first answer has this request's slot; later ones take one
                        await self._slots.acquire()
                    first = False
                    results.put_nowait(answer)
                if first:  # ended without its final answer (a bug): it still gets one
                    log.error(
                        "a generation ended without an answer", extra={"model": request.model_name}
                    )
                    results.put_nowait(stream_error(request, INTERNAL_ERROR))
            except Exception:  # a bug: had ended the stream, failing its other requests
                log.exception("unhandled error in generation", extra={"model": request.model_name})
                if not first:
                    await self._slots.acquire()
                results.put_nowait(stream_error(request, INTERNAL_ERROR))
            return
        try:
            response = await plane.infer(GrpcCall(request, self._context, caller), principal)
            answer = pb.ModelStreamInferResponse(infer_response=response)
        except EngineError as exc:  # a bug too, logged by the data plane
            answer = stream_error(request, exc.message)
        results.put_nowait(answer)


async def reject_stream(
    request_iterator: AsyncIterator[pb.ModelInferRequest | Malformed],
    context: Context,
    exc: EngineError,
    most: int,
) -> NoReturn:
    """End a stream with `exc` before serving it, once the client has finished writing (up to
    `most` messages, dropped, or STREAM_SETTLE_S). A grpc.aio client whose write is in flight when
    the status arrives reports INTERNAL "Internal error from Core" instead of the status
    (grpc/grpc#36066); a client still writing after the bound may still see that."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(STREAM_SETTLE_S):
            read = 0
            async for _ in request_iterator:
                read += 1
                if read >= most:
                    break
    await abort(context, exc)
