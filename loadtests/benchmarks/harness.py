"""What the benchmark modules share: starting the servers they measure (free ports, pinning to
a core, sluice's command line, waiting until a server answers), the CPU time a server process
has used, and the markdown tables of their results pages.

    command = pinned("0", *sluice_command(repo, http_port, grpc_port))
    with running(command, http_ready(f"http://127.0.0.1:{http_port}"), "sluice") as process:
        ...  # the server answers; it is terminated on the way out
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

PACKAGES = {"wrk": "wrk", "taskset": "util-linux", "nginx": "nginx", "redis-server": "redis-server"}
"""The apt package of each tool a benchmark runs."""
POLL_S = 0.1
"""How often a starting server is asked whether it answers yet."""


def require(*tools: str) -> None:
    """Exit with a message naming the package to install when a tool is not on PATH."""
    for tool in tools:
        if shutil.which(tool) is None:
            sys.exit(f"{tool} is needed (apt-get install {PACKAGES.get(tool, tool)})")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listened on a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def pinned(core: str, *args: str) -> list[str]:
    """`args` run under taskset on `core` (a CPU list such as "0" or "0-2")."""
    return ["taskset", "-c", core, *args]


def sluice_command(repo: Path, http_port: int, grpc_port: int, *extra: str) -> list[str]:
    """`sluice serve` on `repo` with both ports given, logging warnings only."""
    return [
        sys.executable,
        "-m",
        "server",
        "serve",
        "--model-repository",
        str(repo),
        "--http-port",
        str(http_port),
        "--grpc-port",
        str(grpc_port),
        "--log-level",
        "warning",
        *extra,
    ]


def baseline_command(kind: str, repo: Path, port: int) -> list[str]:
    """A peer server of loadtests/benchmarks/baseline.py: "plain" (FastAPI + onnxruntime) or
    "floor" (a no-op ASGI app)."""
    return [sys.executable, "-m", "loadtests.benchmarks.baseline", kind, str(repo), str(port)]


def http_ready(url: str, any_answer: bool = False) -> Callable[[], bool]:
    """Whether GET `url` answers 200 (any status at all with `any_answer`, for servers that
    have no health route)."""

    def ready() -> bool:
        try:
            status = httpx.get(url, timeout=1.0).status_code
        except httpx.TransportError:
            return False
        return any_answer or status == 200

    return ready


@contextmanager
def running(
    command: Sequence[str],
    ready: Callable[[], bool],
    name: str,
    timeout_s: float = 60.0,
    stop_s: float = 30.0,
    cwd: Path | None = None,
) -> Iterator[subprocess.Popen[bytes]]:
    """Start `command` (in `cwd`, stdout discarded), wait until `ready()`, yield the process and
    on the way out terminate it and wait up to `stop_s` for it to exit. RuntimeError naming
    `name` when the process exits or `timeout_s` passes before it is ready. With taskset in
    front, the process is the server itself (taskset execs it)."""
    process = subprocess.Popen(list(command), stdout=subprocess.DEVNULL, cwd=cwd)
    try:
        deadline = time.monotonic() + timeout_s
        while not ready():
            if time.monotonic() > deadline or process.poll() is not None:
                raise RuntimeError(f"{name} did not start")
            time.sleep(POLL_S)
        yield process
    finally:
        process.terminate()
        process.wait(stop_s)


def cpu_s(pid: int, main_thread: bool = False) -> float:
    """CPU time (user + system, every thread, or its `main_thread` alone: a Python server's
    event loop) that process `pid` has used, in seconds."""
    stat = Path(f"/proc/{pid}/task/{pid}/stat" if main_thread else f"/proc/{pid}/stat")
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Served:
    """A running server: its base URL, gRPC target (sluice's) and process id."""

    url: str
    grpc_target: str
    pid: int


@contextmanager
def serving(
    kind: str, repo: Path, core: str, *sluice_args: str, cwd: Path | None = None
) -> Iterator[Served]:
    """sluice (`kind` "sluice", with `sluice_args`) or a baseline peer serving `repo`, pinned to
    `core`, once it answers: sluice once ready, a peer (no health route) once it answers at all.
    Run in `cwd` when given: `python -m server` there imports that checkout's packages first."""
    port, grpc_port = free_port(), free_port()
    if kind == "sluice":
        command = sluice_command(repo, port, grpc_port, *sluice_args)
    else:
        command = baseline_command(kind, repo, port)
    url = f"http://127.0.0.1:{port}"
    ready = http_ready(url + "/v2/health/ready", any_answer=kind != "sluice")
    with running(pinned(core, *command), ready, f"{kind} server", cwd=cwd) as process:
        yield Served(url, f"127.0.0.1:{grpc_port}", process.pid)


def spread(values: Sequence[float], form: str) -> str:
    """The median of `values` with their range in brackets, each formatted with `form` (a
    str.format field such as "{:,.1f}"): how every results table shows repeated rounds. One value
    is shown alone; none is "-"."""
    if not values:
        return "-"
    middle = form.format(statistics.median(values))
    if len(values) == 1:
        return middle
    return f"{middle} ({form.format(min(values))}-{form.format(max(values))})"


def markdown_table(columns: Sequence[str], rows: Iterable[Sequence[object]]) -> list[str]:
    """A markdown table's lines: the header of `columns`, its rule, and a line per row of cells
    (each cell as str() shows it)."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(map(str, row)) + " |" for row in rows]
    return lines


def write_results(out: Path, name: str, report: dict[str, Any], table: str) -> None:
    """A benchmark's results in `out`: NAME.json (every measurement) and NAME.md (its table,
    which is printed too)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(report, indent=1))
    (out / f"{name}.md").write_text(table)
    print(table)
