"""The gRPC tests' fixtures: a FakeEngine, and a client stub of a server over it
(tests/unit/server/grpc/serving.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest

from server.grpc.proto import grpc_service_pb2_grpc as pb_grpc
from tests.unit.server.fake_engine import FakeEngine
from tests.unit.server.grpc.serving import Stub, _serve


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
async def stub(engine: FakeEngine) -> AsyncIterator[Stub]:
    server, port = await _serve(engine)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield pb_grpc.GRPCInferenceServiceStub(channel)
    await server.stop(grace=None)
