"""A TCP proxy in front of a real Redis that can hold its replies, to make Redis slow on demand."""

from __future__ import annotations

import asyncio
import contextlib
from urllib.parse import urlsplit


class HoldingProxy:
    """A TCP proxy in front of Redis that can hold replies (server -> client bytes) at will.

    Requests always pass; `hold()` stops replies until `release()`, so a test can cancel or time
    out a call whose request Redis has already answered (the reply is in flight).
    `request_seen` is set when a request reaches Redis, `reply_held` when a reply waits at the
    gate; `hold()` clears both, so after it they tell about the held period only.
    """

    def __init__(self, target_url: str) -> None:
        target = urlsplit(target_url)
        self.target = (target.hostname or "127.0.0.1", target.port or 6379)
        self.port = 0
        self.connections = 0
        self.request_seen = asyncio.Event()
        self.reply_held = asyncio.Event()
        self._open = asyncio.Event()
        self._open.set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._writers: list[asyncio.StreamWriter] = []
        self._server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        """The proxy's own redis:// URL (database 0)."""
        assert self._server is not None, "start() the proxy first"
        return f"redis://127.0.0.1:{self.port}/0"

    async def start(self) -> None:
        """Listen on a free port of 127.0.0.1."""
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    def hold(self) -> None:
        """Stop passing replies from now on (requests still pass)."""
        self.request_seen.clear()
        self.reply_held.clear()
        self._open.clear()

    def release(self) -> None:
        """Pass the held replies and every later one."""
        self._open.set()

    async def close(self) -> None:
        """Stop listening, close every connection and wait for the pumps to end."""
        assert self._server is not None, "start() the proxy first"
        self._server.close()
        for writer in self._writers:
            writer.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:  # Redis is down: the client sees a closed connection, as it would direct
            writer.close()
            return
        self._writers += [writer, up_writer]
        for pump in (self._pump(reader, up_writer, request=True),
                     self._pump(up_reader, writer, request=False)):  # fmt: skip
            task = asyncio.get_running_loop().create_task(pump)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _pump(
        self, source: asyncio.StreamReader, sink: asyncio.StreamWriter, *, request: bool
    ) -> None:
        try:
            with contextlib.suppress(ConnectionError, OSError):
                while chunk := await source.read(65536):
                    if request:
                        self.request_seen.set()
                    elif not self._open.is_set():
                        self.reply_held.set()
                        await self._open.wait()
                    sink.write(chunk)
                    await sink.drain()
        finally:
            sink.close()
