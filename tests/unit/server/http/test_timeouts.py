"""server/http/timeouts.py on real sockets: a keep-alive request's own read bound, keep-alive's
idle bound, the write timeout (a client reading none of its answers is let go, a slow reader is
not), and a request the server itself holds back is not timed out."""

from __future__ import annotations

import asyncio
import time
from collections import deque

import pytest
from starlette.types import Receive, Scope, Send

from server.http.connection import HttpProtocol
from server.http.connection_policy import REQUEST_TIMEOUT, ConnectionPolicy
from server.http.cycle import WHEN_GONE
from tests.unit.server.http.connections import PADDED, answer_1_kb, serve_one, until


@pytest.mark.parametrize(
    ("header_timeout_s", "body_timeout_s", "second"),
    [
        (0.4, 1.0, b"GET / HTTP/1.1\r\nhost: sl"),  # the head's bound, set after a shorter one
        (3.0, 0.4, b"POST / HTTP/1.1\r\nhost: sluice\r\ncontent-length: 9\r\n\r\nabc"),
    ],
    ids=["head", "body"],
)
async def test_a_keep_alive_request_gets_its_own_read_bound(
    header_timeout_s: float, body_timeout_s: float, second: bytes
) -> None:
    # The first request's bounds are set and cleared; the second request's bound counts from
    # its own first byte (head) or its head (body): not from the first's, and not later.
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"2")]})  # fmt: skip
        await send({"type": "http.response.body", "body": b"ok"})

    policy = ConnectionPolicy(header_timeout_s, body_timeout_s, max_connections=8)
    _, reader, writer = await serve_one(app, policy=policy)
    try:
        first = await asyncio.wait_for(reader.readuntil(b"ok"), 5)
        assert first.startswith(b"HTTP/1.1 200 OK\r\n")
        await asyncio.sleep(0.3)  # past most of the first request's bound
        writer.write(second)
        started = time.monotonic()
        answer = await asyncio.wait_for(reader.read(), 5)  # until the server closes
        elapsed = time.monotonic() - started
        assert answer == REQUEST_TIMEOUT
        assert 0.35 <= elapsed < 0.4 + 0.5, elapsed
    finally:
        writer.close()


async def test_an_idle_keep_alive_connection_closes_a_keep_alive_bound_after_its_last_answer() -> (
    None
):
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"2")]})  # fmt: skip
        await send({"type": "http.response.body", "body": b"ok"})

    request = b"GET / HTTP/1.1\r\nhost: sluice\r\n\r\n"
    _, reader, writer = await serve_one(app, request, keep_alive_s=1)
    try:
        await asyncio.wait_for(reader.readuntil(b"ok"), 5)
        await asyncio.sleep(0.7)  # most of the bound: the next request keeps the connection
        writer.write(request)
        await asyncio.wait_for(reader.readuntil(b"ok"), 5)
        answered = time.monotonic()
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed, with nothing said
        elapsed = time.monotonic() - answered
        assert 0.9 <= elapsed < 1.5, elapsed
    finally:
        writer.close()


async def test_a_client_that_reads_none_of_its_answers_is_closed_after_the_write_timeout() -> None:
    protocols: list[HttpProtocol] = []
    gone = asyncio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        scope["extensions"][WHEN_GONE](gone.set)
        await answer_1_kb(scope, receive, send)

    policy = ConnectionPolicy(
        5, 5, 8, max_pipelined=4, write_buffer_bytes=4096, write_timeout_s=0.5
    )
    requests = b"".join(PADDED % i for i in range(2000))
    _, _, writer = await serve_one(app, requests, policy=policy, protocols=protocols)
    protocol = protocols[0]
    try:
        await until(lambda: protocol.flow.write_paused)
        paused = time.monotonic()
        await until(lambda: protocol not in protocol.connections)  # connection_lost
        elapsed = time.monotonic() - paused
        assert 0.4 <= elapsed < 0.5 + 1.0, elapsed
        assert gone.is_set()  # the request being answered was told its client is gone
        assert protocol.pipeline == deque()  # the queued ones let go
    finally:
        writer.transport.abort()


async def test_a_client_that_reads_slowly_is_not_closed_by_the_write_timeout() -> None:
    # 512 kB at 64 kB per 0.1 s: longer than the timeout in all, never without progress.
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"524288")]})  # fmt: skip
        for _ in range(8):
            await send({"type": "http.response.body", "body": b"x" * 65536, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    policy = ConnectionPolicy(5, 5, 8, write_buffer_bytes=4096, write_timeout_s=0.5)
    _, reader, writer = await serve_one(app, policy=policy)
    try:
        await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        received = 0
        started = time.monotonic()
        while received < 524288:
            received += len(await asyncio.wait_for(reader.read(65536), 5))
            await asyncio.sleep(0.1)  # the slow reader being simulated, not synchronization
        assert time.monotonic() - started > 0.5
    finally:
        writer.close()


async def test_a_request_the_server_holds_back_is_not_timed_out() -> None:
    # Six requests in one read, a bound of one: the server parses a FEED_BYTES part (three and
    # the head of a fourth begun) and holds the rest while /0 takes longer than the header
    # timeout. The client sent everything in time: every request is answered, none gets 408.
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["path"] == "/0":
            await asyncio.sleep(1.0)  # a request slower than the header timeout (the case)
        await answer_1_kb(scope, receive, send)

    policy = ConnectionPolicy(0.3, 0.3, 8, max_pipelined=1)
    requests = b"".join(PADDED % i for i in range(6))
    _, reader, writer = await serve_one(app, requests, policy=policy)
    try:
        for i in range(6):
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert head.startswith(b"HTTP/1.1 200 OK\r\n"), head
            body = await asyncio.wait_for(reader.readexactly(1024), 5)
            assert body.startswith(b"/%d." % i)
    finally:
        writer.close()


async def test_a_connection_closed_with_answers_its_client_never_reads_is_aborted() -> None:
    # `Connection: close` after a 4 MB answer, under the high-water mark (writes never pause):
    # a transport closes only once its buffer is written, which this client never lets happen.
    protocols: list[HttpProtocol] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"4000000")]})  # fmt: skip
        await send({"type": "http.response.body", "body": b"x" * 4_000_000})

    policy = ConnectionPolicy(5, 5, 8, write_buffer_bytes=8 * 2**20, write_timeout_s=0.5)
    request = b"GET / HTTP/1.1\r\nhost: sluice\r\nconnection: close\r\n\r\n"
    _, _, writer = await serve_one(app, request, policy=policy, protocols=protocols)
    protocol = protocols[0]
    try:
        await until(lambda: protocol.transport.is_closing())
        closing = time.monotonic()
        assert not protocol.flow.write_paused
        await until(lambda: protocol not in protocol.connections)
        assert 0.4 <= time.monotonic() - closing < 0.5 + 1.0
    finally:
        writer.transport.abort()
