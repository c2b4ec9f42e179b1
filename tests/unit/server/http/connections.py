"""A real connection for the tests of server/http/connection.py and the modules it is built on
(timeouts.py, pipelining.py): an app behind HttpProtocol on one end of a socket pair."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable, Iterable
from typing import Any

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.server import ServerState

from server.http.connection import HttpProtocol
from server.http.connection_policy import ConnectionPolicy


class Recording:
    """The connection's real transport, with the data of each write and writelines call kept:
    how many sends the protocol asks for."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self.writes: list[bytes] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def write(self, data: bytes) -> None:
        self.writes.append(bytes(data))
        self._transport.write(data)

    def writelines(self, chunks: Iterable[bytes]) -> None:
        chunks = list(chunks)
        self.writes.append(b"".join(chunks))
        self._transport.writelines(chunks)


async def serve_one(
    app: ASGIApp,
    request: bytes = b"GET / HTTP/1.1\r\nhost: sluice\r\n\r\n",
    policy: ConnectionPolicy | None = None,
    keep_alive_s: int = 5,
    protocols: list[HttpProtocol] | None = None,
) -> tuple[Recording, asyncio.StreamReader, asyncio.StreamWriter]:
    """`app` behind server.http.connection.HttpProtocol on one end of a real socket pair; the other
    end as a client's stream, with `request` (or its beginning) already written on it. The
    protocol is appended to `protocols` when given."""
    kept: list[Recording] = []

    class Protocol(HttpProtocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            kept.append(Recording(transport))
            if protocols is not None:
                protocols.append(self)
            super().connection_made(kept[0])  # type: ignore[arg-type]

    config = uvicorn.Config(app, log_level="warning", timeout_keep_alive=keep_alive_s)
    if policy is None:
        policy = ConnectionPolicy(header_timeout_s=5, body_timeout_s=5, max_connections=8)
    ours, theirs = socket.socketpair()
    loop = asyncio.get_running_loop()
    await loop.connect_accepted_socket(
        lambda: Protocol(config=config, server_state=ServerState(), app_state={}, policy=policy),
        ours,
    )
    reader, writer = await asyncio.open_connection(sock=theirs)
    writer.write(request)
    return kept[0], reader, writer


PADDED = b"GET /%d HTTP/1.1\r\nhost: sluice\r\nx-pad: " + b"p" * 1024 + b"\r\n\r\n"
"""A pipelined request of ~1.1 kB: a FEED_BYTES part of a read holds at most 4 of them."""


async def answer_1_kb(scope: Scope, receive: Receive, send: Send) -> None:
    body = scope["path"].encode().ljust(1024, b".")
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", b"1024")]})  # fmt: skip
    await send({"type": "http.response.body", "body": body})


async def until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)
