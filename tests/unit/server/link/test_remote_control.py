"""A worker's calls of the engine besides inference (server/link/remote_control.py), through the rig
of tests/unit/server/link/rig.py: call timeouts, calls that never block the worker, input checks
fetched once and kept per model generation, readiness asked of the engine."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import server.link.remote_control
from engine.demo import mlp_model
from engine.errors import (
    InvalidInput,
    ModelNotFound,
    Overloaded,
)
from server.link.remote import RemoteEngine
from tests.models import write_model
from tests.unit.server.link.rig import Rig, request, until


async def test_a_call_that_timed_out_does_not_answer_the_next_one(
    make_rig: Callable[..., Rig], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine answers a call after the worker gave up on it: that late answer went to the
    worker's next call, and each call after it got the one before's answer, for good."""
    monkeypatch.setattr(server.link.remote_control, "CALL_TIMEOUT_S", 0.2)
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
