"""server.grpc.infer: one ModelInfer request as the data plane sees it (GrpcCall), the call's
deadline bounding the engine's."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pytest

from engine.errors import DeadlineExceeded
from engine.types import InferResponse
from server import raw_tensors
from server.grpc.infer import INFER_SPAN, GrpcCall
from server.grpc.proto import grpc_service_pb2 as pb


class Deadline:
    """The part of grpc.aio's context that GrpcCall reads: the time left."""

    def __init__(self, remaining_s: float | None) -> None:
        self.remaining_s = remaining_s

    def time_remaining(self) -> float | None:
        return self.remaining_s


def _request(
    values: np.ndarray, version: str = "", timeout_us: int | None = None
) -> pb.ModelInferRequest:
    message = pb.ModelInferRequest(model_name="double", model_version=version)
    message.inputs.add(name="x", datatype="FP32", shape=list(values.shape))
    message.raw_input_contents.append(values.astype(np.float32).tobytes())
    if timeout_us is not None:
        message.parameters["timeout"].uint64_param = timeout_us
    return message


def _accept(shapes: Mapping[str, Sequence[int]], datatypes: Mapping[str, str]) -> None:
    """An input check that lets everything through."""


def _call(message: pb.ModelInferRequest, remaining_s: float | None = None) -> GrpcCall:
    return GrpcCall(message, Deadline(remaining_s), [("x-api-key", "k")])  # type: ignore[arg-type]


def test_the_call_names_its_model_version_and_span() -> None:
    call = _call(_request(np.zeros((1, 4)), version="2"))
    assert (call.model, call.version) == ("double", "2")
    assert call.protocol == "grpc"
    assert call.span_name == INFER_SPAN == "inference.GRPCInferenceService/ModelInfer"
    assert call.access == "gRPC ModelInfer double"
    assert call.headers == [("x-api-key", "k")]
    assert _call(_request(np.zeros((1, 4)))).version is None  # "" asks for the latest


async def test_decode_reads_the_raw_contents() -> None:
    values = np.arange(8, dtype=np.float32).reshape(2, 4)
    decoded = await _call(_request(values)).decode(_accept)
    assert decoded.model_name == "double"
    np.testing.assert_array_equal(decoded.inputs["x"], values)
    assert decoded.datatypes == {"x": "FP32"}
    assert decoded.timeout_s is None


async def test_a_large_request_decodes_alike_off_the_loop() -> None:
    rows = raw_tensors.OFFLOAD_BYTES // 16 + 1  # 4 floats a row: just past the threshold
    values = np.random.default_rng(3).standard_normal((rows, 4)).astype(np.float32)
    decoded = await _call(_request(values)).decode(_accept)
    np.testing.assert_array_equal(decoded.inputs["x"], values)


@pytest.mark.parametrize(
    ("timeout_us", "remaining_s", "expected_s"),
    [
        (None, None, None),  # no deadline and no timeout: none
        (None, 0.25, 0.25),  # the call's deadline becomes the engine's
        (100_000, 0.25, 0.1),  # the request's own timeout is shorter: it stays
        (2_000_000, 0.25, 0.25),  # the call's deadline is shorter: it bounds the timeout
        (100_000, None, 0.1),
    ],
)
async def test_the_calls_deadline_bounds_the_engines(
    timeout_us: int | None, remaining_s: float | None, expected_s: float | None
) -> None:
    call = _call(_request(np.zeros((1, 4)), timeout_us=timeout_us), remaining_s)
    decoded = await call.decode(_accept)
    assert decoded.timeout_s == pytest.approx(expected_s)


@pytest.mark.parametrize("remaining_s", [0.0, -0.5])
async def test_a_deadline_already_passed_is_deadline_exceeded(remaining_s: float) -> None:
    with pytest.raises(DeadlineExceeded, match="the call's deadline passed before it was queued"):
        await _call(_request(np.zeros((1, 4))), remaining_s).decode(_accept)


def test_encode_gives_the_protobuf_answer() -> None:
    response = InferResponse(
        "double", "1", {"y": np.array([[2.0, 4.0]], np.float32)}, {"y": "FP32"}, id="r1"
    )
    answer = _call(_request(np.zeros((1, 4)))).encode(response)
    assert isinstance(answer, pb.ModelInferResponse)
    assert (answer.model_name, answer.model_version, answer.id) == ("double", "1", "r1")
    assert [(o.name, o.datatype, list(o.shape)) for o in answer.outputs] == [("y", "FP32", [1, 2])]
    assert np.frombuffer(answer.raw_output_contents[0], np.float32).tolist() == [2.0, 4.0]


async def test_wait_gives_the_engines_answer() -> None:
    response = InferResponse("double", "1", {}, {})

    async def answer() -> Any:
        await asyncio.sleep(0)
        return response

    assert await _call(_request(np.zeros((1, 4)))).wait(answer()) is response
