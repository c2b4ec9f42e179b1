"""gRPC tensors: ModelInferRequest decoding of bad shapes and sizes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest

from engine.errors import InvalidInput
from server.grpc import tensors
from server.grpc.proto import grpc_service_pb2 as pb


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
        tensors.decode_request(request([0, 2**61], datatype, raw))
    assert caught.value.message.startswith("input 'x': shape [0, 2305843009213693952] ")


def test_the_check_sees_declared_shapes_before_any_array_is_built() -> None:
    seen: list[tuple[dict[str, Any], dict[str, str]]] = []

    def refuse(shapes: Mapping[str, Sequence[int]], datatypes: Mapping[str, str]) -> None:
        seen.append((dict(shapes), dict(datatypes)))
        raise InvalidInput("refused")

    # contents that do not match the shape: decoding would fail, so the check ran first
    message = request([1_250_000, 16], "FP32")
    message.inputs[0].contents.fp32_contents.extend([1.0])
    with pytest.raises(InvalidInput, match="refused"):
        tensors.decode_request(message, refuse)
    assert seen == [({"x": (1_250_000, 16)}, {"x": "FP32"})]


def test_typed_contents_out_of_the_datatypes_range_are_invalid_input() -> None:
    message = request([1, 1], "INT8")
    message.inputs[0].contents.int_contents.extend([300])
    with pytest.raises(InvalidInput) as caught:
        tensors.decode_request(message)
    assert caught.value.message == "input 'x': value 300 is out of range for INT8 (-128 to 127)"


def test_timeout_and_priority_are_bounded_by_their_protobuf_types() -> None:
    """uint64_param holds at most 2^64 - 1 (protobuf refuses more when the client builds the
    message), which is taken; a double_param past 64 bits is out of range, as JSON's is."""
    with pytest.raises(ValueError, match="out of range"):
        pb.InferParameter().uint64_param = 2**64
    message = request([1, 4], raw=bytes(16))
    message.parameters["timeout"].uint64_param = 2**64 - 1
    message.parameters["priority"].uint64_param = 2**64 - 1
    decoded = tensors.decode_request(message)
    assert (decoded.priority, decoded.timeout_s) == (2**64 - 1, (2**64 - 1) / 1e6)
    message.parameters["timeout"].double_param = 1e30
    with pytest.raises(InvalidInput) as caught:
        tensors.decode_request(message)
    assert caught.value.message == (
        f"parameter 'timeout' is out of range (0 to {2**64 - 1}), got 2^64 or more"
    )
