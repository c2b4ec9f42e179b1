"""server/http/connection.py (and the per-request transport it installs, server/http/cycle.py)
on real sockets: the listener hand-over (connections the kernel has queued, requests already
written on them, are taken, not reset by the listener's close), the protocol's writes (a
response's head and body leave together unless the body has to wait), and the client leaving, as
the app is told of it. The deadlines are test_timeouts.py's, the bounds test_pipelining.py's."""

from __future__ import annotations

import asyncio
import gc
import socket
from collections.abc import Iterator

import pytest
from starlette.types import Receive, Scope, Send

from server.http.connection import HttpProtocol, accept_pending
from server.http.cycle import RESPOND, WHEN_GONE
from tests.unit.server.http.connections import serve_one


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    yield sock
    sock.close()


def test_accept_pending_takes_every_queued_connection_with_its_request(
    listener: socket.socket,
) -> None:
    clients = [socket.create_connection(listener.getsockname()) for _ in range(3)]
    for index, client in enumerate(clients):
        client.sendall(f"GET /{index} HTTP/1.1\r\n\r\n".encode())
    taken = accept_pending(listener)
    listener.close()  # nothing is left queued to be reset
    try:
        assert len(taken) == 3
        for sock in taken:
            sock.setblocking(True)
            sock.settimeout(5)
        heads = sorted(sock.recv(64) for sock in taken)
        assert heads == [f"GET /{i} HTTP/1.1\r\n\r\n".encode() for i in range(3)]
    finally:
        for sock in [*taken, *clients]:
            sock.close()


def test_accept_pending_on_an_empty_queue_returns_nothing(listener: socket.socket) -> None:
    assert accept_pending(listener) == []


async def test_a_response_head_and_body_leave_in_one_write() -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        headers = [(b"content-length", b"5")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"hello"})

    recording, reader, writer = await serve_one(app)
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200 OK\r\n")
        assert await asyncio.wait_for(reader.readexactly(5), 5) == b"hello"
        assert recording.writes == [head + b"hello"]  # one send, not one for each part
    finally:
        writer.close()


ANSWER_HEADERS = [(b"content-length", b"5"), (b"x-request-id", b"r-1")]
REQUEST = b"GET / HTTP/1.1\r\nhost: sluice\r\n\r\n"


async def _answer_through_asgi(scope: Scope, receive: Receive, send: Send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": ANSWER_HEADERS})
    await send({"type": "http.response.body", "body": b"hello"})


async def test_respond_sends_what_asgi_sends_in_one_write_and_keeps_the_connection() -> None:
    answered: list[bool] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        answered.append(scope["extensions"][RESPOND](200, ANSWER_HEADERS, b"hello"))

    through_asgi, reader, writer = await serve_one(_answer_through_asgi, REQUEST)
    try:
        expected = await asyncio.wait_for(reader.readuntil(b"hello"), 5)
    finally:
        writer.close()
    recording, reader, writer = await serve_one(app, REQUEST * 2)  # two on one connection
    try:
        for _ in range(2):
            assert await asyncio.wait_for(reader.readuntil(b"hello"), 5) == expected
        assert answered == [True, True]
        assert through_asgi.writes == [expected]
        assert recording.writes == [expected, expected]  # one write for each
    finally:
        writer.close()


async def test_respond_says_connection_close_and_closes_when_the_client_asked_to() -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        assert scope["extensions"][RESPOND](200, ANSWER_HEADERS, b"hello")

    request = b"GET / HTTP/1.1\r\nhost: sluice\r\nconnection: close\r\n\r\n"
    _, reader, writer = await serve_one(app, request)
    try:
        answer = await asyncio.wait_for(reader.read(), 5)  # until the server closes
        head, _, body = answer.partition(b"\r\n\r\n")
        assert b"\r\nconnection: close" in head
        assert body == b"hello"
    finally:
        writer.close()


@pytest.mark.parametrize("case", ["answer begun", "not reading", "control character"])
async def test_respond_declines_or_refuses_and_asgi_answers(case: str) -> None:
    # Declines (False, nothing sent) when an answer has begun or the client is not reading
    # what it was sent (back-pressure: ASGI's send waits for it); refuses a header value with a
    # control character (a header injected into the answer), as ASGI's send does.
    protocols: list[HttpProtocol] = []
    outcome: list[object] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        respond = scope["extensions"][RESPOND]
        if case == "answer begun":
            await send({"type": "http.response.start", "status": 200, "headers": ANSWER_HEADERS})
            outcome.append(respond(200, ANSWER_HEADERS, b"hello"))
            await send({"type": "http.response.body", "body": b"hello"})
            return
        if case == "not reading":
            protocols[0].pause_writing()
            outcome.append(respond(200, ANSWER_HEADERS, b"hello"))
            protocols[0].resume_writing()
        else:
            try:
                respond(200, [*ANSWER_HEADERS, (b"x-name", b"a\r\nset-cookie: x")], b"hello")
            except RuntimeError as exc:
                outcome.append(str(exc))
        await _answer_through_asgi(scope, receive, send)

    _, reader, writer = await serve_one(app, REQUEST, protocols=protocols)
    try:
        answer = await asyncio.wait_for(reader.readuntil(b"hello"), 5)
        assert answer.startswith(b"HTTP/1.1 200 OK\r\n")
        assert b"set-cookie" not in answer
        assert answer.count(b"HTTP/1.1") == 1
        assert outcome == (
            ["Invalid HTTP header value."] if case == "control character" else [False]
        )
    finally:
        writer.close()


async def test_respond_leaves_no_reference_cycle_per_request() -> None:
    # A request's cycle that held its transport, which held the cycle, was freed only by the
    # cyclic collector, which the server runs seldom (server.tune_gc): memory and collection
    # work grew with every request (measured: 3 µs a request more, not less, than ASGI's send).
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        assert scope["extensions"][RESPOND](200, ANSWER_HEADERS, b"hello")

    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what a collection finds unreachable is kept in gc.garbage
    try:
        _, reader, writer = await serve_one(app, REQUEST * 20)
        for _ in range(20):
            await asyncio.wait_for(reader.readuntil(b"hello"), 5)
        gc.collect()
        left = [type(o).__name__ for o in gc.garbage if type(o).__module__.startswith(
            ("uvicorn", "server"))]  # fmt: skip
        writer.close()
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert left == []


async def test_a_streamed_head_is_sent_before_its_body_is_ready() -> None:
    body_ready = asyncio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        headers = [(b"content-length", b"5")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await body_ready.wait()
        await send({"type": "http.response.body", "body": b"later"})

    recording, reader, writer = await serve_one(app)
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)  # the body waits on us
        assert head.startswith(b"HTTP/1.1 200 OK\r\n")
        body_ready.set()
        assert await asyncio.wait_for(reader.readexactly(5), 5) == b"later"
        assert recording.writes == [head, b"later"]
    finally:
        writer.close()


async def test_a_client_that_leaves_before_its_answer_is_reported_to_the_app() -> None:
    registered, told = asyncio.Event(), asyncio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        scope["extensions"][WHEN_GONE](told.set)
        registered.set()
        await asyncio.wait_for(told.wait(), 5)  # the answer waits; the client leaves meanwhile

    _, _, writer = await serve_one(app)
    await asyncio.wait_for(registered.wait(), 5)
    writer.close()
    await asyncio.wait_for(told.wait(), 5)


async def test_a_client_gone_before_the_app_asks_is_reported_at_once() -> None:
    told = asyncio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        message = await receive()  # the request
        while message["type"] != "http.disconnect":  # once the loss of the connection is in
            message = await receive()
        calls: list[str] = []
        scope["extensions"][WHEN_GONE](lambda: calls.append("gone"))
        if calls == ["gone"]:  # at once, not at some later turn
            told.set()

    _, _, writer = await serve_one(app)
    writer.close()
    await asyncio.wait_for(told.wait(), 5)


async def test_a_client_that_leaves_after_a_large_body_is_reported_to_the_app() -> None:
    # 100 kB of body arrive in one read while the app waits in receive(): uvicorn stops reading
    # (over 64 KiB wait for the app), and the app, which then has its whole body, calls
    # receive() no more. The connection must still be read, or its loss is never seen.
    body = b"x" * 100_000
    waiting, told = asyncio.Event(), asyncio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        waiting.set()
        message = await receive()
        assert len(message["body"]) == len(body)  # in one read
        assert not message["more_body"]
        scope["extensions"][WHEN_GONE](told.set)
        await asyncio.wait_for(told.wait(), 5)

    head = b"POST / HTTP/1.1\r\nhost: sluice\r\ncontent-length: %d\r\n\r\n" % len(body)
    _, _, writer = await serve_one(app, head)
    await asyncio.wait_for(waiting.wait(), 5)
    writer.write(body)  # one send: the socket pair's buffer takes it whole
    await writer.drain()
    writer.close()
    await asyncio.wait_for(told.wait(), 5)
