"""How many workers `workers` means (server/supervisor.py), and when the HTTP port listens; the
processes themselves are tested end to end in tests/integration/test_workers.py."""

from __future__ import annotations

import os
import signal
import socket
from pathlib import Path

import pytest

from engine.settings import SettingsError
from server.settings import load_settings
from server.supervisor import MAX_AUTO_WORKERS, Supervisor, worker_count


def test_a_number_is_taken_as_it_is() -> None:
    assert worker_count(load_settings(workers=3)) == 3


def test_auto_is_one_per_usable_core_at_most_eight() -> None:
    cores = len(os.sched_getaffinity(0))
    assert worker_count(load_settings(workers="auto")) == min(cores, MAX_AUTO_WORKERS)


@pytest.mark.parametrize("bad", [0, 65, "many"])
def test_a_bad_count_is_refused_naming_the_field(bad: object) -> None:
    with pytest.raises(SettingsError, match="workers"):
        load_settings(workers=bad)


def test_the_http_port_listens_once_the_engine_is_ready_before_the_workers_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the engine loads its models a connection is refused, as by one process, not queued
    where nothing accepts it for minutes; once it is ready every slot's socket listens before the
    workers are forked, so the kernel spreads the first connections over all of them (a
    connection queued while its worker starts is answered once it serves)."""
    settings = load_settings(
        model_repository=tmp_path, http_port=0, grpc_enabled=False, workers=2,
        worker_arena_bytes=1 << 20,
    )  # fmt: skip
    supervisor = Supervisor(settings)
    listening: list[tuple[str, list[int]]] = []

    def accepting() -> list[int]:
        return [
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) for sock in supervisor.http
        ]

    def start_engine(wake: int) -> bool:  # the engine loading: nothing may take a connection
        listening.append(("engine loading", accepting()))
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(supervisor.http[0].getsockname()[:2], timeout=1).close()
        return True

    monkeypatch.setattr(supervisor, "_start_engine", start_engine)
    monkeypatch.setattr(
        supervisor, "_start_worker", lambda i: listening.append(("fork", accepting()))
    )
    monkeypatch.setattr(supervisor, "_watch", lambda wake: 0)
    caught = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD)
    handlers = {sig: signal.getsignal(sig) for sig in caught}  # run() installs its own
    try:
        assert supervisor.run() == 0
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert listening == [("engine loading", [0, 0]), ("fork", [1, 1]), ("fork", [1, 1])]
