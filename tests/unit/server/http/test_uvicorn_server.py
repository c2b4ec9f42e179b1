"""server.http.uvicorn_server: the metrics port's server, which the one-process server and the
engine process under --workers both start."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from engine.settings import SettingsError
from server.bind import listen_socket
from server.http.uvicorn_server import MetricsServer
from server.settings import Settings
from tests.redis_process import free_port


async def exposition(scope: dict[str, Any], receive: Any, send: Any) -> None:
    body = f"sluice_up 1 # {scope['path']}\n".encode()
    length = [(b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": length})
    await send({"type": "http.response.body", "body": body})


async def get(port: int, path: str) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    answer = await reader.read()  # to the end: the server closes the connection
    writer.close()
    return answer


async def test_the_metrics_server_serves_its_app_on_the_metrics_port_until_stopped() -> None:
    port = free_port()
    server = MetricsServer.start(Settings(metrics={"port": port}), exposition)
    try:
        while not server.server.started:  # uvicorn listens once its start-up has run
            assert not server.task.done()
            await asyncio.sleep(0.005)
        answer = await get(port, "/metrics")
    finally:
        await server.stop()
    assert answer.startswith(b"HTTP/1.1 200 ")
    assert answer.endswith(b"\r\n\r\nsluice_up 1 # /metrics\n")
    assert server.task.done()
    with pytest.raises(ConnectionRefusedError):
        await asyncio.open_connection("127.0.0.1", port)


async def test_a_taken_metrics_port_fails_the_start() -> None:
    port = free_port()
    with listen_socket("127.0.0.1", port) as taken:
        taken.listen()
        with pytest.raises(SettingsError, match=f"cannot listen on 127.0.0.1:{port}: "):
            MetricsServer.start(Settings(metrics={"port": port}), exposition)
