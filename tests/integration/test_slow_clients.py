"""Slow clients against a real `sluice serve` (loopback only): 48 connections that send their
request head or body a byte a second, or nothing at all, are answered 408 and closed once
http_header_timeout_s / http_body_timeout_s have passed, while a normal client is served
throughout; past http_max_connections a new connection is answered 503 and closed."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import pytest

from tests.servers import ServerProcess

TIMEOUT_S = 2.0
SLACK_S = 2.0  # the timer, then the close reaching the client, on a busy machine
GIVE_UP_S = TIMEOUT_S + 6  # a connection still open by then was never closed by the server
SLOW = 48
HEAD = (
    b"POST /v2/models/demo/infer HTTP/1.1\r\nhost: sluice\r\ncontent-type: application/json\r\n"
    b"content-length: 1000\r\n\r\n"
)
DEMO_BODY = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 16], "data": [0.5] * 16}]}


@dataclass
class Slow:
    kind: str
    open_s: float | None  # from the start of the timed part until the server closed it
    answer: bytes


async def slow_connection(port: int, kind: str) -> Slow:
    """`header`: the head a byte a second; `body`: the whole head, then the body a byte a
    second; `idle`: connect and send nothing."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    drip = {"header": HEAD, "body": b"{" * 1000, "idle": b""}[kind]
    if kind == "body":
        writer.write(HEAD)
    started = time.monotonic()
    answer = asyncio.create_task(reader.read())  # everything until the server closes
    sent = 0
    try:
        while not answer.done() and time.monotonic() - started < GIVE_UP_S:
            if sent < len(drip):
                writer.write(drip[sent : sent + 1])
                sent += 1
            await asyncio.wait({answer}, timeout=1.0)  # a byte a second, or the close
        if not answer.done():
            return Slow(kind, None, b"")
        open_s = time.monotonic() - started
        try:
            return Slow(kind, open_s, answer.result())
        except ConnectionError:
            return Slow(kind, open_s, b"")
    finally:
        answer.cancel()
        writer.close()


async def test_slow_clients_are_closed_in_time_while_others_are_served(
    start_server: Callable[..., ServerProcess],
) -> None:
    env = {
        "SLUICE_HTTP_HEADER_TIMEOUT_S": str(TIMEOUT_S),
        "SLUICE_HTTP_BODY_TIMEOUT_S": str(TIMEOUT_S),
    }
    server = start_server(env={**env, "SLUICE_GRPC_ENABLED": "false"})
    done = asyncio.Event()
    statuses: list[int] = []
    slowest = 0.0

    async def normal_client() -> None:
        nonlocal slowest
        async with httpx.AsyncClient(timeout=5) as client:
            while not done.is_set():
                started = time.monotonic()
                response = await client.post(f"{server.url}/v2/models/demo/infer", json=DEMO_BODY)
                slowest = max(slowest, time.monotonic() - started)
                statuses.append(response.status_code)
                await asyncio.sleep(0.05)  # pacing, not synchronization

    normal = asyncio.create_task(normal_client())
    kinds = ["header", "body", "idle"] * (SLOW // 3)
    slow = await asyncio.gather(*(slow_connection(server.http_port, kind) for kind in kinds))
    done.set()
    await normal

    never = [s.kind for s in slow if s.open_s is None]
    assert never == [], f"{len(never)} slow connections still open after {GIVE_UP_S} s: {never}"
    late = [
        (s.kind, round(s.open_s or 0, 2)) for s in slow if (s.open_s or 0) > TIMEOUT_S + SLACK_S
    ]
    assert late == [], f"closed later than {TIMEOUT_S} + {SLACK_S} s"
    early = [(s.kind, round(s.open_s or 0, 2)) for s in slow if (s.open_s or 0) < TIMEOUT_S - 0.2]
    assert early == [], "closed before the timeout"
    # A byte that crosses the close on the wire makes the kernel reset the connection, which
    # can drop the 408 before the client reads it; one that sent nothing always reads it.
    assert all(s.answer.startswith(b"HTTP/1.1 408 ") for s in slow if s.answer), {
        s.answer[:40] for s in slow
    }
    assert all(s.answer for s in slow if s.kind == "idle"), slow
    assert len(statuses) >= 20, statuses
    assert set(statuses) == {200}, statuses
    assert slowest < 2.0, f"a normal request took {slowest:.2f} s next to the slow clients"


async def test_connections_past_the_limit_get_503_and_are_closed(
    start_server: Callable[..., ServerProcess],
) -> None:
    server = start_server(env={"SLUICE_HTTP_MAX_CONNECTIONS": "8", "SLUICE_GRPC_ENABLED": "false"})
    held = [await asyncio.open_connection("127.0.0.1", server.http_port) for _ in range(8)]
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.http_port)
        answer = await asyncio.wait_for(reader.read(), 5)  # the server closes it
        writer.close()
        assert answer.startswith(b"HTTP/1.1 503 "), answer
        assert b"retry-after: 1" in answer.lower()
    finally:
        for _, held_writer in held:
            held_writer.close()

    async def served() -> bool:
        async with httpx.AsyncClient(timeout=5) as client:
            return (await client.get(f"{server.url}/v2/health/ready")).status_code == 200

    deadline = time.monotonic() + 10
    while not await served():  # the held connections' close reaches the server
        assert time.monotonic() < deadline, "no connection was served after the others closed"
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("name", ["http_header_timeout_s", "http_body_timeout_s"])
async def test_read_timeouts_must_be_positive(name: str) -> None:
    from engine.settings import SettingsError
    from server.settings import load_settings

    with pytest.raises(SettingsError, match=name):
        load_settings(environ={}, **{name: 0})
