"""Running locust through its own CLI in subprocesses: standalone, or a master with workers.

The harness never imports locust (importing it monkey-patches the process with gevent). Each step
is one headless locust run writing CSVs; this module builds the command lines, starts the
processes, reports progress from the growing history CSV and makes sure nothing outlives the step.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from loadtests.locust_csv import AGGREGATED, StepFiles

USERS_DIR = Path(__file__).resolve().parent / "users"

PROTOCOLS: dict[str, tuple[Path, str]] = {
    "http": (USERS_DIR / "http_users.py", "JsonInferUser"),
    "http-binary": (USERS_DIR / "http_users.py", "BinaryInferUser"),
    "grpc": (USERS_DIR / "grpc_users.py", "GrpcInferUser"),
}
"""Protocol name -> (locustfile, user class)."""

GRACE_S = 30.0
"""How long past its run time a step may take to start and stop before it is killed."""


class LoadTestError(Exception):
    """locust could not run a step; the message ends with the tail of its log."""


@dataclass(frozen=True, slots=True)
class StepSpec:
    """One locust run."""

    protocol: str
    host: str
    users: int
    duration_s: int
    prefix: Path
    """CSV prefix; the log goes to `<prefix>.log`, workers' to `<prefix>-worker-N.log`."""
    workers: int = 0
    """Local worker processes; 0 runs locust standalone (unless remote workers are expected)."""
    remote_workers: int = 0
    """Workers on other machines the master waits for (see `sluice loadtest --worker-of`)."""
    master_bind: tuple[str, int] | None = None
    """Where the master listens; default 127.0.0.1 on a free port."""
    worker_wait_s: int = 60
    """How long the master waits for its workers before giving up."""

    @property
    def distributed(self) -> bool:
        return self.workers > 0 or self.remote_workers > 0


@dataclass(frozen=True, slots=True)
class Progress:
    """The latest second of a running step, from its history CSV."""

    users: int
    requests: int
    failures: int
    p99_ms: float | None


def locust_base() -> list[str]:
    """How to start locust: this interpreter's `python -m locust`."""
    return [sys.executable, "-m", "locust"]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def main_command(spec: StepSpec, master_port: int | None = None) -> list[str]:
    """The standalone (or master) locust command of a step."""
    locustfile, user_class = PROTOCOLS[spec.protocol]
    command = [
        *locust_base(),
        "-f", str(locustfile),
        "--headless",
        "--users", str(spec.users),
        "--spawn-rate", str(spec.users),
        "--run-time", f"{spec.duration_s}s",
        "--host", spec.host,
        "--csv", str(spec.prefix),
        "--csv-full-history",
        "--sluice-summary-file", str(StepFiles(spec.prefix).summary),
        "--only-summary",
        "--reset-stats",
        "--exit-code-on-error", "0",
    ]  # fmt: skip
    if spec.distributed:
        bind_host = spec.master_bind[0] if spec.master_bind else "127.0.0.1"
        port = master_port if master_port is not None else _bind_port(spec)
        command += [
            "--master",
            "--master-bind-host", bind_host,
            "--master-bind-port", str(port),
            "--expect-workers", str(spec.workers + spec.remote_workers),
            "--expect-workers-max-wait", str(spec.worker_wait_s),
        ]  # fmt: skip
    return [*command, user_class]


def _bind_port(spec: StepSpec) -> int:
    return spec.master_bind[1] if spec.master_bind else free_port()


def local_master_host(spec: StepSpec) -> str:
    """Where workers on this machine find the master: its bind address unless that is a
    wildcard."""
    host = spec.master_bind[0] if spec.master_bind else ""
    return "127.0.0.1" if host in ("", "0.0.0.0", "*", "::") else host


def worker_command(protocol: str, master_host: str, master_port: int) -> list[str]:
    """A locust worker for `protocol` that connects to a master."""
    locustfile, _ = PROTOCOLS[protocol]
    return [
        *locust_base(),
        "-f", str(locustfile),
        "--worker",
        "--master-host", master_host,
        "--master-port", str(master_port),
    ]  # fmt: skip


def child_env(extra: Mapping[str, str]) -> dict[str, str]:
    """This environment plus `extra`, with the sluice tree importable from any working dir."""
    env = {**os.environ, **extra}
    root = str(USERS_DIR.parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env


def read_progress(files: StepFiles) -> Progress | None:
    """The last `Aggregated` row written so far (None before the first one)."""
    try:
        with files.history.open(newline="") as handle:
            rows = [row for row in csv.DictReader(handle) if row.get("Name") == AGGREGATED]
    except (OSError, csv.Error):
        return None
    if not rows:
        return None
    last = rows[-1]
    p99 = last.get("99%", "N/A")
    try:
        return Progress(
            users=int(last["User Count"]),
            requests=int(last["Total Request Count"]),
            failures=int(last["Total Failure Count"]),
            p99_ms=None if p99 in ("N/A", "", None) else float(p99),
        )
    except (KeyError, ValueError):
        return None  # a row caught half-written


def stop_process(process: subprocess.Popen[bytes], timeout_s: float = 5.0) -> None:
    """SIGTERM (locust then writes its results), SIGKILL after `timeout_s`."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def run_step(
    spec: StepSpec,
    env: Mapping[str, str],
    on_progress: Callable[[float, Progress | None], None] | None = None,
    poll_s: float = 0.5,
) -> StepFiles:
    """Run one step to completion and return its CSV files.

    `on_progress(elapsed_s, progress)` is called about every `poll_s` seconds. Raises
    LoadTestError when locust fails or overruns its run time by more than GRACE_S; every process
    it started is stopped before it returns or raises.
    """
    # locust runs in the step's folder, so every path it is given must not depend on our cwd.
    spec = dataclasses.replace(spec, prefix=spec.prefix.absolute())
    spec.prefix.parent.mkdir(parents=True, exist_ok=True)
    files = StepFiles(spec.prefix)
    log = spec.prefix.with_name(spec.prefix.name + ".log")
    port = _bind_port(spec) if spec.distributed else None
    full_env = child_env(env)
    processes: list[subprocess.Popen[bytes]] = []
    cwd = spec.prefix.parent  # keeps locust from reading a locust.conf in the caller's folder
    try:
        with log.open("wb") as out:
            main = subprocess.Popen(
                main_command(spec, port),
                stdout=out,
                stderr=subprocess.STDOUT,
                env=full_env,
                cwd=cwd,
            )
        processes.append(main)
        for n in range(spec.workers):
            worker_log = spec.prefix.with_name(f"{spec.prefix.name}-worker-{n + 1}.log")
            assert port is not None
            with worker_log.open("wb") as out:
                command = worker_command(spec.protocol, local_master_host(spec), port)
                processes.append(
                    subprocess.Popen(
                        command, stdout=out, stderr=subprocess.STDOUT, env=full_env, cwd=cwd
                    )
                )
        started = time.monotonic()
        waiting_s = spec.worker_wait_s if spec.distributed else 0
        deadline = started + spec.duration_s + GRACE_S + waiting_s
        while main.poll() is None:
            if time.monotonic() > deadline:
                raise LoadTestError(
                    f"locust did not finish a {spec.duration_s} s step in time; log {log}:\n"
                    + _tail(log)
                )
            if on_progress is not None:
                on_progress(time.monotonic() - started, read_progress(files))
            # Waiting on the exit, not sleeping, ends the step as soon as locust does.
            with contextlib.suppress(subprocess.TimeoutExpired):
                main.wait(timeout=poll_s)
        if main.returncode != 0:
            raise LoadTestError(
                f"locust exited with code {main.returncode}; log {log}:\n" + _tail(log)
            )
        if not files.summary.exists():
            raise LoadTestError(
                f"locust finished but wrote no summary at {files.summary}; log {log}:\n"
                + _tail(log)
            )
        for worker in processes[1:]:
            try:
                worker.wait(timeout=10)  # workers quit when the master tells them
            except subprocess.TimeoutExpired:
                stop_process(worker)
        return files
    finally:
        for process in reversed(processes):
            stop_process(process)
