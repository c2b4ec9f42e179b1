from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.servers import ServerProcess


@pytest.fixture(scope="session")
def demo_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """`sluice serve` with no repository: the built-in demo model, HTTP and gRPC. One for the
    session: its tests read it, or count its traffic as deltas of its metrics."""
    log = tmp_path_factory.mktemp("demo-server") / "server.log"
    server = ServerProcess(log_path=log).start()
    yield server
    server.stop()


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[type[ServerProcess]]:
    """Start servers with custom arguments; every one started is stopped after the test."""
    started: list[ServerProcess] = []

    def start(*args: str, env: dict[str, str] | None = None, **kwargs: object) -> ServerProcess:
        server = ServerProcess(*args, env=env, log_path=tmp_path / f"server{len(started)}.log")
        started.append(server)
        return server.start(**kwargs)  # type: ignore[arg-type]

    yield start  # type: ignore[misc]
    for server in started:
        server.stop()
