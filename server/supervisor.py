"""`sluice serve --workers N`: the supervisor process.

It binds one HTTP listening socket per worker slot and reserves the gRPC port
(server/slot_sockets.py), creates two shared-memory arenas per worker slot
(server/link/shm/arena.py), then forks (server/children.py) the engine process, waits for it to
be ready, and forks the workers (server/workers.py).

- A worker that dies is forked again in its slot (after a back-off while it keeps dying): the
  engine withdraws the requests it had in flight; the other workers are unaffected. The slot's
  socket stays open here, so the connections the kernel queued on it (and gives it until the
  new worker serves) wait for the new worker instead of being reset.
- The engine dying ends the server: the workers answer 503 until they are stopped, in the order
  a signal stops them, and the supervisor exits 1, so that systemd or Kubernetes restarts it.
- SIGTERM or SIGINT drains in order: the workers stop listening and finish their requests
  (Server's shutdown order) while the engine drains its queues within the same
  `drain_timeout_s` (what is left then is answered 503), then the engine exits; exit 0. A second
  signal kills everything at once (exit 1). SIGHUP is passed to the workers (TLS, keys file).
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import signal
import tempfile
import time

from server.bind import ensure_safe_bind
from server.children import Child, fork_child, reap
from server.link.shm.arena import Arena
from server.settings import Settings
from server.slot_sockets import listen_http, reserve_grpc

log = logging.getLogger("sluice.supervisor")

MAX_AUTO_WORKERS = 8
RESTART_BACKOFF_S = (0.0, 0.5, 1.0, 2.0, 5.0)
"""Wait before forking a worker again, by how many times its slot died in the last minute."""
STOP_GRACE_S = 5.0
"""Beyond drain_timeout_s, how long a process may take to exit before it is killed."""


def worker_count(settings: Settings) -> int:
    """`workers` as a number: `auto` is one per core this process may run on, at most 8."""
    if settings.workers == "auto":
        return max(1, min(len(os.sched_getaffinity(0)), MAX_AUTO_WORKERS))
    return settings.workers


class Supervisor:
    """Starts, watches and stops the engine process and the workers."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.count = worker_count(settings)
        self._stopping = False
        self._signals = 0
        self._engine: Child | None = None
        self._workers: dict[int, Child] = {}
        self._deaths: dict[int, list[float]] = {i: [] for i in range(self.count)}
        self._restart_at: dict[int, float] = {}
        self._engine_failed = False
        self._engine_ordered = False

    def run(self) -> int:
        settings = self.settings
        ensure_safe_bind(settings.host, settings.auth, settings.allow_unauthenticated)
        if settings.tls.enabled:  # each worker loads them; unusable ones fail the start here,
            from server.tls import ServerTls  # not each worker, again and again

            ServerTls(settings.tls)
        http = listen_http(settings.host, settings.http_port, self.count)
        grpc_reserve = (
            reserve_grpc(settings.host, settings.grpc_port) if settings.grpc_enabled else None
        )
        update = {
            "http_port": http[0].getsockname()[1],
            "grpc_port": grpc_reserve.getsockname()[1] if grpc_reserve else settings.grpc_port,
        }
        self.worker_settings = settings.model_copy(
            update={
                **update,
                "workers": self.count,  # a number: the workers share the gRPC port
                "metrics": settings.metrics.model_copy(update={"port": None}),
            }
        )
        self.engine_settings = settings.model_copy(update=update)
        self.http = http
        size = settings.worker_arena_bytes
        self.arenas = [(Arena(size), Arena(size)) for _ in range(self.count)]
        for pair in self.arenas:
            for arena in pair:
                os.set_inheritable(arena.fd, True)
        self._dir = tempfile.mkdtemp(prefix="sluice-")
        self.path = os.path.join(self._dir, "engine.sock")
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD):
            signal.signal(sig, self._on_signal)
        try:
            if not self._start_engine(wake_r):
                return 0 if self._stopping else 1
            # Only now: while the engine loads its models, a connection is refused (as by one
            # process) rather than queued on a socket that nothing would accept for minutes.
            for sock in self.http:
                sock.listen(2048)
            log.info(
                "sluice serving HTTP on %s:%s%s with %d worker processes",
                settings.host,
                update["http_port"],
                f", gRPC on {settings.host}:{update['grpc_port']}" if grpc_reserve else "",
                self.count,
            )
            for index in range(self.count):
                self._start_worker(index)
            return self._watch(wake_r)
        finally:
            signal.set_wakeup_fd(-1)
            for sock in http:
                sock.close()
            if grpc_reserve is not None:
                grpc_reserve.close()
            for fd in (wake_r, wake_w):
                os.close(fd)
            for pair in self.arenas:
                for arena in pair:
                    arena.close()
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            with contextlib.suppress(OSError):
                os.rmdir(self._dir)

    # -- children --------------------------------------------------------------------------------

    def _arena_fds(self) -> set[int]:
        return {arena.fd for pair in self.arenas for arena in pair}

    def _start_engine(self, wake: int) -> bool:
        """Fork the engine process and wait until it serves; False if it failed to start or a
        signal stopped the server first (`_stopping`: the engine, which serves nothing yet, is
        killed rather than left to finish loading its models)."""
        from server.workers import engine_main

        ready_r, ready_w = os.pipe()
        orders_r, orders_w = os.pipe()
        fds = [(i.fd, o.fd) for i, o in self.arenas]
        pid = fork_child(
            lambda: engine_main(self.engine_settings, fds, self.path, ready_w, orders_r),
            {ready_w, orders_r, *self._arena_fds()},
        )
        os.close(ready_w)
        os.close(orders_r)
        self._engine = Child(pid, orders_w)
        ready = b""
        selector = selectors.DefaultSelector()
        selector.register(ready_r, selectors.EVENT_READ)
        selector.register(wake, selectors.EVENT_READ)
        while not self._stopping:
            keys = [key.fd for key, _ in selector.select()]
            if wake in keys:
                with contextlib.suppress(OSError):
                    os.read(wake, 512)
            if ready_r in keys:
                ready = os.read(ready_r, 1)
                break
        selector.close()
        os.close(ready_r)
        if self._stopping and ready != b"R":
            log.info("stopped while the engine was loading its models: exiting without serving")
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            reap(pid)
            self._engine = None
            return False
        if ready != b"R":
            code = reap(pid)
            log.error("the engine process failed to start (exit status %s)", code)
            self._engine = None
            return False
        return True

    def _start_worker(self, index: int) -> None:
        from server.workers import worker_main

        orders_r, orders_w = os.pipe()
        inputs, outputs = self.arenas[index]
        pid = fork_child(
            lambda: worker_main(
                self.worker_settings,
                index,
                (inputs.fd, outputs.fd),
                self.path,
                self.http[index],
                orders_r,
            ),
            {orders_r, inputs.fd, outputs.fd, self.http[index].fileno()},
        )
        os.close(orders_r)
        self._workers[index] = Child(pid, orders_w)
        log.info("worker %d started (pid %d)", index, pid)

    # -- watching --------------------------------------------------------------------------------

    def _on_signal(self, sig: int, _: object) -> None:
        if sig == signal.SIGHUP:
            for child in self._workers.values():
                with contextlib.suppress(OSError):
                    os.kill(child.pid, signal.SIGHUP)
        elif sig in (signal.SIGTERM, signal.SIGINT):
            self._signals += 1
            self._stopping = True

    def _watch(self, wake: int) -> int:
        selector = selectors.DefaultSelector()
        selector.register(wake, selectors.EVENT_READ)
        drain_started: float | None = None
        while True:
            if self._signals > 1:
                log.warning("second signal: killing every process without draining")
                self._kill_all()
                return 1
            if self._stopping and drain_started is None:
                drain_started = time.monotonic()
                log.info("shutting down: the workers finish their requests, then the engine")
                for sock in self.http:  # each worker's copy stays open until it has drained
                    sock.close()
                for child in self._workers.values():
                    child.order()
                if self._engine is not None:  # its drain bound starts now, as the workers' do:
                    self._engine.order(b"D")  # left work is answered 503 in time
            code = self._collect()
            if code is not None:
                return code
            if self._stopping and drain_started is None:
                continue  # the engine died: the stop begins now, not after the next poll
            if drain_started is not None:
                late = time.monotonic() - drain_started > self.settings.drain_timeout_s + 2 * (
                    STOP_GRACE_S
                )
                if late:
                    log.error("processes did not exit in time: killing them")
                    self._kill_all()
                    return 1
            now = time.monotonic()
            for index, when in list(self._restart_at.items()):
                if when <= now and not self._stopping:
                    del self._restart_at[index]
                    self._start_worker(index)
            timeout = 0.2
            if self._restart_at:
                timeout = max(0.0, min(timeout, min(self._restart_at.values()) - now))
            for key, _ in selector.select(timeout):
                with contextlib.suppress(OSError):
                    os.read(key.fd, 512)

    def _collect(self) -> int | None:
        """Reap exited children; the supervisor's exit status once it should exit."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return 1
            if pid == 0:
                break
            code = os.waitstatus_to_exitcode(status)
            if self._engine is not None and pid == self._engine.pid:
                os.close(self._engine.orders)
                self._engine = None
                if self._workers or not self._stopping:
                    log.error("the engine process exited (status %s): stopping the server", code)
                    if not self._workers:
                        return 1
                    # _watch stops the workers as a signal does: the listening sockets' copies
                    # here closed first, so none keeps listening once its worker has taken its
                    # queue and stopped (the connections queued on it would be reset).
                    self._stopping = True
                    self._engine_failed = True
                    continue
                return 0 if code == 0 else 1
            for index, child in list(self._workers.items()):
                if child.pid == pid:
                    os.close(child.orders)
                    del self._workers[index]
                    if not self._stopping:
                        self._schedule_restart(index, code)
        if self._stopping and not self._workers:
            if self._engine is None:
                return 1 if self._engine_failed else 0
            if not self._engine_ordered:
                self._engine_ordered = True
                log.info("workers stopped: draining the engine")
                self._engine.order()
        return None

    def _schedule_restart(self, index: int, code: int) -> None:
        now = time.monotonic()
        deaths = [t for t in self._deaths[index] if now - t < 60.0] + [now]
        self._deaths[index] = deaths
        wait = RESTART_BACKOFF_S[min(len(deaths) - 1, len(RESTART_BACKOFF_S) - 1)]
        log.error("worker %d exited (status %s): starting it again in %.1f s", index, code, wait)
        self._restart_at[index] = now + wait

    def _kill_all(self) -> None:
        children = [*self._workers.values(), *([self._engine] if self._engine else [])]
        for child in children:
            with contextlib.suppress(OSError):
                os.kill(child.pid, signal.SIGKILL)
        for child in children:
            with contextlib.suppress(OSError):
                os.waitpid(child.pid, 0)
        self._workers.clear()
        self._engine = None
