from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import pytest


class HoldingProxy:
    """A TCP proxy in front of Redis that can hold replies (server -> client bytes) at will.

    Requests always pass; `hold()` stops replies until `release()`, so a test can cancel or time
    out a call whose request Redis has already answered (the reply is in flight).
    """

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.connections = 0
        self.request_seen = asyncio.Event()
        self._open = asyncio.Event()
        self._open.set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []
        self._server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        assert self._server is not None
        port = self._server.sockets[0].getsockname()[1]
        return f"redis://127.0.0.1:{port}/0"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)

    def hold(self) -> None:
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    async def close(self) -> None:
        assert self._server is not None
        self._server.close()
        for writer in self._writers:
            writer.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        up_reader, up_writer = await asyncio.open_connection(*self.target)
        self._writers += [writer, up_writer]
        for task in (self._pump(reader, up_writer, request=True),
                     self._pump(up_reader, writer, request=False)):  # fmt: skip
            spawned = asyncio.get_running_loop().create_task(task)
            self._tasks.add(spawned)
            spawned.add_done_callback(self._tasks.discard)

    async def _pump(
        self, source: asyncio.StreamReader, sink: asyncio.StreamWriter, request: bool
    ) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while chunk := await source.read(65536):
                if request:
                    self.request_seen.set()
                else:
                    await self._open.wait()
                sink.write(chunk)
                await sink.drain()
        sink.close()


@pytest.fixture
async def holding_proxy(redis_url: str) -> AsyncIterator[HoldingProxy]:
    """A HoldingProxy to the session's redis-server."""
    target = urlsplit(redis_url)
    proxy = HoldingProxy(target.hostname or "127.0.0.1", target.port or 6379)
    await proxy.start()
    yield proxy
    await proxy.close()
