"""A real nginx (Debian's /usr/sbin/nginx) running deploy/nginx.conf on free loopback ports.

The config is used as shipped except for what only makes sense inside compose: the replica
host names become 127.0.0.1 ports, the listen ports become free ports, and the temp paths
and worker user point at the test's own folder (Debian's compiled-in ones do not exist here)."""

from __future__ import annotations

import getpass
import os
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

NGINX_CONF = Path(__file__).resolve().parents[1] / "deploy" / "nginx.conf"
REPLICAS = ("sluice-a", "sluice-b")


def nginx_binary() -> str:
    """Debian's nginx; without it the load-balancer tests skip (dev.sh installs it with apt)."""
    found = shutil.which("nginx") or "/usr/sbin/nginx"
    if not Path(found).exists():
        pytest.skip("nginx is not installed (apt-get install nginx)")
    return found


def adapt_config(
    text: str,
    workdir: Path,
    replicas: dict[str, tuple[int, int]],
    http_port: int,
    grpc_port: int,
) -> str:
    """deploy/nginx.conf for this machine; `replicas` maps a compose host to (http, grpc) ports.

    Every rewrite must match, so a reshaped config fails here instead of being half-adapted."""

    def sub(pattern: str, replacement: str, source: str, count: int) -> str:
        result, made = re.subn(pattern, replacement, source, flags=re.MULTILINE)
        if made != count:
            raise AssertionError(f"expected {count} match(es) of {pattern!r}, found {made}")
        return result

    for host, (replica_http, replica_grpc) in replicas.items():
        text = sub(rf"server {host}:8000\b", f"server 127.0.0.1:{replica_http}", text, 1)
        text = sub(rf"server {host}:8001\b", f"server 127.0.0.1:{replica_grpc}", text, 1)
    text = sub(r"listen 8000\b", f"listen 127.0.0.1:{http_port}", text, 1)
    text = sub(r"listen 8001\b", f"listen 127.0.0.1:{grpc_port}", text, 1)
    temp_paths = "".join(
        f"    {kind}_temp_path {workdir / kind};\n"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    text = sub(r"^http \{\n", "http {\n" + temp_paths, text, 1)
    return f"user {getpass.getuser()};\n" + text


def wait_for_port(port: int, process: subprocess.Popen[bytes], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(
                f"process exited with {process.returncode} before port {port} opened"
            )
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.02)
    raise RuntimeError(f"nothing listens on port {port} after {timeout_s} s")


class NginxProcess:
    """nginx in the foreground with the adapted config; `check()` is `nginx -t` on it."""

    def __init__(self, workdir: Path, config_text: str, http_port: int, grpc_port: int) -> None:
        self.workdir = workdir
        self.http_port = http_port
        self.grpc_port = grpc_port
        self.conf = workdir / "nginx.conf"
        self.conf.write_text(config_text)
        self.process: subprocess.Popen[bytes] | None = None

    def _command(self, *extra: str) -> list[str]:
        globals_ = f"daemon off; pid {self.workdir / 'nginx.pid'};"
        return [
            nginx_binary(),
            "-p",
            str(self.workdir),
            "-c",
            str(self.conf),
            "-e",
            "stderr",
            "-g",
            globals_,
            *extra,
        ]

    def check(self) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self._command("-t"), capture_output=True, text=True, timeout=30, check=False
        )

    def start(self) -> None:
        self.process = subprocess.Popen(
            self._command(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        wait_for_port(self.http_port, self.process)
        wait_for_port(self.grpc_port, self.process)

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(self.process.pid, 9)
                self.process.wait()
            self.process = None
