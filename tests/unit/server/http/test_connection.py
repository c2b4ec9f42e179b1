"""server/http/connection.py (and the per-request transport it installs, server/http/cycle.py)
on real sockets: the listener hand-over (connections the kernel has queued, requests already
written on them, are taken, not reset by the listener's close), the protocol's writes (a
response's head and body leave together unless the body has to wait), the client leaving, as
the app is told of it, and the bounds on what one connection can make the server hold."""

from __future__ import annotations

import asyncio
import gc
import socket
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import pytest
import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.server import ServerState

from server.http.connection import (
    FEED_BYTES,
    REQUEST_TIMEOUT,
    RESPOND,
    TOO_MANY_CONNECTIONS,
    WHEN_GONE,
    ConnectionPolicy,
    HttpProtocol,
    accept_pending,
)


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


@pytest.mark.parametrize(
    ("answer", "status"), [(REQUEST_TIMEOUT, b"408"), (TOO_MANY_CONNECTIONS, b"503")]
)
def test_canned_answers_are_complete_http_responses(answer: bytes, status: bytes) -> None:
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0].startswith(b"HTTP/1.1 " + status + b" ")
    fields = dict(line.split(b": ", 1) for line in lines[1:])
    assert fields[b"connection"] == b"close"
    assert int(fields[b"content-length"]) == len(body)
    assert body.startswith(b'{"error":"')


class _Recording:
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


async def _serve_one(
    app: ASGIApp,
    request: bytes = b"GET / HTTP/1.1\r\nhost: sluice\r\n\r\n",
    policy: ConnectionPolicy | None = None,
    keep_alive_s: int = 5,
    protocols: list[HttpProtocol] | None = None,
) -> tuple[_Recording, asyncio.StreamReader, asyncio.StreamWriter]:
    """`app` behind server.http.connection.HttpProtocol on one end of a real socket pair; the other
    end as a client's stream, with `request` (or its beginning) already written on it. The
    protocol is appended to `protocols` when given."""
    kept: list[_Recording] = []

    class Protocol(HttpProtocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            kept.append(_Recording(transport))
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


async def test_a_response_head_and_body_leave_in_one_write() -> None:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        headers = [(b"content-length", b"5")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"hello"})

    recording, reader, writer = await _serve_one(app)
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

    through_asgi, reader, writer = await _serve_one(_answer_through_asgi, REQUEST)
    try:
        expected = await asyncio.wait_for(reader.readuntil(b"hello"), 5)
    finally:
        writer.close()
    recording, reader, writer = await _serve_one(app, REQUEST * 2)  # two on one connection
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
    _, reader, writer = await _serve_one(app, request)
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

    _, reader, writer = await _serve_one(app, REQUEST, protocols=protocols)
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
        _, reader, writer = await _serve_one(app, REQUEST * 20)
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

    recording, reader, writer = await _serve_one(app)
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

    _, _, writer = await _serve_one(app)
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

    _, _, writer = await _serve_one(app)
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
    _, _, writer = await _serve_one(app, head)
    await asyncio.wait_for(waiting.wait(), 5)
    writer.write(body)  # one send: the socket pair's buffer takes it whole
    await writer.drain()
    writer.close()
    await asyncio.wait_for(told.wait(), 5)


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
    _, reader, writer = await _serve_one(app, policy=policy)
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
    _, reader, writer = await _serve_one(app, request, keep_alive_s=1)
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


# -- bounded memory per connection ----------------------------------------------------------------

PADDED = b"GET /%d HTTP/1.1\r\nhost: sluice\r\nx-pad: " + b"p" * 1024 + b"\r\n\r\n"
"""A pipelined request of ~1.1 kB: a FEED_BYTES part of a read holds at most 4 of them."""


async def _answer_1_kb(scope: Scope, receive: Receive, send: Send) -> None:
    body = scope["path"].encode().ljust(1024, b".")
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", b"1024")]})  # fmt: skip
    await send({"type": "http.response.body", "body": body})


async def _until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def test_a_client_that_pipelines_and_never_reads_is_not_read_past_the_bound() -> None:
    # 2000 requests (2.2 MB) written at once, no answer read: the answers fill the socket, and
    # the server must stop reading with at most max_pipelined (+ one FEED_BYTES part) queued.
    # uvicorn resumed reading at every answer and read them all into its pipeline.
    protocols: list[HttpProtocol] = []
    policy = ConnectionPolicy(5, 5, 8, max_pipelined=4, write_buffer_bytes=8192)
    requests = b"".join(PADDED % i for i in range(2000))
    _, _, writer = await _serve_one(_answer_1_kb, requests, policy=policy, protocols=protocols)
    protocol = protocols[0]
    try:
        await _until(lambda: protocol.flow.write_paused)  # the client reads nothing
        queued = len(protocol.pipeline)
        assert queued <= 4 + FEED_BYTES // len(PADDED % 0), queued
        assert not protocol.transport.is_reading()  # type: ignore[attr-defined]
        assert writer.transport.get_write_buffer_size() > 1_000_000  # the client is held back
    finally:
        writer.transport.abort()  # close() would wait to send what the server does not read


async def test_a_pipelining_client_that_reads_gets_every_answer_in_order() -> None:
    # Far more requests than the bound, some with bodies past FEED_BYTES: reading is held and
    # resumed many times, every answer comes, in order, each with its own body.
    sizes = [300_000 if i % 50 == 7 else i * 997 % 20_000 for i in range(300)]  # some > 64 KiB
    bodies = [bytes([65 + i % 26]) * size for i, size in enumerate(sizes)]

    async def echo(scope: Scope, receive: Receive, send: Send) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        answer = scope["path"].encode() + b":" + body
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(answer)).encode())]})  # fmt: skip
        await send({"type": "http.response.body", "body": answer})

    requests = b"".join(
        b"POST /%d HTTP/1.1\r\nhost: sluice\r\ncontent-length: %d\r\n\r\n%s" % (i, len(b), b)
        for i, b in enumerate(bodies)
    )
    policy = ConnectionPolicy(5, 5, 8, max_pipelined=2, write_buffer_bytes=4096)
    _, reader, writer = await _serve_one(echo, requests, policy=policy)
    try:
        for i, body in enumerate(bodies):
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            assert await asyncio.wait_for(reader.readexactly(length), 5) == b"/%d:%s" % (i, body)
    finally:
        writer.close()


async def test_a_client_that_reads_none_of_its_answers_is_closed_after_the_write_timeout() -> None:
    protocols: list[HttpProtocol] = []
    gone = asyncio.Event()

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        scope["extensions"][WHEN_GONE](gone.set)
        await _answer_1_kb(scope, receive, send)

    policy = ConnectionPolicy(
        5, 5, 8, max_pipelined=4, write_buffer_bytes=4096, write_timeout_s=0.5
    )
    requests = b"".join(PADDED % i for i in range(2000))
    _, _, writer = await _serve_one(app, requests, policy=policy, protocols=protocols)
    protocol = protocols[0]
    try:
        await _until(lambda: protocol.flow.write_paused)
        paused = time.monotonic()
        await _until(lambda: protocol not in protocol.connections)  # connection_lost
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
    _, reader, writer = await _serve_one(app, policy=policy)
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
        await _answer_1_kb(scope, receive, send)

    policy = ConnectionPolicy(0.3, 0.3, 8, max_pipelined=1)
    requests = b"".join(PADDED % i for i in range(6))
    _, reader, writer = await _serve_one(app, requests, policy=policy)
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
    _, _, writer = await _serve_one(app, request, policy=policy, protocols=protocols)
    protocol = protocols[0]
    try:
        await _until(lambda: protocol.transport.is_closing())
        closing = time.monotonic()
        assert not protocol.flow.write_paused
        await _until(lambda: protocol not in protocol.connections)
        assert 0.4 <= time.monotonic() - closing < 0.5 + 1.0
    finally:
        writer.transport.abort()
