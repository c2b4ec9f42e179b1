"""The supervisor's ports under `--workers N` (server/supervisor.py): one HTTP listening socket
per worker slot, all bound to the HTTP port with SO_REUSEPORT (each worker inherits its slot's),
and the gRPC port reserved (every worker binds it again with SO_REUSEPORT).

The kernel gives each new HTTP connection to one of the slots' sockets by a hash of its
addresses, so connections opened together spread evenly whichever worker runs first. (One
socket shared by all the workers had let the first worker woken take nearly all of them: its
event loop accepts until the queue is empty, and 32 keep-alive connections of wrk left the
other worker idle.) Each socket wakes only its own worker."""

from __future__ import annotations

import socket

from engine.settings import SettingsError
from server.bind import listen_socket


def listen_http(host: str, port: int, count: int) -> list[socket.socket]:
    """`count` sockets bound to the HTTP port (port 0: the one the probe got), not listening
    yet. The port is first bound without SO_REUSEPORT, so that a port another program (or
    another sluice) listens on fails the start here rather than being shared with it."""
    probe = listen_socket(host, port)
    port = probe.getsockname()[1]
    probe.close()
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):  # listening once the engine serves (Supervisor.run)
            sockets.append(listen_socket(host, port, reuse_port=True))
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def reserve_grpc(host: str, port: int) -> socket.socket:
    """Bind (not listen) the gRPC port with SO_REUSEPORT: port 0 picks one for every worker,
    and a port taken by another program fails the start here, once."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise SettingsError(f"cannot listen on {host}:{port} for gRPC: {exc.strerror}") from exc
    return sock
