"""The two kinds of process `sluice serve --workers N` forks (server/supervisor.py starts them):

- the engine process: one `Engine` (admission, cache, batchers, backends) behind an `EngineHost`
  on a unix socket, plus the metrics port when one is configured;
- a worker process: the normal HTTP and gRPC front-ends (`Server`) over a `RemoteEngine`, on its
  slot's HTTP listening socket (the supervisor binds one per slot on the port, SO_REUSEPORT) and
  a gRPC port every worker binds with SO_REUSEPORT (server_options turns it on when `workers` > 1).

Neither takes orders from signals: SIGTERM and SIGINT sent to the whole process group (a
terminal's Ctrl-C, systemd's default KillMode) must not start the engine's drain before the
workers have finished theirs. The supervisor gives orders on a pipe: a byte to stop; the end of
the pipe (the supervisor died) stops the process too. SIGHUP still reloads a worker's TLS
certificates and keys file."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
from collections.abc import Callable, Sequence

from server.link.shm.arena import Arena
from server.settings import Settings

log = logging.getLogger("sluice.workers")

ENGINE_LOST_S = 1.0
"""How long a worker that lost its engine connection answers 503 while it waits for the
supervisor's stop order before stopping on its own. The engine died: the order comes at once,
after the supervisor has closed its copies of the listening sockets (a worker that stopped
first closed its own while the supervisor's still listened, and every connection queued there
until the supervisor noticed was reset under its request). The engine lives and ended only this
connection: no order comes, and the worker stops to be replaced."""


def _orders(fd: int, stop: Callable[[], None], drain: Callable[[], None] | None = None) -> None:
    """Call `stop` when the supervisor writes S to `fd` or goes away, `drain` when it writes D."""
    loop = asyncio.get_running_loop()

    def readable() -> None:
        try:
            data = os.read(fd, 64)
        except BlockingIOError:
            return
        if drain is not None and b"D" in data:
            drain()
            data = data.replace(b"D", b"")
            if not data:
                return  # the stop comes later
        loop.remove_reader(fd)
        if not data:
            log.warning("the supervisor is gone: stopping")
        stop()

    os.set_blocking(fd, False)
    loop.add_reader(fd, readable)


def _runner() -> asyncio.Runner:
    try:
        import uvloop

        return asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:  # pragma: no cover - uvloop ships with uvicorn[standard]
        return asyncio.Runner()


def _ignore_stop_signals() -> None:
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)


# -- the engine process ----------------------------------------------------------------------------


def engine_main(
    settings: Settings,
    arenas: Sequence[tuple[int, int]],
    path: str,
    ready_fd: int,
    orders_fd: int,
) -> int:
    """Run the engine until the supervisor says stop; 0 after a clean drain."""
    _ignore_stop_signals()
    with _runner() as runner:
        return runner.run(_engine(settings, arenas, path, ready_fd, orders_fd))


async def _engine(
    settings: Settings,
    arena_fds: Sequence[tuple[int, int]],
    path: str,
    ready_fd: int,
    orders_fd: int,
) -> int:
    from engine.engine import Engine
    from server.http.uvicorn_server import MetricsServer
    from server.link.host import EngineHost
    from server.server import tune_gc

    size = settings.worker_arena_bytes
    engine = Engine(settings)
    host = EngineHost(engine, [(Arena(size, i), Arena(size, o)) for i, o in arena_fds])
    stop = asyncio.Event()
    metrics: MetricsServer | None = None
    try:
        await engine.start()
        await host.serve(path)
        if settings.metrics.enabled and settings.metrics.port is not None:
            metrics = MetricsServer.start(settings, engine.metrics.asgi)
        tune_gc()
        os.write(ready_fd, b"R")
        os.close(ready_fd)
        draining: list[asyncio.Task[None]] = []

        def drain() -> None:
            if not draining:
                log.info("engine process: draining (at most %.1f s)", settings.drain_timeout_s)
                draining.append(asyncio.create_task(engine.drain()))

        # D comes with the workers' own stop order (SIGTERM), so the engine answers what it
        # cannot finish within drain_timeout_s while they still wait; S once they have exited.
        _orders(orders_fd, stop.set, drain)
        await stop.wait()
        if not draining:  # the supervisor died: the workers are finishing, within the bound
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(host.no_workers.wait(), settings.drain_timeout_s)
            drain()
        await draining[0]
    finally:
        await host.close()
        if metrics is not None:
            with contextlib.suppress(Exception):
                await metrics.stop()
        await engine.close()
        with contextlib.suppress(OSError):
            os.unlink(path)
    return 0


# -- a worker process ------------------------------------------------------------------------------


def worker_main(
    settings: Settings,
    index: int,
    arenas: tuple[int, int],
    path: str,
    http_socket: socket.socket,
    orders_fd: int,
) -> int:
    """Serve HTTP and gRPC through the engine process until the supervisor says stop."""
    _ignore_stop_signals()
    with _runner() as runner:
        return runner.run(_worker(settings, index, arenas, path, http_socket, orders_fd))


async def _worker(
    settings: Settings,
    index: int,
    arena_fds: tuple[int, int],
    path: str,
    http_socket: socket.socket,
    orders_fd: int,
) -> int:
    from server.link.remote import RemoteEngine
    from server.server import Server

    size = settings.worker_arena_bytes
    arenas = (Arena(size, arena_fds[0]), Arena(size, arena_fds[1]))
    remote = RemoteEngine(settings, path, index, arenas)
    server = Server(settings, remote, http_socket=http_socket, own_signals=False)
    loop = asyncio.get_running_loop()
    stopping = False

    def stop_once() -> None:  # a second Server.stop() would exit without draining
        nonlocal stopping
        if not stopping:
            stopping = True
            server.stop()

    _orders(orders_fd, stop_once)
    loop.add_signal_handler(signal.SIGHUP, server.reload)
    lost: list[asyncio.TimerHandle] = []
    gone = asyncio.create_task(remote.engine_gone.wait())
    # No engine: nothing left to serve (a finished serve() cancels this), but see ENGINE_LOST_S.
    gone.add_done_callback(
        lambda task: (
            None if task.cancelled() else lost.append(loop.call_later(ENGINE_LOST_S, stop_once))
        )
    )
    try:
        await server.serve()
    finally:
        gone.cancel()
        for timer in lost:
            timer.cancel()
    return 0
