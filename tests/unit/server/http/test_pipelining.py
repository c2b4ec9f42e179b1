"""server/http/pipelining.py on real sockets: a client that pipelines without reading is not read
past the bound, and one that reads gets every answer, in order."""

from __future__ import annotations

import asyncio

from starlette.types import Receive, Scope, Send

from server.http.connection import HttpProtocol
from server.http.connection_policy import ConnectionPolicy
from server.http.pipelining import FEED_BYTES
from tests.unit.server.http.connections import PADDED, answer_1_kb, serve_one, until


async def test_a_client_that_pipelines_and_never_reads_is_not_read_past_the_bound() -> None:
    # 2000 requests (2.2 MB) written at once, no answer read: the answers fill the socket, and
    # the server must stop reading with at most max_pipelined (+ one FEED_BYTES part) queued.
    # uvicorn resumed reading at every answer and read them all into its pipeline.
    protocols: list[HttpProtocol] = []
    policy = ConnectionPolicy(5, 5, 8, max_pipelined=4, write_buffer_bytes=8192)
    requests = b"".join(PADDED % i for i in range(2000))
    _, _, writer = await serve_one(answer_1_kb, requests, policy=policy, protocols=protocols)
    protocol = protocols[0]
    try:
        await until(lambda: protocol.flow.write_paused)  # the client reads nothing
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
    _, reader, writer = await serve_one(echo, requests, policy=policy)
    try:
        for i, body in enumerate(bodies):
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            assert await asyncio.wait_for(reader.readexactly(length), 5) == b"/%d:%s" % (i, body)
    finally:
        writer.close()
