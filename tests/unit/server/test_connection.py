"""server/connection.py's listener hand-over on real loopback sockets: connections the kernel has
queued (requests already written on them) are taken, not reset by the listener's close."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from server.connection import REQUEST_TIMEOUT, TOO_MANY_CONNECTIONS, accept_pending


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
