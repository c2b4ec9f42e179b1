"""How an engine error ends a gRPC call (server/grpc/calls.py), over a real grpc.aio server on a
free port backed by FakeEngine: its status code, message and trailing metadata, and nothing of the
refused call kept alive by a reference cycle."""

from __future__ import annotations

import asyncio
import gc
import weakref

import grpc
import numpy as np

from engine.errors import Overloaded, RateLimited
from server.grpc.proto import grpc_service_pb2 as pb
from tests.unit.server.fake_engine import FakeEngine
from tests.unit.server.grpc.serving import Stub, _status, raw_request


async def test_engine_errors_map_to_status_and_trailing_metadata(
    stub: Stub, engine: FakeEngine
) -> None:
    request = raw_request("double", {"x": ("FP32", np.zeros((1, 4), np.float32))})
    engine.fail_next = RateLimited("tenant 'a' is over 5/s", 2.2, {"X-RateLimit-Limit": "5"})
    error = await _status(stub.ModelInfer(request))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error.details() == "tenant 'a' is over 5/s"
    trailing = dict(error.trailing_metadata() or ())
    assert trailing["retry-after"] == "3"
    assert trailing["x-ratelimit-limit"] == "5"

    engine.fail_next = Overloaded("queue of model 'double' is full (64 rows)")
    error = await _status(stub.ModelInfer(request))
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert "queue of model 'double' is full" in error.details()

    engine.fail_next = ZeroDivisionError("secret detail")
    error = await _status(stub.ModelInfer(request))
    assert error.code() == grpc.StatusCode.INTERNAL
    assert error.details() == "internal error"


async def test_a_refused_call_leaves_no_cycle_holding_its_inputs(
    stub: Stub, engine: FakeEngine
) -> None:
    """An engine error was answered by context.abort inside the handler's `except`: grpc keeps
    the AbortError it raises in the call's state, which its traceback holds (a cycle), and the
    AbortError held the engine's error as its context, whose traceback held every frame of the
    request. The inputs waited for the cyclic collector, which the server runs seldom."""
    request = raw_request("double", {"x": ("FP32", np.zeros((1, 4), np.float32))})
    gc.collect()
    gc.disable()
    try:
        engine.fail_next = Overloaded("queue of model 'double' is full (64 rows)")
        error = await _status(stub.ModelInfer(request))
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert error.details() == "queue of model 'double' is full (64 rows)"
        inputs = weakref.ref(engine.requests.pop().inputs["x"])
        # grpc's accept loop keeps the latest call's state until the next call arrives.
        assert (await stub.ServerLive(pb.ServerLiveRequest())).live is True
        for _ in range(100):  # the refused call's task ends just after the client has its status
            if inputs() is None:
                break
            await asyncio.sleep(0.01)  # polling a condition
        assert inputs() is None, "the refused call's inputs are kept until the collector runs"
    finally:
        gc.enable()
