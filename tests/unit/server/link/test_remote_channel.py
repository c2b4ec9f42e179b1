"""The worker's connection to the engine process (server/link/remote_channel.py), through the rig of
tests/unit/server/link/rig.py: freed answer slots riding on the next frame, and requests the channel
cannot carry refused before anything is sent."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from engine.errors import (
    InvalidInput,
    PayloadTooLarge,
)
from engine.generation.service import GenerateRequest
from engine.types import InferRequest
from server.link.frames import MAX_FRAME_BYTES, FrameBuffer, Kind
from server.link.remote import RemoteEngine
from server.link.remote_channel import FREE_DELAY_S
from tests.unit.server.link.rig import Rig, request, until

# On asyncio's loop and on uvloop, which a worker runs: the two order a loop iteration's timers
# and callbacks differently, and a flush is timed in iterations (tests/unit/engine/conftest.py).
pytestmark = pytest.mark.asyncio(loop_factories=["asyncio", "uvloop"])


class Recorded:
    """A transport that keeps what is written to it (uvloop's transports are read-only)."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))
        self.transport.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)


def written(remote: RemoteEngine) -> list[bytes]:
    """What `remote` writes to the engine process from now on, a write an item."""
    assert remote._transport is not None
    recorded = Recorded(remote._transport)
    remote._transport = recorded  # type: ignore[assignment]
    return recorded.writes


async def test_freed_answer_slots_ride_on_the_next_request_or_go_within_a_bound(rig: Rig) -> None:
    # A frame carrying only frees woke the engine process for nothing else: 43% of its reads
    # under HTTP load were such frames.
    remote = await rig.remote()
    writes = written(remote)
    x = np.ones((1, 16), np.float32)
    answer = await remote.infer(request(x))
    del answer  # its slot is free: no frame goes for that alone
    for _ in range(5):  # loop iterations pass (the response being sent, say)
        await asyncio.sleep(0)
    await remote.infer(request(x))  # the next request carries it
    kinds = [[kind for kind, _ in FrameBuffer().feed(data)] for data in writes]
    assert kinds == [[Kind.INFER], [Kind.INFER, Kind.FREE_OUT]]
    # With nothing else to send, the frees still go, within FREE_DELAY_S.
    await until(lambda: rig.host.workers[0].out_allocator.used_bytes == 0, timeout_s=1.0)
    assert [kind for kind, _ in FrameBuffer().feed(writes[-1])] == [Kind.FREE_OUT]


async def test_requests_a_loop_iteration_apart_share_one_frame(rig: Rig) -> None:
    # grpc.aio hands calls to the loop an iteration apart, and each went to the engine process
    # in a frame of its own: a wake-up of that process a call (0.99 of its reads a call under
    # gRPC load, 0.04-0.2 under HTTP load).
    remote = await rig.remote()
    writes = written(remote)
    x = np.ones((1, 16), np.float32)
    first = asyncio.create_task(remote.infer(request(x)))
    await asyncio.sleep(0)  # the first request is queued in this iteration, the next in the next
    second = asyncio.create_task(remote.infer(request(x)))
    await asyncio.gather(first, second)
    infers = [message for data in writes for kind, message in FrameBuffer().feed(data)
              if kind is Kind.INFER]  # fmt: skip
    assert [len(requests) for requests in infers] == [2]


async def test_a_lone_request_is_sent_without_waiting_for_company(rig: Rig) -> None:
    remote = await rig.remote()
    writes = written(remote)
    call = asyncio.create_task(remote.infer(request(np.ones((1, 16), np.float32))))
    for _ in range(4):  # a few iterations (no timer): it is sent while nothing else happens
        await asyncio.sleep(0)
    assert [kind for data in writes for kind, _ in FrameBuffer().feed(data)] == [Kind.INFER]
    await call


async def test_frees_that_rode_on_a_request_leave_no_timer_to_wake_the_worker(rig: Rig) -> None:
    # At 16 connections a worker idles between its bursts longer than FREE_DELAY_S: the timer
    # of frees already sent woke it for nothing once a batch (0.96 -> 0.90 switches a request).
    remote = await rig.remote()
    fired: list[None] = []
    send_frees = remote._send_frees
    remote._send_frees = lambda: (fired.append(None), send_frees())[1]  # type: ignore[method-assign]
    x = np.ones((1, 16), np.float32)
    answer = await remote.infer(request(x))
    del answer  # its slot is free: the timer starts
    held = await remote.infer(request(x))  # the frees ride on this request (held: no new free)
    await asyncio.sleep(3 * FREE_DELAY_S)
    assert fired == []
    del held


def nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


async def test_a_request_the_channel_cannot_carry_is_invalid_input_and_holds_nothing(
    rig: Rig,
) -> None:
    """What JSON cannot hold (bytes, nesting past orjson's 254 levels) raised TypeError from the
    frame encoder after the call was registered: a 500, and a generation stayed counted in flight,
    so a drain waited its whole bound. A load answered 500 where one process answers 400."""
    remote = await rig.remote()
    for parameters in ({"config": b"\xff"}, {"x": nested(300)}):
        with pytest.raises(InvalidInput) as in_process:
            await rig.engine.load_model("demo", parameters)
        with pytest.raises(InvalidInput) as through_worker:
            await remote.load_model("demo", parameters)
        assert through_worker.value.message == in_process.value.message
    x = np.zeros((1, 16), np.float32)
    deep = InferRequest("demo", {"x": x}, {"x": "FP32"}, parameters={"tag": nested(300)})
    with pytest.raises(InvalidInput, match="nests lists or objects deeper than 254 levels"):
        await remote.infer(deep)
    assert remote.allocator.used_bytes == 0  # its slot, never sent, is free again
    stop = GenerateRequest("demo", None, "hi", options={"stop": nested(300)})
    with pytest.raises(InvalidInput, match="the generation request cannot be passed"):
        await remote.generate(stop)
    assert (remote._pending, remote._streams, remote._idle.is_set()) == ({}, {}, True)
    answer = await remote.infer(request(x))  # the connection serves on
    assert answer.outputs["probabilities"].shape == (1, 10)


async def test_a_request_past_the_frame_limit_is_refused_not_the_connection(rig: Rig) -> None:
    """A request within max_request_bytes made a control frame past MAX_FRAME_BYTES (a large
    parameter; gRPC strings grow 6x as JSON escapes): the engine took the worker for a broken
    peer and closed its connection, failing every request of the worker, which restarted."""
    remote = await rig.remote()
    x = np.zeros((1, 16), np.float32)
    big = InferRequest("demo", {"x": x}, {"x": "FP32"}, parameters={"tag": "\x01" * (11 << 20)})
    with pytest.raises(PayloadTooLarge, match=f"more than the {MAX_FRAME_BYTES} bytes"):
        await remote.infer(big)
    del big
    assert remote.allocator.used_bytes == 0
    answer = await remote.infer(request(x))
    assert answer.outputs["probabilities"].shape == (1, 10)
    assert remote.live
