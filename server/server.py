"""The process lifecycle: HTTP (uvicorn) and gRPC (grpc.aio) in one event loop, owning signals.

Shutdown order on SIGTERM/SIGINT, losing no request that a client has written:
1. readiness turns 503 and new requests are answered 503 / UNAVAILABLE with Retry-After;
2. the HTTP listener closes (the connections the kernel had queued on it are accepted and
   served, not reset); open connections stay: each request on them is answered, with
   `Connection: close`, and an idle one closes once no request is on its way
   (server/http/connection.py);
3. queued and running requests finish, bounded by drain_timeout_s (what is left is answered 503);
4. gRPC stops once calls have stopped coming (grpc cancels, as CANCELLED, any call that arrives
   after its stop begins), at the latest at drain_timeout_s after the signal;
5. connections finish, then backends close. A second signal exits at once.

SIGHUP re-reads the TLS certificates (server/tls.py) and `auth.keys_file` (engine/keys_file.py)
without dropping a connection; what cannot be read is logged and the old stays in force."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import math
import os
import signal
import socket
import time
from functools import partial
from typing import Any

import uvicorn

from engine.engine import Engine
from engine.facade import EngineFacade
from engine.keys_file import KeyFileWatcher
from server.bind import ensure_safe_bind, listen_socket, note_metrics_key, warn_plaintext_bind
from server.http.app import create_app
from server.http.connection import HttpProtocol
from server.http.connection_policy import ConnectionPolicy
from server.http.uvicorn_server import MetricsServer, UvicornServer
from server.logs import effective_settings, start_summary
from server.settings import Settings
from server.tls import ServerTls

log = logging.getLogger("sluice.server")

GRPC_QUIET_S = 0.25
"""The drain stops gRPC once no call has arrived for this long: less than the 1 s Retry-After
of the UNAVAILABLE answers, so clients that honour it have stopped sending."""


def tune_gc() -> None:
    """Keep the cyclic garbage collector off the request path: what exists after start (models,
    modules) is frozen out of every collection, and collections run 140x less often. Requests
    free almost everything by reference counting; with the default thresholds, collections of
    the young generation every 700 allocations set p99 latency (measured: p99 70 ms -> 14 ms and
    +25% throughput on the benchmark MLP at 64 connections)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(100_000, 50, 1000)


class Server:
    """Runs the engine and both front-ends until a signal (or `stop()`)."""

    def __init__(
        self,
        settings: Settings,
        engine: EngineFacade | None = None,
        *,
        http_socket: socket.socket | None = None,
        own_signals: bool = True,
    ) -> None:
        """A worker process (server/workers.py) passes its proxy to the engine process and the
        supervisor's listening socket (its gRPC port is shared through `workers`, see
        server_options), and handles signals itself (the supervisor's orders come by pipe)."""
        self.settings = settings
        self.engine: EngineFacade = engine if engine is not None else Engine(settings)
        self._http_socket = http_socket
        self._own_signals = own_signals
        self._stop = asyncio.Event()
        self._signals = 0
        self.http: UvicornServer | None = None
        self.grpc: Any = None
        self.http_port: int | None = None
        self.grpc_port: int | None = None
        self.metrics_server: MetricsServer | None = None
        self.grpc_clock: Any = None
        # Certificates and keys files are read here, so a bad one fails the start at once.
        self.tls = ServerTls(settings.tls) if settings.tls.enabled else None
        keys_file = settings.auth.keys_file
        self.keys_watcher = (
            KeyFileWatcher(
                keys_file,
                settings.auth.keys_file_poll_interval_s,
                self.engine.authenticator.reload_file,
            )
            if keys_file is not None
            else None
        )
        self._reloads: set[asyncio.Task[None]] = set()
        self.stopped_loading = False
        """Stopped by a signal before the models had loaded (serve() returned at once)."""

    def stop(self) -> None:
        """Begin a graceful shutdown; a second call exits the process at once."""
        self._signals += 1
        if self._signals > 1:
            log.warning("second signal: exiting without draining")
            os._exit(1)
        self._stop.set()

    async def _started(self) -> bool:
        """Start the engine (load the models); False when a signal stops the server first: a
        model load can take minutes (a TensorRT build), longer than an orchestrator waits after
        its SIGTERM, and nothing is served yet, so nothing is left to drain."""
        starting = asyncio.ensure_future(self.engine.start())
        stopping = asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
        if starting.done():
            starting.result()  # a failed start raises here
            return True
        log.info("stopped while the models were loading: exiting without serving")
        self.stopped_loading = True  # the CLI exits without waiting for the loading threads
        starting.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await starting
        return False

    def reload(self) -> None:
        """SIGHUP: re-read the TLS certificates and `auth.keys_file` (off the event loop)."""
        task = asyncio.create_task(self._reload(), name="reload")
        self._reloads.add(task)
        task.add_done_callback(self._reloads.discard)

    async def _reload(self) -> None:
        log.info("SIGHUP: reloading TLS certificates and auth.keys_file")
        if self.tls is not None:
            await asyncio.to_thread(self.tls.reload)
        if self.keys_watcher is not None:
            await self.keys_watcher.reload(reason="sighup")

    async def serve(self) -> None:
        ensure_safe_bind(
            self.settings.host, self.settings.auth, self.settings.allow_unauthenticated
        )
        warn_plaintext_bind(self.settings.host, self.settings.tls)
        if self.settings.metrics.enabled:
            note_metrics_key(
                self.settings.host, self.settings.auth, self.settings.metrics.require_key
            )
        if self.settings.log_format == "text":  # a person reads it: one short line
            log.info(start_summary(self.settings))
            log.debug("settings", extra={"settings": effective_settings(self.settings)})
        else:
            log.info("starting sluice", extra={"settings": effective_settings(self.settings)})
        loop = asyncio.get_running_loop()
        signals = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP) if self._own_signals else ()
        if self._own_signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.stop)
            loop.add_signal_handler(signal.SIGHUP, self.reload)
        watch = (
            asyncio.create_task(self.keys_watcher.run(), name="keys-file")
            if self.keys_watcher is not None
            else None
        )
        try:
            if not await self._started():
                return
            tune_gc()
            await self._serve()
        finally:
            if watch is not None:
                watch.cancel()
            await self.engine.close()
            for sig in signals:
                loop.remove_signal_handler(sig)

    async def _serve(self) -> None:
        settings = self.settings
        http_socket = self._http_socket or listen_socket(settings.host, settings.http_port)
        self.http_port = http_socket.getsockname()[1]
        if settings.metrics.port is not None:  # bound here: a taken port fails the start
            self.metrics_server = MetricsServer.start(settings, self.engine.metrics.asgi)
        policy = ConnectionPolicy.from_settings(settings)
        config = uvicorn.Config(
            create_app(settings, self.engine),
            http=partial(HttpProtocol, policy=policy),  # type: ignore[arg-type]
            lifespan="off",
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=max(math.ceil(settings.drain_timeout_s), 1),
            timeout_keep_alive=30,
            backlog=2048,
            proxy_headers=False,
        )
        if self.tls is not None:
            config.load()  # uvicorn keeps a loaded config's `ssl`: the reloadable context
            config.ssl = self.tls.ssl_context
        self.http = UvicornServer(config)
        spare = http_socket.dup()  # uvicorn closes its socket at shutdown; see stop_listening
        http_task = asyncio.create_task(self.http.serve(sockets=[http_socket]), name="http")
        if settings.grpc_enabled:
            await self._start_grpc()
        log.info(
            "sluice serving HTTP on %s:%s%s%s",
            settings.host,
            self.http_port,
            f", gRPC on {settings.host}:{self.grpc_port}" if self.grpc else "",
            f", metrics on {settings.host}:{settings.metrics.port}" if self.metrics_server else "",
        )
        stop_task = asyncio.create_task(self._stop.wait())
        await asyncio.wait({http_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
        log.info("shutting down: draining requests (at most %.1f s)", settings.drain_timeout_s)
        await self._drain(policy, spare)
        await http_task
        if self.metrics_server is not None:
            await self.metrics_server.stop()  # last: scrapers can watch the drain
        stop_task.cancel()

    async def _drain(self, policy: ConnectionPolicy, spare: socket.socket) -> None:
        """Steps 1-4 of the shutdown order (module docstring)."""
        assert self.http is not None
        deadline = time.monotonic() + self.settings.drain_timeout_s
        self.engine.stop_accepting()
        policy.draining = True
        self.http.stop_listening(spare)
        for connection in list(self.http.server_state.connections):
            connection.shutdown()
        await self.engine.drain()
        self.http.should_exit = True
        if self.grpc is not None:
            while True:  # until no call came for GRPC_QUIET_S, or the deadline
                wake = min(self.grpc_clock.last_call_at + GRPC_QUIET_S, deadline)
                if wake <= time.monotonic():
                    break
                await asyncio.sleep(wake - time.monotonic())
            await self.grpc.stop(grace=1.0)

    async def _start_grpc(self) -> None:
        try:
            from server.grpc.service import CallClock, build_grpc_server
        except ImportError:
            log.warning("gRPC front-end not available in this build")
            return
        credentials = self.tls.grpc_credentials() if self.tls is not None else None
        self.grpc_clock = CallClock()
        self.grpc, self.grpc_port = build_grpc_server(
            self.settings, self.engine, credentials, clock=self.grpc_clock
        )
        await self.grpc.start()
