"""ModelInfer over the data plane: one request as the data plane sees it (`GrpcCall`, which
decodes it with server/grpc/tensors.py and bounds the engine's deadline by the call's), and how a
ModelStreamInfer stream answers a failed request or refuses to start."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from typing import NoReturn

from engine.errors import DeadlineExceeded, EngineError
from engine.types import InferRequest, InferResponse
from engine.validate import InputCheck
from server import raw_tensors
from server.dataplane import Metadata
from server.grpc import tensors
from server.grpc.calls import Context, abort
from server.grpc.proto import grpc_service_pb2 as pb

INFER_SPAN = "inference.GRPCInferenceService/ModelInfer"
STREAM_SETTLE_S = 1.0
"""How long a rejected stream is read (and dropped) while waiting for the client to finish
writing, before its status is sent anyway."""


class GrpcCall:
    """One ModelInfer request as the data plane sees it (server.dataplane.InferCall)."""

    __slots__ = ("_context", "_request", "headers", "model", "version")
    protocol = "grpc"
    span_name = INFER_SPAN

    def __init__(self, request: pb.ModelInferRequest, context: Context, caller: Metadata) -> None:
        self._request, self._context = request, context
        self.headers = caller
        self.model, self.version = request.model_name, request.model_version or None

    @property
    def access(self) -> str:
        return f"gRPC ModelInfer {self.model}"

    async def decode(self, check: InputCheck) -> InferRequest:
        request = self._request
        raw = request.raw_input_contents  # the bulk of a large request; ByteSize would encode it
        size = sum(map(len, raw)) if raw else request.ByteSize()
        if size > raw_tensors.OFFLOAD_BYTES:
            decoded = await asyncio.to_thread(tensors.decode_request, request, check)
        else:
            decoded = tensors.decode_request(request, check)
        remaining = self._context.time_remaining()
        if remaining is not None:
            # The call's own deadline bounds the engine's: no answer is useful after it.
            if remaining <= 0:
                raise DeadlineExceeded("the call's deadline passed before it was queued")
            budget = decoded.timeout_s
            decoded.timeout_s = remaining if budget is None else min(budget, remaining)
        return decoded

    def encode(self, response: InferResponse) -> pb.ModelInferResponse:
        return tensors.encode_response(response)

    async def wait(self, answer: Awaitable[InferResponse]) -> InferResponse:
        return await answer  # a cancelled call cancels the engine's request (the batcher drops it)


async def reject_stream(
    request_iterator: AsyncIterator[pb.ModelInferRequest],
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


def stream_error(request: pb.ModelInferRequest, message: str) -> pb.ModelStreamInferResponse:
    return pb.ModelStreamInferResponse(
        error_message=message,
        infer_response=pb.ModelInferResponse(
            model_name=request.model_name, model_version=request.model_version, id=request.id
        ),
    )
