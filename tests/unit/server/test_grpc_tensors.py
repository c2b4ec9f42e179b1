"""gRPC tensors: ModelInferRequest decoding of bad shapes and sizes."""

from __future__ import annotations

import pytest

from engine.errors import InvalidInput
from server import grpc_tensors
from server.proto import grpc_service_pb2 as pb


def request(
    shape: list[int], datatype: str = "FP32", raw: bytes | None = None
) -> pb.ModelInferRequest:
    message = pb.ModelInferRequest(model_name="m")
    message.inputs.add(name="x", datatype=datatype, shape=shape)
    if raw is not None:
        message.raw_input_contents.append(raw)
    return message


@pytest.mark.parametrize("datatype", ["FP32", "FP64", "BYTES"])
@pytest.mark.parametrize("raw", [None, b""], ids=["typed", "raw"])
def test_zero_sized_shapes_too_large_for_numpy_are_invalid_input(
    datatype: str, raw: bytes | None
) -> None:
    with pytest.raises(InvalidInput) as caught:
        grpc_tensors.decode_request(request([0, 2**61], datatype, raw))
    assert caught.value.message.startswith("input 'x': shape [0, 2305843009213693952] ")
