"""What the gRPC front-end's tests share: a real grpc.aio server on a free port over FakeEngine
(real ONNX Runtime sessions at the engine-facade seam), the requests they send and how they read
its answers and statuses. The `engine` and `stub` fixtures are conftest.py's."""

from __future__ import annotations

from typing import Any

import grpc
import numpy as np
import pytest

from server.grpc.proto import grpc_service_pb2 as pb
from server.grpc.service import build_grpc_server
from server.settings import Settings
from tests.unit.server.fake_engine import FakeEngine

Stub = Any


async def _serve(engine: FakeEngine, **overrides: Any) -> tuple[grpc.aio.Server, int]:
    server, port = build_grpc_server(Settings(grpc_port=0, **overrides), engine)  # type: ignore[arg-type]
    await server.start()
    return server, port


def raw_request(model: str, tensors: dict[str, tuple[str, np.ndarray]], **kw: Any) -> Any:
    request = pb.ModelInferRequest(model_name=model, **kw)
    for name, (datatype, array) in tensors.items():
        request.inputs.add(name=name, datatype=datatype, shape=list(array.shape))
        request.raw_input_contents.append(array.tobytes())
    return request


def output(response: Any, name: str) -> np.ndarray:
    index = [o.name for o in response.outputs].index(name)
    spec = response.outputs[index]
    dtype = {"FP32": np.float32, "FP16": np.float16, "INT8": np.int8, "BOOL": np.bool_}
    return np.frombuffer(response.raw_output_contents[index], dtype[spec.datatype]).reshape(
        tuple(spec.shape)
    )


async def _status(call: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value
