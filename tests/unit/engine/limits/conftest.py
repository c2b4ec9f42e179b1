from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest


class FakeClock:
    """A clock that moves only when told: `clock()` reads it, `clock.advance(s)` moves it."""

    def __init__(self, start: float) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    """A monotonic-style clock starting at 1000 s."""
    return FakeClock(1000.0)


@pytest.fixture
def wall_clock() -> FakeClock:
    """A Unix clock at 2025-03-15T12:00:00Z."""
    return FakeClock(1_742_040_000.0)


class HoldProxy:
    """A TCP proxy in front of Redis whose replies can be held back, to make Redis slow on
    demand: requests still reach Redis, only the answers wait."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self.reply_held = asyncio.Event()
        self._open = asyncio.Event()
        self._open.set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def hold(self) -> None:
        self.reply_held.clear()
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    async def close(self) -> None:
        assert self._server is not None
        self._server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream_reader, upstream_writer = await asyncio.open_connection(
            "127.0.0.1", self.target_port
        )
        for task in (
            asyncio.create_task(self._pump(reader, upstream_writer, gated=False)),
            asyncio.create_task(self._pump(upstream_reader, writer, gated=True)),
        ):
            self._tasks.add(task)

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, gated: bool
    ) -> None:
        try:
            while data := await reader.read(65536):
                if gated and not self._open.is_set():
                    self.reply_held.set()
                    await self._open.wait()
                writer.write(data)
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()


@pytest.fixture
async def proxy(redis_url: str) -> AsyncIterator[HoldProxy]:
    port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    held = HoldProxy(port)
    await held.start()
    yield held
    held.release()
    await held.close()
