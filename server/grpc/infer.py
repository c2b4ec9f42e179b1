"""ModelInfer over the data plane: one request as the data plane sees it (`GrpcCall`, which
decodes it with server/grpc/tensors.py and bounds the engine's deadline by the call's), whether it
came alone or on a ModelStreamInfer stream (server/grpc/stream.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

from engine.errors import DeadlineExceeded
from engine.types import InferRequest, InferResponse
from engine.validate import InputCheck
from server import raw_tensors
from server.grpc import tensors
from server.grpc.calls import Context
from server.grpc.proto import grpc_service_pb2 as pb
from server.ledger import Metadata

INFER_SPAN = "inference.GRPCInferenceService/ModelInfer"


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
