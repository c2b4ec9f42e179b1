"""server/slot_sockets.py: one HTTP socket per worker slot on one port, not listening until the
supervisor says so, and ports taken by another program refused at the start, naming them."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from engine.settings import SettingsError
from server.slot_sockets import listen_http, reserve_grpc


@pytest.fixture
def taken() -> Iterator[int]:
    """A port another program listens on (without SO_REUSEPORT)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    yield sock.getsockname()[1]
    sock.close()


def test_every_slot_gets_a_socket_on_the_one_port_not_listening_yet() -> None:
    sockets = listen_http("127.0.0.1", 0, 3)
    try:
        ports = {sock.getsockname()[1] for sock in sockets}
        assert len(sockets) == 3
        assert len(ports) == 1
        assert 0 not in ports
        for sock in sockets:
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT) == 1
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 0
            assert sock.get_inheritable()  # each worker inherits its slot's
    finally:
        for sock in sockets:
            sock.close()


def test_an_http_port_another_program_listens_on_is_refused(taken: int) -> None:
    with pytest.raises(SettingsError, match=f"cannot listen on 127.0.0.1:{taken}: "):
        listen_http("127.0.0.1", taken, 2)


def test_the_grpc_port_is_reserved_and_a_taken_one_refused(taken: int) -> None:
    reserved = reserve_grpc("127.0.0.1", 0)
    try:
        assert reserved.getsockname()[1] != 0
        assert reserved.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT) == 1
    finally:
        reserved.close()
    with pytest.raises(SettingsError, match=f"cannot listen on 127.0.0.1:{taken} for gRPC: "):
        reserve_grpc("127.0.0.1", taken)
