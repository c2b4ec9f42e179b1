"""How many workers `workers` means (server/supervisor.py), and that nothing listens on the
HTTP port before a worker serves; the processes themselves are tested end to end in
tests/integration/test_workers.py."""

from __future__ import annotations

import os
import signal
import socket
from pathlib import Path

import pytest

from engine.settings import SettingsError, load_settings
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


def test_nothing_listens_on_the_http_port_until_a_worker_serves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The supervisor listened once the engine was ready, before its workers had started: a
    connection made meanwhile was queued unanswered (past 0.5 s when a worker's imports were
    slow), where one process refuses it. Each worker's server listens when it serves."""
    settings = load_settings(
        model_repository=tmp_path, http_port=0, grpc_enabled=False, workers=2,
        worker_arena_bytes=1 << 20,
    )  # fmt: skip
    supervisor = Supervisor(settings)
    started: list[int] = []
    refused: list[bool] = []

    def watch(wake: int) -> int:  # the engine is ready and both workers forked, none serving
        for sock in supervisor.http:
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection(sock.getsockname()[:2], timeout=1).close()
            refused.append(True)
        return 0

    monkeypatch.setattr(supervisor, "_start_engine", lambda wake: True)
    monkeypatch.setattr(supervisor, "_start_worker", started.append)
    monkeypatch.setattr(supervisor, "_watch", watch)
    caught = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD)
    handlers = {sig: signal.getsignal(sig) for sig in caught}  # run() installs its own
    try:
        assert supervisor.run() == 0
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert started == [0, 1]
    assert refused == [True, True]
