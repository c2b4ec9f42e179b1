"""server.server: the process lifecycle around a stub engine that records what it is asked, in
process (tests/integration/ drive the shutdown of real servers with clients on the wire)."""

from __future__ import annotations

import asyncio
import gc
import os
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import pytest

from engine.settings import SettingsError
from server.server import Server, tune_gc
from server.settings import Settings
from tests.unit.server.fake_engine import FakeEngine


class LifecycleEngine(FakeEngine):
    """FakeEngine that records the lifecycle calls a Server makes, in order; `on_start` runs
    inside start() (a start that waits, fails, or stops the server)."""

    def __init__(self, on_start: Callable[[], Any] | None = None) -> None:
        super().__init__()
        self.calls: list[str] = []
        self.on_start = on_start
        self.start_called = asyncio.Event()

    async def start(self) -> None:
        self.calls.append("start")
        self.start_called.set()
        if self.on_start is not None:
            await self.on_start()

    def stop_accepting(self) -> None:
        self.calls.append("stop_accepting")
        self.draining = True

    async def drain(self) -> None:
        self.calls.append("drain")

    async def close(self) -> None:
        self.calls.append("close")


def _server(engine: LifecycleEngine, **settings: Any) -> Server:
    options = Settings(http_port=0, grpc_enabled=False, **settings)
    return Server(options, engine=engine, own_signals=False)


@pytest.fixture
def collector() -> Iterator[None]:
    """tune_gc changes the interpreter's collector: put it back for the tests that follow."""
    thresholds = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)


@pytest.mark.usefixtures("collector")
def test_tune_gc_freezes_what_exists_and_collects_less_often() -> None:
    gc.unfreeze()
    tune_gc()
    assert gc.get_freeze_count() > 0
    assert gc.get_threshold() == (100_000, 50, 1000)


@pytest.mark.usefixtures("collector")
async def test_a_stop_after_the_start_drains_in_order_then_closes() -> None:
    server: Server | None = None

    async def stop() -> None:
        assert server is not None
        server.stop()

    engine = LifecycleEngine(on_start=stop)
    server = _server(engine)
    await asyncio.wait_for(server.serve(), 10)
    assert engine.calls == ["start", "stop_accepting", "drain", "close"]
    assert server.http_port is not None
    assert server.http_port > 0  # port 0 asked: one was chosen and bound
    assert server.http is not None
    assert server.http.should_exit
    assert not server.stopped_loading


async def test_a_stop_while_the_models_load_exits_without_serving() -> None:
    loading = asyncio.Event()  # never set: a load that takes minutes
    cancelled = asyncio.Event()

    async def load() -> None:
        try:
            await loading.wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    engine = LifecycleEngine(on_start=load)
    server = _server(engine)
    serving = asyncio.create_task(server.serve())
    await engine.start_called.wait()
    server.stop()
    # asyncio.wait, not wait_for: a timeout must not cancel serve() and so end the load for it.
    done, _ = await asyncio.wait({serving}, timeout=10)
    if not done:
        serving.cancel()
        pytest.fail("serve() still waits for the models after the stop")
    assert server.stopped_loading
    assert cancelled.is_set()
    assert engine.calls == ["start", "close"]  # nothing was served, so nothing drains
    assert server.http is None
    assert server.http_port is None


async def test_a_failed_start_is_raised_and_the_engine_closed() -> None:
    async def fail() -> None:
        raise RuntimeError("model 'm' failed to load")

    engine = LifecycleEngine(on_start=fail)
    with pytest.raises(RuntimeError, match="model 'm' failed to load"):
        await _server(engine).serve()
    assert engine.calls == ["start", "close"]


async def test_an_unsafe_bind_is_refused_before_any_model_loads() -> None:
    engine = LifecycleEngine()
    with pytest.raises(SettingsError, match=r"refusing to bind 0\.0\.0\.0 with no API keys"):
        await _server(engine, host="0.0.0.0").serve()
    assert engine.calls == []


def test_a_second_stop_exits_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    codes: list[int] = []

    def exit_now(code: int) -> NoReturn:
        codes.append(code)
        raise SystemExit(code)

    monkeypatch.setattr(os, "_exit", exit_now)
    server = Server(Settings(), engine=FakeEngine(), own_signals=False)  # type: ignore[arg-type]
    server.stop()
    assert codes == []
    with pytest.raises(SystemExit):
        server.stop()
    assert codes == [1]
