"""The engine process's side of the worker data plane (server/link/host.py), through the rig of
tests/unit/server/link/rig.py or a raw socket speaking server/link/frames.py frames: worker
connections (HELLO, a successor, a worker gone), one engine shared by every worker, frames
refused, and a request's inputs checked once, by the worker, while the version it checked serves."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine.demo import mlp_model
from engine.errors import (
    InvalidInput,
    Overloaded,
    RateLimited,
)
from engine.types import Checked, InferRequest, InferResponse
from engine.validate import InputCheck, check_inputs, unchecked
from server.link.frames import FrameBuffer, Kind, frame
from tests.models import write_model
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


# -- a request's inputs checked once ---------------------------------------------------------------


def checked_request(check: InputCheck, x: np.ndarray) -> InferRequest:
    """A request for the demo model as a worker's data plane hands it over: its declared shapes
    and datatypes run through `check` as it was decoded (InferRequest.checked)."""
    checked = Checked(check)
    checked({"x": x.shape}, {"x": "FP32"})
    asked = request(x)
    asked.checked = checked
    return asked


class CountedChecks:
    """Every input check that runs (engine/validate.py `check_inputs`), the worker's (its copy
    of the model's inputs) and the engine's (the model's own): the shapes each was given."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.shapes: list[dict[str, tuple[int, ...]]] = []
        for where in ("server.link.remote_control.check_inputs", "engine.model.check_inputs"):
            monkeypatch.setattr(where, self)

    def __call__(self, shapes: Any, *args: Any, **kwargs: Any) -> int:
        self.shapes.append({name: tuple(shape) for name, shape in shapes.items()})
        return check_inputs(shapes, *args, **kwargs)


async def test_a_request_the_worker_checked_is_neither_resolved_nor_checked_again(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker's data plane checks a request's declared shapes against the model as it
    decodes it; the engine process then resolved the model and checked the arrays again, every
    request twice, where one process checks it once."""
    checks = CountedChecks(monkeypatch)  # before the worker fetches its check, which binds it
    remote = await rig.remote()
    check = await remote.input_check("demo")
    resolved: list[tuple[str, str | None]] = []
    resolve = rig.engine.registry.resolve

    def counted_resolve(name: str, version: str | None) -> Any:
        resolved.append((name, version))
        return resolve(name, version)

    monkeypatch.setattr(rig.engine.registry, "resolve", counted_resolve)
    x = np.ones((3, 16), np.float32)
    answer = await remote.infer(checked_request(check, x))
    assert answer.outputs["probabilities"].shape == (3, 10)
    assert checks.shapes == [{"x": (3, 16)}]  # the worker's, on the declared shapes: once
    assert resolved == []
    # With no model check (none ran, or `unchecked`: an on_demand model never loaded), the
    # engine resolves the request and checks its inputs itself.
    for bare in (request(x), checked_request(unchecked, x)):
        checks.shapes.clear()
        assert (await remote.infer(bare)).outputs["probabilities"].shape == (3, 10)
        assert checks.shapes == [{"x": (3, 16)}]  # the engine's
    assert resolved == [("demo", None)] * 2


async def test_a_version_replaced_after_the_worker_s_check_checks_the_request_again(
    make_rig: Callable[..., Rig], tmp_path: Path
) -> None:
    """The model is reloaded between the worker's check and the engine's receipt of the
    request: the version the worker checked against no longer serves, so the engine resolves
    the request and checks it against the new version, which refuses it with the 400 one
    process gives (trusted, the new version would have run inputs it does not take)."""
    rig = make_rig(model_control_mode="explicit", load_models=["demo"])
    await rig.start()
    try:
        remote = await rig.remote()
        x = np.ones((1, 16), np.float32)
        stale = checked_request(await remote.input_check("demo"), x)  # demo takes 16 columns
        assert stale.checked is not None
        assert stale.checked.rows == 1
        # Kept, as a request still in its batcher keeps it: the engine knows it is replaced
        # because it no longer serves, not because it is gone.
        replaced = rig.engine.registry.resolve("demo", None)
        write_model(tmp_path / "models", "demo", mlp_model((8, 64, 10)), version=2)
        await rig.engine.load_model("demo")  # now 8
        with pytest.raises(InvalidInput) as refused:
            await remote.infer(stale)
        with pytest.raises(InvalidInput) as in_process:
            await rig.engine.infer(request(x))
        expected = "input 'x' has shape [1,16]; model 'demo' version 2 expects [-1,8]"
        assert refused.value.message == in_process.value.message == expected
        assert replaced.version == "1"
    finally:
        await rig.close()


async def test_a_check_the_frame_does_not_carry_as_its_types_is_not_trusted(rig: Rig) -> None:
    """A worker's frame is untrusted input: a version id or rows of another type, an id the
    engine never gave, or a version the request does not name, leave the request unchecked
    (the engine checks it, and refuses its [1,15] input 400), never end the connection."""
    own = rig.host.version_id(rig.engine.registry.resolve("demo", None).input_check)
    wrong_rows: list[object] = ["1", 1.0, True, None, [1]]
    wrong_ids: list[object] = ["1", 1.0, True, [own], {"id": own}, own + 1000, -1, None]
    wrong = [(own, rows) for rows in wrong_rows] + [(id_, 1) for id_ in wrong_ids]
    items = []
    for index, (version_id, rows) in enumerate(wrong):
        item = infer_request(index, 64 * index, 64, [["x", "<f4", [1, 15], 0, 60]], {"x": "FP32"})
        item[-2:] = [version_id, rows]
        items.append(item)
    other_version = infer_request(99, 64 * len(wrong), 64, items[0][3], {"x": "FP32"})
    other_version[6], other_version[-2:] = "7", [own, 1]  # model_version: not the one it checked
    reader, writer = await asyncio.open_unix_connection(rig.path)
    answers: dict[int, Any] = {}
    try:
        writer.write(frame(Kind.HELLO, {"worker": 0}))
        writer.write(frame(Kind.INFER, [*items, other_version]))
        frames = FrameBuffer()
        while len(answers) < len(items) + 1:
            data = await asyncio.wait_for(reader.read(1 << 16), 5)
            assert data, "the engine ended the connection"
            answers.update((m["id"], m) for k, m in frames.feed(data) if k is Kind.ERROR)
    finally:
        writer.close()
    expected = "input 'x' has shape [1,15]; model 'demo' version 1 expects [-1,16]"
    for index in range(len(wrong)):
        assert (answers[index]["error"], answers[index]["message"]) == ("InvalidInput", expected)
    assert answers[99]["error"] == "ModelNotFound"
