"""A client that pipelines requests on one connection and never reads the answers, against a
real `sluice serve` (one process, and `--workers 2`): the server stops reading it with at most
http_max_pipelined_requests queued, and closes it once http_write_timeout_s passes with none of
its answers read. What the server read is counted exactly from the kernel's queues."""

from __future__ import annotations

import asyncio
import json
import select
import socket
import time
from collections.abc import Callable

import httpx
import pytest

from server.http.pipelining import FEED_BYTES
from tests.servers import ServerProcess


def request(index: int) -> bytes:
    """A demo infer request of a fixed size, different for every index (no cache hits), its
    `id` the index."""
    data = ", ".join(["0.5"] * 15 + [f"0.{index:07d}1"])  # written out: a fixed width
    tensor = f'{{"name": "x", "datatype": "FP32", "shape": [1, 16], "data": [{data}]}}'
    body = f'{{"id": "{index:07d}", "inputs": [{tensor}]}}'
    return (
        b"POST /v2/models/demo/infer HTTP/1.1\r\nhost: sluice\r\n"
        b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
        % (len(body), body.encode())
    )


REQUEST_BYTES = len(request(0))
MAX_PIPELINED = 4
WRITE_TIMEOUT_S = 1.5
STALLED_S = 0.5  # no byte taken for this long: the server has stopped reading
SLACK_S = 3.0
READ_BYTES = 256 * 1024  # the most one socket read takes (asyncio and uvloop alike)


def queues(server_port: int, client_port: int) -> tuple[int, int]:
    """(the client end's unsent bytes, the server end's unread bytes) from /proc/net/tcp."""
    found: dict[tuple[int, int], tuple[int, int]] = {}
    with open("/proc/net/tcp") as table:
        for line in table.readlines()[1:]:
            fields = line.split()
            ports = tuple(int(f.rsplit(":", 1)[1], 16) for f in (fields[1], fields[2]))
            tx, rx = (int(q, 16) for q in fields[4].split(":"))
            found[ports] = (tx, rx)  # type: ignore[index]
    return found[(client_port, server_port)][0], found[(server_port, client_port)][1]


def answered(server: ServerProcess) -> int:
    stats = httpx.get(f"{server.url}/v2/models/demo/stats", timeout=5).json()
    return int(stats["model_stats"][0]["inference_stats"]["success"]["count"])


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_client_that_pipelines_and_never_reads_is_bounded_and_closed(
    start_server: Callable[..., ServerProcess], workers: str
) -> None:
    env = {
        "SLUICE_HTTP_MAX_PIPELINED_REQUESTS": str(MAX_PIPELINED),
        "SLUICE_HTTP_WRITE_TIMEOUT_S": str(WRITE_TIMEOUT_S),
        "SLUICE_GRPC_ENABLED": "false",
    }
    server = start_server("--workers", workers, env=env)
    before = answered(server)
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # answers back up at once
    client.connect(("127.0.0.1", server.http_port))
    client.setblocking(False)
    port = client.getsockname()[1]
    pending = memoryview(b"".join(map(request, range(100_000))))  # 27 MB: more than the kernel
    assert len(pending) == 100_000 * REQUEST_BYTES
    sent, measured = 0, False
    moved_at = time.monotonic()
    try:
        while True:
            try:
                sent += client.send(pending[sent : sent + 65536])
                moved_at = time.monotonic()
                assert sent < len(pending), "the server read all the requests"
                continue
            except BlockingIOError:
                pass
            except (ConnectionResetError, BrokenPipeError):
                break  # closed by the server
            stalled_s = time.monotonic() - moved_at
            if stalled_s > STALLED_S and not measured:
                # The server reads nothing more: what its process read is what was sent less
                # what both kernels still hold. That is the answered requests, the one being
                # answered, those queued (the bound, passed by at most one FEED_BYTES part),
                # and what was left of the last read unparsed (one read, 256 KiB at most).
                unsent, unread = queues(server.http_port, port)
                read = sent - unsent - unread
                done = answered(server) - before
                queued = MAX_PIPELINED + FEED_BYTES // REQUEST_BYTES + 1
                held = read - (done + 1 + queued) * REQUEST_BYTES
                assert held <= READ_BYTES, (read, done)
                measured = True
            assert stalled_s < WRITE_TIMEOUT_S + SLACK_S, "not closed after the write timeout"
            select.select([], [client], [], 0.1)
    finally:
        client.close()
    assert measured


async def test_a_pipelining_client_that_reads_gets_every_answer_in_order(
    start_server: Callable[..., ServerProcess],
) -> None:
    env = {"SLUICE_HTTP_MAX_PIPELINED_REQUESTS": "2", "SLUICE_GRPC_ENABLED": "false"}
    server = start_server(env=env)
    reader, writer = await asyncio.open_connection("127.0.0.1", server.http_port)
    try:
        writer.write(b"".join(map(request, range(500))))  # all at once; sent as the server reads
        for index in range(500):
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            assert head.startswith(b"HTTP/1.1 200 "), head
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            answer = json.loads(await asyncio.wait_for(reader.readexactly(length), 10))
            assert answer.get("id") == f"{index:07d}", (index, answer)
    finally:
        writer.close()
