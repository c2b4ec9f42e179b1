"""A server `sluice tune` owns (`--serve-cmd`): started with each front-end worker count the
search asks for, ready before a trial runs, and always stopped (its whole process group, so no
worker outlives it) when the tune ends, however it ends."""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

import httpx

from loadtests.runner import LoadTestError

MAX_AUTO_WORKERS = 8
"""What `sluice serve --workers auto` picks at most (one per core)."""
STOP_GRACE_S = 40.0
"""How long the server may drain after SIGTERM before its group is killed (its own drain is 30 s
by default, plus a few for the supervisor's children)."""
LOG_TAIL_BYTES = 2000


class ServeError(LoadTestError):
    """The owned server could not be started or did not get ready in time."""


def parse_serve_cmd(text: str) -> list[str]:
    """The argv of `--serve-cmd`; ValueError naming what is wrong."""
    try:
        argv = shlex.split(text)
    except ValueError as exc:
        raise ValueError(f"cannot split {text!r} into arguments: {exc}") from None
    if not argv:
        raise ValueError("is empty; give the command that serves, e.g. 'sluice serve ...'")
    if shutil.which(argv[0]) is None:
        raise ValueError(f"{argv[0]!r} is not an executable file nor found on PATH")
    if "--workers" in argv and argv.index("--workers") == len(argv) - 1:
        raise ValueError("ends with --workers and no value")
    return argv


def served_workers(argv: Sequence[str], cores: int) -> int:
    """The workers `argv` serves with: its `--workers` (a number or auto), else 1."""
    value = "1"
    for index, arg in enumerate(argv):
        if arg == "--workers" and index + 1 < len(argv):
            value = argv[index + 1]
        elif arg.startswith("--workers="):
            value = arg.removeprefix("--workers=")
    if value == "auto":
        return auto_workers(cores)
    try:
        return max(1, int(value))
    except ValueError:
        raise ValueError(f"has --workers {value!r}; allowed: a number or auto") from None


def auto_workers(cores: int) -> int:
    """What `--workers auto` picks on `cores` cores."""
    return max(1, min(cores, MAX_AUTO_WORKERS))


def parse_workers_range(text: str) -> tuple[int, ...]:
    """`START:STOP` (every count between, both included) or `A,B,...`; ValueError otherwise."""
    try:
        if ":" in text:
            start, stop = (int(part) for part in text.split(":"))
            counts = tuple(range(start, stop + 1))
        else:
            counts = tuple(sorted({int(part) for part in text.split(",")}))
    except ValueError:
        raise ValueError(f"{text!r} is not START:STOP nor a list A,B,...") from None
    if not counts or counts[0] < 1 or counts[-1] > 64:
        raise ValueError(f"{text!r}: need worker counts from 1 to 64 (what the server allows)")
    return counts


def with_workers(argv: Sequence[str], workers: int) -> list[str]:
    """`argv` with any `--workers` replaced by `--workers workers`."""
    kept: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--workers":
            skip = True
        elif not arg.startswith("--workers="):
            kept.append(arg)
    return [*kept, "--workers", str(workers)]


class OwnedServer:
    """The `--serve-cmd` server at `url`, restarted per workers count; its output goes to
    `log_path` (rewritten at every start)."""

    def __init__(self, argv: Sequence[str], url: str, log_path: Path, ready_timeout_s: float):
        self.argv = list(argv)
        self.url = url.rstrip("/")
        self.log_path = log_path
        self.ready_timeout_s = ready_timeout_s
        self.workers: int | None = None
        self.starts = 0
        self._process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def check_port_free(self) -> None:
        """ServeError when something already answers at the URL (readiness would be its)."""
        try:
            httpx.get(f"{self.url}/v2/health/ready", timeout=1.0)
        except httpx.HTTPError:
            return
        raise ServeError(
            f"a server already answers at {self.url}; --serve-cmd starts its own there: stop "
            "that one, or point --url at the port the command serves on"
        )

    def ensure(self, workers: int) -> None:
        """Serve with `workers` (restarting if it serves with another count or has died)."""
        if self.running() and self.workers == workers:
            return
        self.stop()
        self._start(workers)

    def _start(self, workers: int) -> None:
        argv = with_workers(self.argv, workers)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (closed in stop)
        try:
            # Its own session: Ctrl-C in the terminal reaches tune, which stops the server in
            # order; and the group is what stop() kills, workers included.
            self._process = subprocess.Popen(
                argv, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
            )
        except OSError as exc:
            self.stop()
            raise ServeError(f"cannot run {shlex.join(argv)}: {exc}") from exc
        self.workers = workers
        self.starts += 1
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            code = self._process.poll()
            if code is not None:
                self.stop()
                raise ServeError(
                    f"{shlex.join(argv)} exited with status {code} before it was ready; its "
                    f"output ({self.log_path}) ends: {self._tail()}"
                )
            try:
                if httpx.get(f"{self.url}/v2/health/ready", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise ServeError(
                    f"{shlex.join(argv)} was not ready at {self.url}/v2/health/ready within "
                    f"{self.ready_timeout_s:g} s (--serve-ready-timeout-s); it was stopped. Its "
                    f"output ({self.log_path}) ends: {self._tail()}"
                )
            time.sleep(0.2)  # polling readiness, bounded by the deadline above

    def stop(self) -> None:
        """SIGTERM the server's group (it drains), SIGKILL what is left after the grace."""
        process, self._process, self.workers = self._process, None, None
        if process is not None:
            _signal_group(process.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=STOP_GRACE_S)
            _signal_group(process.pid, signal.SIGKILL)  # stragglers: a worker the drain missed
            process.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def _tail(self) -> str:
        try:
            data = self.log_path.read_bytes()[-LOG_TAIL_BYTES:]
        except OSError:
            return "(no output)"
        return data.decode("utf-8", "replace").strip() or "(no output)"


def _signal_group(pid: int, signum: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signum)
