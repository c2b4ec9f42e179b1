"""A real `sluice serve` process on free ports, for integration tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from tests.redis_process import free_port


class ServerProcess:
    """`sluice serve` in a subprocess; `start()` returns once /v2/health/ready answers 200."""

    def __init__(
        self,
        *args: str,
        env: dict[str, str] | None = None,
        log_path: Path | None = None,
        grpc: bool = True,
    ) -> None:
        self.http_port = free_port()
        self.grpc_port = free_port()
        self.args = [
            sys.executable, "-m", "server", "serve",
            "--http-port", str(self.http_port), "--grpc-port", str(self.grpc_port),
            "--log-format", "json", *args,
        ]  # fmt: skip
        self.env = {**os.environ, **(env or {})}
        if not grpc:
            self.env["SLUICE_GRPC_ENABLED"] = "false"
        self.log_path = log_path
        self.process: subprocess.Popen[bytes] | None = None
        self._log: Any = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def launch(self) -> ServerProcess:
        """Start the process without waiting for it to serve."""
        self._log = open(self.log_path, "wb") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        self.process = subprocess.Popen(self.args, env=self.env, stdout=self._log, stderr=self._log)
        return self

    def start(self, timeout_s: float = 60.0, ready: bool = True) -> ServerProcess:
        self.launch()
        assert self.process is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"sluice exited with {self.process.returncode}: {self.logs()}")
            try:
                response = httpx.get(f"{self.url}/v2/health/ready", timeout=1.0)
                if response.status_code == 200 or (not ready and response.status_code == 503):
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"sluice did not become ready in {timeout_s} s: {self.logs()}")

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path else ""

    def terminate(self) -> None:
        """Send SIGTERM (graceful drain) without waiting."""
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)

    def wait(self, timeout_s: float = 30.0) -> int:
        assert self.process is not None
        return self.process.wait(timeout_s)

    def stop(self) -> int | None:
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        code = self.process.returncode
        self.process = None
        if self._log not in (None, subprocess.DEVNULL):
            self._log.close()
        return code
