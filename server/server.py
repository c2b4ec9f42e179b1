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
from collections.abc import Generator
from functools import partial
from typing import Any

import uvicorn

from engine.auth import ensure_safe_bind, note_metrics_key, warn_plaintext_bind
from engine.engine import Engine
from engine.facade import EngineFacade
from engine.keys_file import KeyFileWatcher
from engine.settings import Settings, SettingsError
from server.http.app import create_app
from server.http.connection import ConnectionPolicy, HttpProtocol, accept_pending
from server.logs import effective_settings, start_summary
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


class _Uvicorn(uvicorn.Server):
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
        self.http: _Uvicorn | None = None
        self.grpc: Any = None
        self.http_port: int | None = None
        self.grpc_port: int | None = None
        self.metrics_http: _Uvicorn | None = None
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
        http_socket = self._http_socket or _bind(settings.host, settings.http_port)
        self.http_port = http_socket.getsockname()[1]
        metrics_task = self._start_metrics() if settings.metrics.port is not None else None
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
        self.http = _Uvicorn(config)
        spare = http_socket.dup()  # uvicorn closes its socket at shutdown; see stop_listening
        http_task = asyncio.create_task(self.http.serve(sockets=[http_socket]), name="http")
        if settings.grpc_enabled:
            await self._start_grpc()
        log.info(
            "sluice serving HTTP on %s:%s%s%s",
            settings.host,
            self.http_port,
            f", gRPC on {settings.host}:{self.grpc_port}" if self.grpc else "",
            f", metrics on {settings.host}:{settings.metrics.port}" if metrics_task else "",
        )
        stop_task = asyncio.create_task(self._stop.wait())
        await asyncio.wait({http_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
        log.info("shutting down: draining requests (at most %.1f s)", settings.drain_timeout_s)
        await self._drain(policy, spare)
        await http_task
        if self.metrics_http is not None and metrics_task is not None:
            self.metrics_http.should_exit = True  # last: scrapers can watch the drain
            await metrics_task
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

    def _start_metrics(self) -> asyncio.Task[None]:
        """Serve /metrics on `metrics.port` too (bound before this returns: a taken port fails
        the start)."""
        port = self.settings.metrics.port
        assert port is not None
        sock = _bind(self.settings.host, port)
        settings = self.settings
        # Read timeouts and a cap here too; it never drains: scrapers watch the drain.
        policy = ConnectionPolicy.from_settings(settings)
        config = uvicorn.Config(
            self.engine.metrics.asgi,
            http=partial(HttpProtocol, policy=policy),  # type: ignore[arg-type]
            interface="asgi3",  # a bound method: uvicorn's auto-detection would guess ASGI2
            lifespan="off",
            log_config=None,
            access_log=False,
        )
        self.metrics_http = _Uvicorn(config)
        return asyncio.create_task(self.metrics_http.serve(sockets=[sock]), name="metrics")

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


def _bind(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    """A TCP socket bound to (host, port); `reuse_port`: others may bind the port too
    (SO_REUSEPORT: the kernel spreads connections over their listening sockets)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise SettingsError(f"cannot listen on {host}:{port}: {exc.strerror}") from exc
    sock.set_inheritable(True)
    return sock
