"""uvicorn under sluice's process lifecycle: `UvicornServer` leaves the signals to sluice's
`Server` (server/server.py decides the shutdown order) and closes its listener without resetting
the connections queued on it; `MetricsServer` serves /metrics on `metrics.port`, apart from the
API port, in the one-process server and in the engine process under `--workers`."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Generator
from dataclasses import dataclass
from functools import partial
from typing import Any

import uvicorn

from server.bind import listen_socket
from server.http.connection import HttpProtocol, accept_pending
from server.http.connection_policy import ConnectionPolicy
from server.settings import Settings


class UvicornServer(uvicorn.Server):
    """uvicorn without its own signal handling: sluice's Server decides the shutdown order."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self._adopting: set[asyncio.Task[Any]] = set()  # queued connections being taken over

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield

    def stop_listening(self, spare: socket.socket) -> None:
        """Close the listener without resetting the connections queued on it: a client may have
        written its request on one. `spare` (a duplicate of the listening socket) keeps it open
        while the queue is taken; the connections taken are served like the others."""
        for server in getattr(self, "servers", []):
            server.close()
        queued = accept_pending(spare)
        spare.close()
        loop = asyncio.get_running_loop()
        config = self.config
        protocol_class: Any = config.http_protocol_class  # uvicorn types it as a bare Protocol
        protocol = partial(
            protocol_class,
            config=config,
            server_state=self.server_state,
            app_state=self.lifespan.state,
        )
        for sock in queued:
            task = loop.create_task(loop.connect_accepted_socket(protocol, sock, ssl=config.ssl))
            self._adopting.add(task)
            task.add_done_callback(self._adopting.discard)


@dataclass
class MetricsServer:
    """/metrics on `metrics.port`, with the API port's read timeouts and connection cap. It never
    drains (scrapers watch the drain): stop it last."""

    server: UvicornServer
    task: asyncio.Task[None]

    @classmethod
    def start(cls, settings: Settings, app: Any) -> MetricsServer:
        """Serve `app` (the metrics' ASGI3 app) on `metrics.port`, bound before this returns:
        a taken port fails the start."""
        port = settings.metrics.port
        assert port is not None
        sock = listen_socket(settings.host, port)
        policy = ConnectionPolicy.from_settings(settings)
        config = uvicorn.Config(
            app,
            http=partial(HttpProtocol, policy=policy),  # type: ignore[arg-type]
            interface="asgi3",  # a bound method: uvicorn's auto-detection would guess ASGI2
            lifespan="off",
            log_config=None,
            access_log=False,
        )
        server = UvicornServer(config)
        return cls(server, asyncio.create_task(server.serve(sockets=[sock]), name="metrics"))

    async def stop(self) -> None:
        """Stop serving and wait until the server has."""
        self.server.should_exit = True
        await self.task
