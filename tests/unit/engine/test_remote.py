"""A worker's RemoteEngine against an EngineHost in front of a real Engine (engine/remote.py,
engine/host.py), in one process: each side maps the arenas through its own file descriptor, as
the worker and engine processes do."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import engine.host_peer
import engine.remote_control
import engine.wire
from engine.demo import mlp_model, write_demo_repository
from engine.engine import Engine
from engine.errors import (
    BackendError,
    InvalidInput,
    ModelNotFound,
    Overloaded,
    PayloadTooLarge,
    RateLimited,
    ShuttingDown,
)
from engine.generation.service import GenerateRequest
from engine.host import EngineHost
from engine.remote import RemoteEngine
from engine.remote_channel import FREE_DELAY_S
from engine.settings import Settings, load_settings
from engine.shm import WRITE_OFF_LOOP_BYTES, Arena
from engine.tracing import request_id
from engine.types import InferRequest, InferResponse
from engine.wire import MAX_FRAME_BYTES, FrameBuffer, Kind, frame
from tests.models import write_model, write_sleeping_model


def request(x: np.ndarray, model: str = "demo") -> InferRequest:
    return InferRequest(model, {"x": x}, {"x": "FP32"})


def infer_request(
    call_id: int, slot: int, size: int, described: list[Any], datatypes: dict[str, str]
) -> list[Any]:
    """A request for the demo model as an INFER frame carries it (engine/wire.py INFER_ITEMS),
    as a worker sends it with nothing optional set."""
    unset = [None, None, None, {}, None, None, None, None, None, None]  # model_version .. trace
    return [call_id, slot, size, described, "demo", datatypes, *unset]


async def until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Poll `condition` until it holds, failing after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


class Rig:
    """One engine, its host, and worker arenas (one pair per worker slot)."""

    def __init__(self, settings: Settings, socket_path: str, workers: int, arena_bytes: int):
        self.settings = settings
        self.path = socket_path
        self.engine = Engine(settings)
        self.worker_arenas = [(Arena(arena_bytes), Arena(arena_bytes)) for _ in range(workers)]
        engine_side = [(Arena(arena_bytes, os.dup(i.fd)), Arena(arena_bytes, os.dup(o.fd)))
                       for i, o in self.worker_arenas]  # fmt: skip
        self.host = EngineHost(self.engine, engine_side)
        self.remotes: list[RemoteEngine] = []

    async def start(self) -> None:
        await self.engine.start()
        await self.host.serve(self.path)

    async def remote(self, index: int = 0) -> RemoteEngine:
        remote = RemoteEngine(self.settings, self.path, index, self.worker_arenas[index])
        await remote.start()
        self.remotes.append(remote)
        return remote

    async def close(self) -> None:
        for remote in self.remotes:
            await remote.close()
        await self.host.close()
        await self.engine.close()


@pytest.fixture
def socket_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="sluice-t", dir="/tmp")  # unix socket paths are short
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def make_rig(tmp_path: Path, socket_dir: str) -> Callable[..., Rig]:
    repo = write_demo_repository(tmp_path / "models")

    def make(workers: int = 1, arena_bytes: int = 1 << 20, **overrides: object) -> Rig:
        settings = load_settings(model_repository=repo, **overrides)
        return Rig(settings, os.path.join(socket_dir, "engine.sock"), workers, arena_bytes)

    return make


@pytest.fixture
async def rig(make_rig: Callable[..., Rig]) -> AsyncIterator[Rig]:
    rig = make_rig()
    await rig.start()
    yield rig
    await rig.close()


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
    # INFER and RESULT frames are lists read by position (engine/wire.py): each field must land
    # where the other side reads it, and a value of the wrong type for a field is no time.
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


async def test_front_end_counts_of_every_worker_are_in_the_metrics(
    make_rig: Callable[..., Rig],
) -> None:
    rig = make_rig(workers=2)
    await rig.start()
    try:
        first, second = await rig.remote(0), await rig.remote(1)
        first.metrics.request("demo", "1", "http", 200, 0.01)
        second.metrics.request("demo", "1", "grpc", 200, 0.01)
        second.flush_events()
        await asyncio.sleep(0)  # the engine reads the frame (it runs in this loop)
        # first's count is still pending here: it goes just before the call, on its connection.
        text = (await first.metrics.exposition()).decode()
        assert 'protocol="http",status="200",version="1"} 1.0' in text
        assert 'protocol="grpc",status="200",version="1"} 1.0' in text
        stats = await first.statistics("demo")
        assert stats["model_stats"][0]["name"] == "demo"
    finally:
        await rig.close()


async def test_a_call_that_timed_out_does_not_answer_the_next_one(
    make_rig: Callable[..., Rig], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine answers a call after the worker gave up on it: that late answer went to the
    worker's next call, and each call after it got the one before's answer, for good."""
    monkeypatch.setattr(engine.remote_control, "CALL_TIMEOUT_S", 0.2)
    rig = make_rig()
    await rig.start()
    try:
        remote = await rig.remote()
        gate, answer = asyncio.Event(), rig.host._method

        async def slow_metadata(method: str, args: list[Any]) -> Any:
            if method == "model_metadata":
                # It answers late, whatever the worker's CANCEL says.
                with contextlib.suppress(asyncio.CancelledError):
                    await gate.wait()
            return await answer(method, args)

        monkeypatch.setattr(rig.host, "_method", slow_metadata)
        with pytest.raises(Overloaded, match=r"did not answer 'model_metadata' within 0.2 s"):
            await remote.model_metadata("demo")
        gate.set()
        stats = await remote.statistics("demo")
        assert stats["model_stats"][0]["name"] == "demo"
        assert (await remote.model_metadata("demo")).name == "demo"
    finally:
        await rig.close()


async def test_the_worker_serves_on_while_a_call_waits_for_the_engine(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Metadata, config, statistics, the index and the metrics were blocking calls: while the
    engine took its time, nothing else of the worker ran (here, where the engine shares the
    loop, it could never answer at all)."""
    held, asked, answer = asyncio.Event(), asyncio.Event(), rig.host._method

    async def slow_statistics(method: str, args: list[Any]) -> Any:
        if method == "statistics":
            asked.set()
            await held.wait()
        return await answer(method, args)

    monkeypatch.setattr(rig.host, "_method", slow_statistics)
    remote = await rig.remote()
    stats = asyncio.create_task(remote.statistics("demo"))
    await asyncio.wait_for(asked.wait(), 5)
    x = np.ones((2, 16), np.float32)
    answered = await asyncio.wait_for(remote.infer(request(x)), 5)  # its input check a call too
    assert answered.outputs["probabilities"].shape == (2, 10)
    assert (await remote.model_metadata("demo")).name == "demo"
    assert not stats.done()
    held.set()
    assert (await asyncio.wait_for(stats, 5))["model_stats"][0]["name"] == "demo"


async def test_input_check_misses_together_ask_the_engine_once(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A burst of a model's first requests asks for its input check once; a caller that leaves
    meanwhile (its client went away) fails none of the others; what is fetched is then at hand
    without awaiting, where inference looks first."""
    asked: list[list[Any]] = []
    held, answer = asyncio.Event(), rig.host._method

    async def counted(method: str, args: list[Any]) -> Any:
        if method == "input_spec":
            asked.append(args)
            await held.wait()
        return await answer(method, args)

    monkeypatch.setattr(rig.host, "_method", counted)
    remote = await rig.remote()
    assert remote.cached_input_check("demo") is None
    waiting = [asyncio.create_task(remote.input_check("demo")) for _ in range(5)]
    await until(lambda: len(asked) == 1)
    waiting[0].cancel()
    held.set()
    checks = await asyncio.wait_for(asyncio.gather(*waiting[1:]), 5)
    with pytest.raises(asyncio.CancelledError):
        await waiting[0]
    assert asked == [["demo", None]]
    assert all(check is checks[0] for check in checks)
    assert remote.cached_input_check("demo") is checks[0]
    assert checks[0]({"x": [3, 16]}, {"x": "FP32"}) == 3
    with pytest.raises(InvalidInput, match="x"):
        checks[0]({"x": [3, 15]}, {"x": "FP32"})
    # A refusal is not kept: each miss of an unknown model asks again.
    for _ in range(2):
        with pytest.raises(ModelNotFound, match="nope"):
            await remote.input_check("nope")
    assert asked == [["demo", None], ["nope", None], ["nope", None]]


class HeldProxy:
    """A unix socket between a worker and the engine host whose engine-to-worker bytes can be
    held and then delivered in one write, as a worker whose loop was busy reads them."""

    def __init__(self, target: str, path: str) -> None:
        self.target, self.path = target, path
        self.held: bytearray | None = None
        self.arrived = asyncio.Event()
        self._to_worker: asyncio.StreamWriter | None = None
        self._server: asyncio.Server | None = None
        self._piping: asyncio.Future[Any] | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._connected, self.path)

    async def _connected(
        self, worker_r: asyncio.StreamReader, worker_w: asyncio.StreamWriter
    ) -> None:
        engine_r, engine_w = await asyncio.open_unix_connection(self.target)
        self._to_worker = worker_w
        self._piping = asyncio.gather(
            self._pipe(worker_r, engine_w, False), self._pipe(engine_r, worker_w, True)
        )
        await self._piping

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, held: bool
    ) -> None:
        while data := await reader.read(1 << 16):
            if held and self.held is not None:
                self.held += data
                self.arrived.set()
            else:
                writer.write(data)
        writer.close()

    def release(self) -> None:
        assert self._to_worker is not None
        assert self.held is not None
        self._to_worker.write(bytes(self.held))
        self.held = None

    async def close(self) -> None:
        """After both ends have closed: the pipes have ended or end now."""
        assert self._server is not None
        self._server.close()
        if self._piping is not None:
            await asyncio.wait_for(self._piping, 5)


async def test_an_input_check_answered_before_a_reload_is_not_kept_for_the_new_model(
    make_rig: Callable[..., Rig], tmp_path: Path, socket_dir: str
) -> None:
    """The worker kept a fetched check under the model generation it knew when the answer was
    read, not the one the engine answered in: an answer and the state push of a reload that
    arrived together (the worker busy meanwhile) left the old model's check in force for the
    new one, and the worker refused the new model's inputs 400 until the next reload."""
    rig = make_rig(workers=2, model_control_mode="explicit", load_models=["demo"])
    await rig.start()
    proxy = HeldProxy(rig.path, os.path.join(socket_dir, "proxy.sock"))
    await proxy.start()
    try:
        remote = RemoteEngine(rig.settings, proxy.path, 0, rig.worker_arenas[0])
        await remote.start()
        rig.remotes.append(remote)
        other = await rig.remote(1)
        proxy.held = bytearray()
        fetch = asyncio.create_task(remote.input_check("demo"))
        await asyncio.wait_for(proxy.arrived.wait(), 5)  # the answer: demo takes 16 columns
        proxy.arrived.clear()
        write_model(tmp_path / "models", "demo", mlp_model((8, 64, 10)), version=2)
        await other.load_model("demo")  # now demo takes 8; the push to worker 0 is held too
        await asyncio.wait_for(proxy.arrived.wait(), 5)
        proxy.release()  # both frames reach the worker together
        await asyncio.wait_for(fetch, 5)
        check = await asyncio.wait_for(remote.input_check("demo"), 5)
        assert check({"x": [1, 8]}, {"x": "FP32"}) == 1
        with pytest.raises(InvalidInput, match="x"):
            check({"x": [1, 16]}, {"x": "FP32"})
    finally:
        await rig.close()
        await proxy.close()


async def test_readiness_is_asked_of_the_engine_not_read_from_its_last_push(rig: Rig) -> None:
    """A worker answered readiness from the state the engine pushes every STATE_INTERVAL_S (later
    while a load keeps it busy): 200 after the engine had turned unready, where one process
    answers 503 at once."""
    remote = await rig.remote()
    assert await remote.ready_now() is True
    rig.engine.stop_accepting()  # unready from now on, as a load of a model asked for makes it
    assert await remote.ready_now() is False  # with no push in between


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


async def test_freed_answer_slots_ride_on_the_next_request_or_go_within_a_bound(rig: Rig) -> None:
    # A frame carrying only frees woke the engine process for nothing else: 43% of its reads
    # under HTTP load were such frames.
    remote = await rig.remote()
    assert remote._transport is not None
    writes: list[bytes] = []
    write = remote._transport.write
    remote._transport.write = lambda data: (writes.append(bytes(data)), write(data))[1]  # type: ignore[method-assign]
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
    # An INFER frame is a list of requests, each a list of INFER_ITEMS (engine/wire.py);
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


async def test_a_call_cancelled_past_its_deadline_frees_its_slot_without_the_collector(
    tmp_path: Path, socket_dir: str
) -> None:
    """A gRPC call whose deadline passed while its batch ran: the engine's timeout fired, then
    the worker's CANCEL cancelled the engine's task inside that TimeoutError's handler. The
    task's CancelledError then led, through asyncio.timeout's frame, back to the task: a cycle
    holding the request's inputs, which the engine process collects seldom (tune_gc). Each such
    call kept its in-arena slot until the arena was full and the worker answered only 503."""
    write_sleeping_model(tmp_path / "models")
    settings = load_settings(model_repository=tmp_path / "models", allow_python_models=True)
    rig = Rig(settings, os.path.join(socket_dir, "engine.sock"), 1, 1 << 20)
    await rig.start()
    gc.disable()  # as rarely as the engine process collects: not within this test
    try:
        remote = await rig.remote()
        x = np.ones((2, 4), np.float32)
        late = InferRequest("slow", {"x": x}, {"x": "FP32"}, timeout_s=0.1)
        call = asyncio.create_task(remote.infer(late))
        await asyncio.sleep(0.2)  # its deadline has passed; its batch runs until 0.4 s
        call.cancel()  # the gRPC deadline: the worker's handler is cancelled
        with pytest.raises(asyncio.CancelledError):
            await call
        await until(lambda: not rig.host.workers[0].held_in, timeout_s=2.0)
        await until(lambda: remote.allocator.used_bytes == 0)
    finally:
        gc.enable()
        await rig.close()


async def test_an_answer_past_the_frame_limit_fails_its_call_not_the_connection(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The worker takes a frame past MAX_FRAME_BYTES for a broken peer and ends the connection
    # every request of the worker shares (a model's config can be that large: it came in a load).
    remote = await rig.remote()
    # A config is more than this, a result less; the worker's limit as the engine's.
    monkeypatch.setattr(engine.wire, "MAX_FRAME_BYTES", 600)
    monkeypatch.setattr(engine.host_peer, "MAX_FRAME_BYTES", 600, raising=False)
    with pytest.raises(BackendError, match=r"answer takes \d+ bytes, more than the 600 bytes"):
        await remote.model_config("demo")
    x = np.ones((1, 16), np.float32)
    answer = await remote.infer(request(x))  # the connection serves on
    assert answer.outputs["probabilities"].shape == (1, 10)
    assert remote.live


async def test_an_answer_past_the_frame_limit_gives_its_slot_back(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The engine refuses to send an answer the worker would take for a broken peer, and sends
    # an error instead: the out-slot its outputs were written to stayed taken, the worker never
    # told of it, until the worker's connection ended.
    remote = await rig.remote()
    monkeypatch.setattr(engine.host_peer, "MAX_FRAME_BYTES", 60)  # an answer takes ~100 bytes
    x = np.ones((1, 16), np.float32)
    with pytest.raises(BackendError, match=r"answer takes \d+ bytes, more than the 60 bytes"):
        await remote.infer(request(x))
    assert rig.host.workers[0].out_allocator.used_bytes == 0
    assert not rig.host.workers[0].peer.out_slots  # type: ignore[union-attr]
    monkeypatch.undo()
    answer = await remote.infer(request(x))  # the connection serves on
    assert answer.outputs["probabilities"].shape == (1, 10)


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
