"""Reading a generative model's ModelInfer request (server/grpc/generate.py)."""

from __future__ import annotations

import pytest

from engine.errors import InvalidInput
from server.grpc.generate import _text
from server.grpc.proto import grpc_service_pb2 as pb


def test_text_input_in_shared_memory_is_refused_saying_so() -> None:
    request = pb.ModelInferRequest(model_name="llm")
    tensor = request.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    tensor.parameters["shared_memory_region"].string_param = "r"
    tensor.parameters["shared_memory_byte_size"].int64_param = 16
    with pytest.raises(InvalidInput, match="text_input in the request, not in shared memory"):
        _text(request)


def test_text_input_is_read() -> None:
    request = pb.ModelInferRequest(model_name="llm")
    tensor = request.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    tensor.contents.bytes_contents.append("grüß".encode())
    assert _text(request) == "grüß"
