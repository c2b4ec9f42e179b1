"""How `sluice serve --workers 2` shares out HTTP connections (server/supervisor.py,
server/workers.py). Keep-alive clients open their connections together and keep them: a worker
that took most of them would leave the other idle, and a second worker would add nothing. Which
worker holds a connection is read from the kernel (each worker process's established sockets on
the HTTP port), after every connection has been answered."""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.servers import ServerProcess

CONNECTIONS = 64
ROUNDS = 8
REQUEST = b"GET /v2/health/ready HTTP/1.1\r\nHost: sluice\r\n\r\n"


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("accept") / "server.log"
    server = ServerProcess("--workers", "2", "--drain-timeout-s", "2", log_path=log, grpc=False)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def server(shared_server: ServerProcess) -> ServerProcess:
    both_serving(shared_server)  # a killed worker's replacement too
    return shared_server


def both_serving(server: ServerProcess) -> None:
    """Wait until each worker has answered a connection: readiness answers 200 once the first
    worker serves, and the second may still be starting (it would take no connection yet)."""
    deadline = time.monotonic() + 30.0
    seen: set[int] = set()
    while len(seen) < 2:
        assert time.monotonic() < deadline, f"only workers {seen} answered"
        sockets = connect_all(server.http_port, 8)
        ours = {sock.getsockname()[1] for sock in sockets}
        for worker in worker_processes(server):
            if any(c.raddr and c.raddr.port in ours for c in worker.net_connections(kind="tcp")):
                seen.add(worker.pid)
        for sock in sockets:
            sock.close()


def worker_processes(server: ServerProcess) -> list[psutil.Process]:
    """The supervisor's children that listen on the HTTP port (the engine process does not)."""
    assert server.process is not None
    found = []
    for child in psutil.Process(server.process.pid).children():
        connections = child.net_connections(kind="tcp")
        if any(c.status == "LISTEN" and c.laddr.port == server.http_port for c in connections):
            found.append(child)
    return found


def connect_all(port: int, count: int) -> list[socket.socket]:
    """Open `count` connections at once and read the answer to a request sent on each."""
    sockets = open_all(port, count)
    read_answers(sockets)
    return sockets


def open_all(port: int, count: int) -> list[socket.socket]:
    """Open `count` connections at once, as wrk or a client pool does (non-blocking connects, all
    started before the first completes; the kernel completes them before any is accepted), and
    send one keep-alive request on each."""
    sockets = []
    with selectors.DefaultSelector() as selector:
        for _ in range(count):
            sock = socket.socket()
            sock.setblocking(False)
            sock.connect_ex(("127.0.0.1", port))
            selector.register(sock, selectors.EVENT_WRITE)
            sockets.append(sock)
        pending = set(sockets)
        deadline = time.monotonic() + 10.0
        while pending:
            assert time.monotonic() < deadline, f"{len(pending)} connections not established"
            for key, _ in selector.select(1.0):
                sock = key.fileobj  # type: ignore[assignment]
                assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0
                selector.unregister(sock)
                pending.discard(sock)
    for sock in sockets:
        sock.settimeout(10.0)
        sock.sendall(REQUEST)
    return sockets


def read_answers(sockets: list[socket.socket]) -> None:
    """Read the 200 answering each request: every connection has been accepted."""
    for sock in sockets:
        sock.sendall(REQUEST)
    for sock in sockets:
        answer = b""
        while b"\r\n\r\n" not in answer:
            chunk = sock.recv(4096)
            assert chunk, f"connection closed after {answer!r}"
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 200"), answer


def held(server: ServerProcess, sockets: list[socket.socket]) -> list[int]:
    """How many of `sockets` each worker holds, polled until every one is found (a worker may
    still be between accepting a connection and the kernel listing it)."""
    ours = {sock.getsockname()[1] for sock in sockets}
    deadline = time.monotonic() + 10.0
    while True:
        counts = []
        for worker in worker_processes(server):
            counts.append(
                sum(
                    1
                    for c in worker.net_connections(kind="tcp")
                    if c.status == "ESTABLISHED"
                    and c.laddr.port == server.http_port
                    and c.raddr
                    and c.raddr.port in ours
                )
            )
        if sum(counts) == len(sockets) or time.monotonic() > deadline:
            return counts
        time.sleep(0.05)


def accept_queue(worker: psutil.Process, port: int) -> int:
    """Connections the kernel has queued, not yet accepted, on `worker`'s listening sockets on
    `port` (/proc/net/tcp shows a listener's accept queue as its rx_queue)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{worker.pid}/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/{worker.pid}/fd/{fd}")
            if link.startswith("socket:["):
                inodes.add(link[len("socket:[") : -1])
    queued = 0
    with open("/proc/net/tcp") as table:
        for line in table.readlines()[1:]:
            fields = line.split()
            local, state, queues, inode = fields[1], fields[3], fields[4], fields[9]
            if state == "0A" and int(local.rsplit(":", 1)[1], 16) == port and inode in inodes:
                queued += int(queues.split(":")[1], 16)
    return queued


def test_a_worker_that_runs_first_takes_only_its_share(server: ServerProcess) -> None:
    """Connections opened while both workers are busy (stopped here), then one worker runs
    before the other: the first takes its share, not the whole queue (with one accept queue for
    both, its event loop accepted until the queue was empty: 64 of 64)."""
    first, second = worker_processes(server)
    for worker in (first, second):
        worker.suspend()
    try:
        sockets = open_all(server.http_port, CONNECTIONS)
        first.resume()
        deadline = time.monotonic() + 10.0
        while accept_queue(first, server.http_port) > 0:  # it has taken all it will take
            assert time.monotonic() < deadline, "the first worker accepted nothing"
            time.sleep(0.01)
    finally:
        for worker in (first, second):
            worker.resume()
    try:
        read_answers(sockets)
        counts = held(server, sockets)
    finally:
        for sock in sockets:
            sock.close()
    assert sum(counts) == CONNECTIONS, counts
    assert min(counts) >= CONNECTIONS // 4, counts


def test_connections_opened_together_spread_over_the_workers(server: ServerProcess) -> None:
    rounds = []
    for _ in range(ROUNDS):  # a race between the workers' event loops would skew some rounds
        sockets = connect_all(server.http_port, CONNECTIONS)
        try:
            rounds.append(held(server, sockets))
        finally:
            for sock in sockets:
                sock.close()
    assert [len(counts) for counts in rounds] == [2] * ROUNDS, rounds
    assert [sum(counts) for counts in rounds] == [CONNECTIONS] * ROUNDS, rounds
    # A fair share each: 16 of 64 (a fair coin per connection misses it once in 16,000 rounds).
    assert [min(counts) >= CONNECTIONS // 4 for counts in rounds] == [True] * ROUNDS, rounds


def test_a_burst_of_connections_is_accepted_at_once(server: ServerProcess) -> None:
    """500 connections opened together are all accepted and answered within seconds."""
    started = time.monotonic()
    sockets = connect_all(server.http_port, 500)
    elapsed = time.monotonic() - started
    try:
        counts = held(server, sockets)
    finally:
        for sock in sockets:
            sock.close()
    assert sum(counts) == 500, counts
    assert min(counts) >= 500 // 4, counts
    assert elapsed < 5.0, elapsed


def test_a_killed_workers_connections_wait_for_its_replacement(server: ServerProcess) -> None:
    """The supervisor keeps the dead worker's listening socket open: connections the kernel
    gives it before the new worker serves are queued there and answered, not reset."""
    (victim, survivor) = worker_processes(server)
    victim.send_signal(signal.SIGKILL)
    victim.wait(10)
    sockets = connect_all(server.http_port, CONNECTIONS)  # every one answered 200
    try:
        counts = held(server, sockets)
    finally:
        for sock in sockets:
            sock.close()
    assert sum(counts) == CONNECTIONS, counts
    assert victim.pid not in {worker.pid for worker in worker_processes(server)}
    assert survivor.pid in {worker.pid for worker in worker_processes(server)}


def test_a_port_another_program_listens_on_fails_the_start(tmp_path: Path) -> None:
    """SO_REUSEPORT would let the workers join a listener of another program of the same user
    and share its connections; the supervisor refuses the port instead."""
    server = ServerProcess("--workers", "2", log_path=tmp_path / "server.log", grpc=False)
    other = socket.socket()
    other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    other.bind(("127.0.0.1", server.http_port))
    other.listen(8)
    try:
        with pytest.raises(RuntimeError, match=f"cannot listen on 127.0.0.1:{server.http_port}"):
            server.start(timeout_s=30.0)
    finally:
        other.close()
        server.stop()
