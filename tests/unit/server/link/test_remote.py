"""A worker's RemoteEngine (server/link/remote.py) against an EngineHost in front of a real Engine,
in one process (the rig: tests/unit/server/link/rig.py): inference end to end, its arenas and
errors, and the RESULT frames the worker reads."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from engine.demo import mlp_model
from engine.errors import (
    InvalidInput,
    ModelNotFound,
    Overloaded,
    PayloadTooLarge,
    ShuttingDown,
)
from engine.tracing import request_id
from engine.types import InferRequest, InferResponse
from server.link.frames import FrameBuffer, Kind, frame
from server.link.remote import RemoteEngine
from server.link.shm.arena import Arena
from server.link.shm.placement import WRITE_OFF_LOOP_BYTES
from server.settings import load_settings
from tests.models import write_model
from tests.unit.server.link.rig import Rig, request, until


async def test_inputs_are_viewed_in_the_arena_and_outputs_come_back_in_place(rig: Rig) -> None:
    seen: list[np.ndarray] = []
    infer = rig.engine.infer

    async def spy(req: InferRequest) -> object:
        seen.append(req.inputs["x"])
        return await infer(req)

    rig.engine.infer = spy  # type: ignore[method-assign]
    remote = await rig.remote()
    x = np.random.default_rng(1).standard_normal((3, 16)).astype(np.float32)
    answer = await remote.infer(request(x))
    expected = await infer(request(x.copy()))
    np.testing.assert_array_equal(
        answer.outputs["probabilities"], expected.outputs["probabilities"]
    )
    assert answer.model_version == "1"
    engine_in = np.frombuffer(rig.host.workers[0].inputs.buf, np.uint8)
    assert np.shares_memory(seen[0], engine_in)  # the engine read the worker's bytes in place
    worker_out = np.frombuffer(rig.worker_arenas[0][1].buf, np.uint8)
    assert np.shares_memory(answer.outputs["probabilities"], worker_out)
    del seen[:], engine_in, worker_out
    # The slots are freed once nothing views them: the answer's when the worker drops it, the
    # request's when the engine's arrays are gone.
    assert rig.host.workers[0].out_allocator.used_bytes > 0
    del answer
    await until(lambda: rig.host.workers[0].out_allocator.used_bytes == 0)
    await until(lambda: remote.allocator.used_bytes == 0)
    assert not rig.host.workers[0].held_in


async def test_every_field_of_a_request_and_of_its_answer_crosses(rig: Rig) -> None:
    # INFER and RESULT frames are lists read by position (server/link/frames.py): each field must
    # land where the other side reads it, and a value of the wrong type for a field is no time.
    seen: list[InferRequest] = []

    async def spy(req: InferRequest) -> InferResponse:
        seen.append(req)
        outputs = {"probabilities": np.full((1, 10), 0.5, np.float32)}
        types = {"probabilities": "FP32"}
        return InferResponse("demo", "1", outputs, types, "answer-7", {"cache_hit": False})

    rig.engine.infer = spy  # type: ignore[method-assign]
    remote = await rig.remote()
    x = np.arange(16, dtype=np.float32).reshape(1, 16)
    now = time.monotonic()
    sent = InferRequest("demo", {"x": x}, {"x": "FP32"}, model_version="1", id="asked-3",
                        outputs=["probabilities"], parameters={"tag": "t"}, priority=2,
                        timeout_s=1.5, tenant="acme", arrived=now)  # fmt: skip
    answer = await remote.infer(sent)
    (got,) = seen
    np.testing.assert_array_equal(got.inputs["x"], x)
    fields = ("model_name", "datatypes", "model_version", "id", "outputs", "parameters",
              "priority", "timeout_s", "tenant", "arrived")  # fmt: skip
    assert [getattr(got, f) for f in fields] == [getattr(sent, f) for f in fields]
    assert (answer.model_name, answer.model_version, answer.datatypes, answer.id) == (
        "demo", "1", {"probabilities": "FP32"}, "answer-7")  # fmt: skip
    assert answer.parameters == {"cache_hit": False}
    np.testing.assert_array_equal(answer.outputs["probabilities"], np.full((1, 10), 0.5))
    del got, seen[:]
    await remote.infer(dataclasses.replace(sent, arrived=int(now)))  # type: ignore[arg-type]
    assert seen[0].arrived is None


async def test_a_request_the_data_plane_let_in_is_sent_while_the_worker_drains(rig: Rig) -> None:
    """Draining is the data plane's to refuse, before it decodes a request (it asks
    `draining`): the worker's RemoteEngine sends one it let in, and the engine answers it."""
    remote = await rig.remote()
    remote.stop_accepting()
    assert remote.draining
    answer = await remote.infer(request(np.ones((1, 16), np.float32)))
    assert answer.outputs["probabilities"].shape == (1, 10)


async def test_engine_errors_keep_their_class_message_and_retry_after(rig: Rig) -> None:
    remote = await rig.remote()
    with pytest.raises(ModelNotFound, match="unknown model 'nope'"):
        await remote.infer(request(np.zeros((1, 16), np.float32), model="nope"))
    with pytest.raises(InvalidInput, match="x"):
        await remote.infer(request(np.zeros((1, 15), np.float32)))
    with pytest.raises(ModelNotFound):
        await remote.model_metadata("nope")
    with pytest.raises(ModelNotFound):
        await remote.input_check("nope")
    meta = await remote.model_metadata("demo")
    assert meta.inputs[0].shape == (-1, 16)
    check = await remote.input_check("demo")
    assert check({"x": [2, 16]}, {"x": "FP32"}) == 2


async def test_a_full_arena_is_overloaded_at_once_and_never_waits(
    make_rig: Callable[..., Rig],
) -> None:
    rig = make_rig(arena_bytes=8 * 64)  # 8 requests of one 64-byte row
    await rig.start()
    try:
        remote = await rig.remote()
        batcher = rig.engine.registry.resolve("demo", None).batcher
        batcher.pause()
        held = [asyncio.create_task(remote.infer(request(np.full((1, 16), i, np.float32))))
                for i in range(8)]  # fmt: skip
        await until(lambda: remote.allocator.used_bytes == 8 * 64)
        with pytest.raises(Overloaded, match="request arena is full") as refused:
            await asyncio.wait_for(remote.infer(request(np.zeros((1, 16), np.float32))), 1.0)
        assert refused.value.retry_after_header == "1"
        with pytest.raises(PayloadTooLarge, match=r"the tensors take 576 bytes, more than all of "
                           r"this worker's request arena holds \(512 bytes, the setting "
                           r"worker_arena_bytes\)"):  # fmt: skip
            await remote.infer(request(np.zeros((9, 16), np.float32)))
        batcher.resume()
        answers = await asyncio.wait_for(asyncio.gather(*held), 10)
        assert len({a.outputs["probabilities"].tobytes() for a in answers}) == 8
    finally:
        await rig.close()


async def test_a_cancelled_call_is_withdrawn_from_the_engine_s_batcher(rig: Rig) -> None:
    remote = await rig.remote()
    model = rig.engine.registry.resolve("demo", None)
    model.batcher.pause()
    call = asyncio.create_task(remote.infer(request(np.ones((1, 16), np.float32))))
    await until(lambda: len(rig.host.workers[0].held_in) == 1)
    call.cancel()  # the HTTP client went away
    with pytest.raises(asyncio.CancelledError):
        await call
    await until(lambda: not rig.host.workers[0].peer or not rig.host.workers[0].peer.tasks)
    executed = model.stats.execution_count
    model.batcher.resume()
    await until(lambda: remote.allocator.used_bytes == 0)  # its inputs are free again
    answer = await remote.infer(request(np.zeros((1, 16), np.float32)))
    assert answer.outputs["probabilities"].shape == (1, 10)
    assert model.stats.execution_count == executed + 1  # the cancelled request never ran


async def test_the_request_id_reaches_the_engine_process(rig: Rig) -> None:
    seen: list[str | None] = []
    infer = rig.engine.infer

    async def spy(req: InferRequest) -> object:
        seen.append(request_id.get())  # what the engine's log lines carry
        return await infer(req)

    rig.engine.infer = spy  # type: ignore[method-assign]
    remote = await rig.remote()
    token = request_id.set("req-42")
    try:
        await remote.infer(request(np.zeros((1, 16), np.float32)))
    finally:
        request_id.reset(token)
    assert seen == ["req-42"]


async def test_large_tensors_are_written_and_read_off_the_loop_and_answer_right(
    tmp_path: Path, socket_dir: str
) -> None:
    width = WRITE_OFF_LOOP_BYTES // 4 + 1024  # one row of inputs passes the offload threshold
    write_model(tmp_path / "big", "wide", mlp_model((width, 4, width)), "max_batch_size: 4\n")
    settings = load_settings(model_repository=tmp_path / "big")
    rig = Rig(settings, os.path.join(socket_dir, "engine.sock"), 1, 64 << 20)
    await rig.start()
    try:
        remote = await rig.remote()
        x = np.random.default_rng(5).standard_normal((2, width)).astype(np.float32)
        answer = await remote.infer(InferRequest("wide", {"x": x}, {"x": "FP32"}))
        expected = await rig.engine.infer(InferRequest("wide", {"x": x}, {"x": "FP32"}))
        got = answer.outputs["probabilities"]
        assert got.nbytes > WRITE_OFF_LOOP_BYTES  # the answer was written in a thread too
        np.testing.assert_array_equal(got, expected.outputs["probabilities"])
        del answer, got
        await until(lambda: rig.host.workers[0].out_allocator.used_bytes == 0)
        await until(lambda: remote.allocator.used_bytes == 0)
    finally:
        await rig.close()


ANSWER = [1, 0, 64, [], "demo", "1", {}, None, {}]


@pytest.mark.parametrize(
    "payload",
    [{"id": 1, "slot": 0, "size": 64, "outputs": []}, ANSWER, [ANSWER[:-1]], [[1] * 10]],
)
async def test_a_result_frame_that_is_not_its_list_ends_the_connection(
    socket_dir: str, payload: object
) -> None:
    # A RESULT frame is a list of answers, each a list of RESULT_ITEMS; anything else from the
    # engine is a broken peer: the request it would answer fails, as every request does once
    # the engine is gone.
    writers: list[asyncio.StreamWriter] = []

    async def engine(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        frames = FrameBuffer()
        while data := await reader.read(1 << 16):
            for kind, _ in frames.feed(data):
                if kind is Kind.HELLO:
                    writer.write(frame(Kind.WELCOME, {"held": [], "state": {}}))
                elif kind is Kind.INFER:
                    writer.write(frame(Kind.RESULT, payload))

    path = os.path.join(socket_dir, "scripted.sock")
    server = await asyncio.start_unix_server(engine, path)
    remote = RemoteEngine(load_settings(), path, 0, (Arena(1 << 16), Arena(1 << 16)))
    try:
        await remote.start()
        with pytest.raises(ShuttingDown, match="the engine process is gone"):
            await remote.infer(request(np.ones((1, 16), np.float32)))
        assert not remote.live
    finally:
        await remote.close()
        for writer in writers:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
        server.close()
        await server.wait_closed()
