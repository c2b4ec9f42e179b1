"""The engine process's side of the worker data plane (server/link/host.py), through the rig of
tests/unit/server/link/rig.py or a raw socket speaking server/link/frames.py frames: worker
connections (HELLO, a successor, a worker gone), one engine shared by every worker, and frames
refused."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from engine.errors import (
    Overloaded,
    RateLimited,
)
from engine.types import InferRequest, InferResponse
from server.link.frames import FrameBuffer, Kind, frame
from tests.unit.server.link.rig import Rig, infer_request, request, until


async def test_a_dead_worker_s_requests_are_withdrawn_and_its_slots_freed(
    make_rig: Callable[..., Rig],
) -> None:
    rig = make_rig()
    await rig.start()
    try:
        remote = await rig.remote()
        model = rig.engine.registry.resolve("demo", None)
        model.batcher.pause()
        calls = [asyncio.create_task(remote.infer(request(np.ones((1, 16), np.float32))))
                 for _ in range(3)]  # fmt: skip
        await until(lambda: len(rig.host.workers[0].held_in) == 3)
        assert remote._transport is not None
        remote._transport.abort()  # the worker process dies
        for call in calls:
            with pytest.raises(Overloaded):  # its callers are gone with it in a real worker
                await asyncio.wait_for(call, 5)
        executed = model.stats.execution_count
        model.batcher.resume()  # the batcher drops the withdrawn requests unrun
        await until(lambda: not rig.host.workers[0].held_in)  # and nothing views them any more
        assert rig.host.workers[0].out_allocator.used_bytes == 0
        # Its successor in the same slot starts with a free arena and is served.
        successor = await rig.remote()
        assert successor.allocator.used_bytes == 0
        answer = await successor.infer(request(np.zeros((2, 16), np.float32)))
        assert answer.outputs["probabilities"].shape == (2, 10)
        assert model.stats.execution_count == executed + 1  # the dead worker's never ran
    finally:
        await rig.close()


async def test_admission_is_exact_across_workers(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig(workers=2, rate_limit={"default": {"rate_per_s": 0.001, "burst": 5}})
    await rig.start()
    try:
        first, second = await rig.remote(0), await rig.remote(1)
        outcomes = await asyncio.gather(
            *(r.infer(request(np.zeros((1, 16), np.float32))) for r in (first, second) * 5),
            return_exceptions=True,
        )
        assert sum(not isinstance(o, BaseException) for o in outcomes) == 5  # not 5 per worker
        assert sum(isinstance(o, RateLimited) for o in outcomes) == 5
    finally:
        await rig.close()


async def test_a_descriptor_that_would_allocate_terabytes_is_an_invalid_input(rig: Rig) -> None:
    # A worker's frame is untrusted: a BYTES tensor claiming 2**40 elements in 8 bytes was
    # allocated before it was read (a MemoryError the connection's handler did not catch).
    reader, writer = await asyncio.open_unix_connection(rig.path)
    frames = FrameBuffer()

    async def frames_until(wanted: set[Kind]) -> dict[Kind, Any]:
        got: dict[Kind, Any] = {}
        while not wanted <= got.keys():
            got.update(frames.feed(await asyncio.wait_for(reader.read(1 << 16), 5)))
        return got

    try:
        writer.write(frame(Kind.HELLO, {"worker": 0}))
        await frames_until({Kind.WELCOME})
        bad = [["x", "BYTES", [2**40], 0, 8]]
        writer.write(frame(Kind.INFER, [infer_request(1, 0, 64, bad, {"x": "BYTES"})]))
        got = await frames_until({Kind.ERROR, Kind.FREE_IN})
        assert (got[Kind.ERROR]["id"], got[Kind.ERROR]["error"]) == (1, "InvalidInput")
        assert "of 1099511627776 elements cannot fit in 8 bytes" in got[Kind.ERROR]["message"]
        assert got[Kind.FREE_IN] == {"slots": [0]}  # its in-slot is given back at once
        assert not rig.host.workers[0].held_in
    finally:
        writer.close()


ONE = infer_request(1, 0, 64, [["x", "<f4", [1, 16], 0, 64]], {"x": "FP32"})


@pytest.mark.parametrize(
    "payload",
    [
        {"id": 1, "slot": 0, "size": 64, "inputs": [["x", "<f4", [1, 16], 0, 64]],
         "request": {"model_name": "demo", "datatypes": {"x": "FP32"}}},  # the object it was
        ONE,  # a request, not a list of them
        [ONE[:-1]],
        [[*ONE, None]],
        [ONE, "x"],
        "x",
    ],
)  # fmt: skip
async def test_an_infer_frame_that_is_not_its_list_closes_the_connection_holding_nothing(
    rig: Rig, payload: object
) -> None:
    # An INFER frame is a list of requests, each a list of INFER_ITEMS (server/link/frames.py);
    # anything else from a worker is a broken peer, refused before its slot is taken (the
    # requests before it in the frame are withdrawn, as a lost worker's are).
    reader, writer = await asyncio.open_unix_connection(rig.path)
    try:
        writer.write(frame(Kind.HELLO, {"worker": 0}))
        assert [k for k, _ in FrameBuffer().feed(await reader.read(1 << 16))] == [Kind.WELCOME]
        writer.write(frame(Kind.INFER, payload))
        assert await asyncio.wait_for(reader.read(1 << 16), 5) == b""
        await until(lambda: not rig.host.workers[0].held_in)  # [ONE, "x"]: once ONE is done
    finally:
        writer.close()


async def test_an_infer_request_whose_call_id_is_not_an_integer_is_never_run(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The call id keys the host's tasks: a list (unhashable) failed as the task was recorded,
    # after it was created, so the connection closed and the request ran all the same.
    ran: list[InferRequest] = []
    real = rig.engine.infer

    async def recording(request: InferRequest) -> InferResponse:
        ran.append(request)
        return await real(request)

    monkeypatch.setattr(rig.engine, "infer", recording)
    x = np.ones((1, 16), np.float32)
    rig.worker_arenas[0][0].buf[0:64] = x.tobytes()
    reader, writer = await asyncio.open_unix_connection(rig.path)
    try:
        writer.write(frame(Kind.HELLO, {"worker": 0}))
        assert [k for k, _ in FrameBuffer().feed(await reader.read(1 << 16))] == [Kind.WELCOME]
        writer.write(frame(Kind.INFER, [[[1], *ONE[1:]]]))
        assert await asyncio.wait_for(reader.read(1 << 16), 5) == b""
        await until(lambda: not rig.host.workers[0].held_in)
        assert ran == []
        assert not [t for t in asyncio.all_tasks() if "_answer" in repr(t.get_coro())]
    finally:
        writer.close()


@pytest.mark.parametrize("slot", [None, -1, 1, "0", True])
async def test_a_hello_without_a_worker_slot_of_its_own_is_refused(rig: Rig, slot: object) -> None:
    # Every connection is a worker slot's, with its arenas: one naming none (what the blocking
    # calls' socket was) or another is closed at once, unanswered.
    reader, writer = await asyncio.open_unix_connection(rig.path)
    try:
        writer.write(frame(Kind.HELLO, {"worker": slot}))
        assert await asyncio.wait_for(reader.read(1 << 16), 5) == b""
        assert rig.host.workers[0].connections == 0
    finally:
        writer.close()


class HeldIn(dict[int, int]):
    """A worker slot's `held_in` that remembers every in-slot the engine ever took."""

    def __init__(self) -> None:
        super().__init__()
        self.ever: list[int] = []

    def __setitem__(self, offset: int, size: int) -> None:
        self.ever.append(offset)
        super().__setitem__(offset, size)


async def test_frames_of_a_replaced_worker_connection_are_not_served(rig: Rig) -> None:
    """A worker's successor says HELLO while frames of the dead process are still unread: the
    successor was welcomed with the slots held then, so a request read after it would hold a
    slot the successor may write into, and its release would free that slot under whatever
    the successor placed there. The old connection is closed at its next frame instead."""
    held = rig.host.workers[0].held_in = HeldIn()
    old_reader, old = await asyncio.open_unix_connection(rig.path)
    new_reader, new = await asyncio.open_unix_connection(rig.path)
    try:
        for writer, reader in ((old, old_reader), (new, new_reader)):
            writer.write(frame(Kind.HELLO, {"worker": 0}))
            assert [k for k, _ in FrameBuffer().feed(await reader.read(1 << 16))] == [Kind.WELCOME]
        described = [["x", "FP32", [1, 16], 0, 64]]
        old.write(frame(Kind.INFER, [infer_request(1, 0, 64, described, {"x": "FP32"})]))
        closed = asyncio.create_task(old_reader.read(1 << 16))
        await until(lambda: closed.done() or bool(held.ever))
        assert held.ever == []
        assert await closed == b""
    finally:
        old.close()
        new.close()
