"""loadtests.benchmarks.grpc_load: the closed-loop gRPC load generator, run against grpc_floor's
in-process floor servicer: every call counted, answered or failed, and its latencies."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from loadtests.benchmarks.grpc_floor import FloorServicer
from loadtests.benchmarks.grpc_load import run
from server.grpc.proto import grpc_service_pb2_grpc as pb_grpc
from tests.redis_process import free_port


class FailingAfterFirst(FloorServicer):
    """The floor, failing every other call after the first (the warm-up)."""

    calls = 0

    async def ModelInfer(self, request: Any, context: Any) -> Any:
        self.calls += 1
        if self.calls > 1 and self.calls % 2 == 0:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "overloaded")
        return await super().ModelInfer(request, context)


async def serve(servicer: FloorServicer) -> AsyncIterator[str]:
    server = grpc.aio.server()
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


@pytest.fixture
async def floor() -> AsyncIterator[str]:
    async for target in serve(FloorServicer(request_id=True)):
        yield target


@pytest.fixture
async def failing() -> AsyncIterator[str]:
    async for target in serve(FailingAfterFirst()):
        yield target


async def test_every_call_is_counted_with_its_latency(floor: str) -> None:
    result = await run(floor, "mlp", concurrency=4, seconds=0.2)
    assert result["errors"] == 0
    assert result["requests"] >= 8
    assert result["throughput"] * result["duration_us"] / 1e6 == pytest.approx(result["requests"])
    assert 0 < result["p50_us"] <= result["p99_us"]


async def test_failed_calls_are_errors_not_a_crash(failing: str) -> None:
    result = await run(failing, "mlp", concurrency=2, seconds=0.2)
    answered = result["throughput"] * result["duration_us"] / 1e6
    assert result["errors"] >= 2
    assert answered + result["errors"] == pytest.approx(result["requests"])
    assert abs(answered - result["errors"]) <= 2  # every other call failed
