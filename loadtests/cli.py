"""`sluice loadtest`: load-test a running server with locust and write a report folder.

Exit status: 0 done (and the SLO met, if one was given), 1 no step met the SLO, 2 bad usage,
3 the load test could not run (server unreachable, unknown model, locust failed), 130 Ctrl-C
(after writing the report of the finished steps).
"""

from __future__ import annotations

import importlib.util
import signal
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import click
from rich.console import Console
from rich.text import Text

from loadtests.console import ProgressDisplay, print_summary
from loadtests.harness import LoadTestConfig, run_load_test
from loadtests.plan import parse_ramp
from loadtests.report import write_report
from loadtests.runner import PROTOCOLS, LoadTestError, child_env, stop_process, worker_command

EXIT_SLO_MISSED = 1
EXIT_FAILED = 3
EXIT_INTERRUPTED = 130
DEFAULT_GRPC_PORT = 8001
DEFAULT_USERS = 8


def parse_host_port(text: str, what: str) -> tuple[str, int]:
    """`host:port` -> (host, port); click.BadParameter names the option."""
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise click.BadParameter(f"'{text}' is not HOST:PORT", param_hint=what)
    return host, int(port)


def default_grpc_target(url: str) -> str:
    """The gRPC front-end next to an HTTP URL: same host, sluice's default gRPC port."""
    return f"{urlsplit(url).hostname or '127.0.0.1'}:{DEFAULT_GRPC_PORT}"


def read_key_file(path: Path | None) -> list[str]:
    """API keys, one per line (blank lines and # comments skipped)."""
    if path is None:
        return []
    lines = (line.strip() for line in path.read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#")]


# Options `sluice loadtest` and `sluice tune` share (tune drives the same harness).
protocol_option = click.option(
    "--protocol",
    type=click.Choice(sorted(PROTOCOLS)),
    default="http",
    show_default=True,
    help="JSON over HTTP, binary tensors over HTTP, or gRPC.",
)
grpc_url_option = click.option(
    "--grpc-url", help="gRPC HOST:PORT (default: the --url host, port 8001)."
)
max_error_fraction_option = click.option(
    "--max-error-fraction",
    type=click.FloatRange(0, 1),
    default=0.01,
    show_default=True,
    help="Failed-request fraction a step may have and meet the SLO.",
)
batch_size_option = click.option(
    "--batch-size",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Rows per request (the dynamic first dimension).",
)
timeout_option = click.option(
    "--timeout-s",
    type=click.FloatRange(min=0, min_open=True),
    default=30.0,
    show_default=True,
    help="Per-request timeout in seconds.",
)


def run_worker(protocol: str, master: str, console: Console) -> int:
    """Serve a remote master: one locust worker per step, until no master shows up for 5 min."""
    host, port = parse_host_port(master, "--worker-of")
    runs = 0
    console.print(f"locust worker for {protocol}: connecting to master {host}:{port} (Ctrl-C ends)")
    # SIGTERM becomes SystemExit, so the `finally` below stops the locust child too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    while True:
        process = subprocess.Popen(worker_command(protocol, host, port), env=child_env({}))
        try:
            code = process.wait()
        finally:
            stop_process(process)
        if code != 0:
            console.print(f"worker stopped after {runs} step(s) (locust exited with {code})")
            return 0 if runs else EXIT_FAILED
        runs += 1


@click.command("loadtest")
@click.option(
    "--url",
    default="http://127.0.0.1:8000",
    show_default=True,
    help="Server HTTP base URL (metadata, /metrics, and the HTTP protocols' target).",
)
@click.option("--model", default="demo", show_default=True, help="Model to load.")
@click.option("--model-version", default="", help="Model version (default: the server's policy).")
@protocol_option
@grpc_url_option
@click.option(
    "--users",
    type=click.IntRange(min=1),
    help=f"Fixed concurrency: users with requests in flight (default {DEFAULT_USERS}).",
)
@click.option("--ramp", help="Stepped concurrency START:STOP:STEP, e.g. 4:64:4 or 1:64:x2.")
@click.option(
    "--duration",
    type=click.IntRange(min=1),
    default=30,
    show_default=True,
    help="Seconds per step.",
)
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("loadtest-report"),
    show_default=True,
    help="Report folder.",
)
@click.option(
    "--slo-p99-ms",
    type=click.FloatRange(min=0, min_open=True),
    help="p99 latency SLO: the ramp stops at the first step over it, the report names "
    "the best step within it, and the exit status is 1 if none is.",
)
@max_error_fraction_option
@batch_size_option
@click.option(
    "--dynamic-size",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Size of every other dynamic dimension.",
)
@click.option(
    "--cache-hit-fraction",
    type=click.FloatRange(0, 1),
    default=0.0,
    show_default=True,
    help="Fraction of requests repeating an earlier input.",
)
@click.option(
    "--api-key",
    "api_keys",
    multiple=True,
    help="API key (repeatable): users are dealt the keys in turn, a tenant mix.",
)
@click.option(
    "--api-key-file",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    help="File of API keys, one per line (keeps them out of `ps`).",
)
@click.option(
    "--workers",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Local locust worker processes under one master (0: a single process).",
)
@click.option(
    "--remote-workers",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Workers on other machines (`sluice loadtest --worker-of`) to wait for.",
)
@click.option("--master-bind", help="HOST:PORT the locust master listens on (remote workers).")
@click.option(
    "--worker-of",
    metavar="HOST:PORT",
    help="Run only as a locust worker for the master at HOST:PORT (other machines).",
)
@click.option("--metrics-url", help="Prometheus metrics URL (default: <url>/metrics).")
@timeout_option
@click.option(
    "--seed",
    type=int,
    default=0,
    show_default=True,
    help="Seed of the repeated inputs (same seed, same inputs, on every worker).",
)
def loadtest(
    url: str,
    model: str,
    model_version: str,
    protocol: str,
    grpc_url: str | None,
    users: int | None,
    ramp: str | None,
    duration: int,
    out: Path,
    slo_p99_ms: float | None,
    max_error_fraction: float,
    batch_size: int,
    dynamic_size: int,
    cache_hit_fraction: float,
    api_keys: tuple[str, ...],
    api_key_file: Path | None,
    workers: int,
    remote_workers: int,
    master_bind: str | None,
    worker_of: str | None,
    metrics_url: str | None,
    timeout_s: float,
    seed: int,
) -> None:
    """Load-test a sluice (or any KServe v2) server with locust and write a report.

    Runs locust headless at a fixed concurrency (--users) or a stepped ramp (--ramp), each step
    --duration seconds, scrapes /metrics before and after every step, and writes --out:
    report.md, report.html, results.json and PNG plots.
    """
    console = Console(stderr=True)
    if protocol == "grpc" and importlib.util.find_spec("tritonclient") is None:
        raise click.UsageError(
            "--protocol grpc needs tritonclient, which is not installed: "
            "pip install 'sluice[loadtest]'"
        )
    if worker_of is not None:
        sys.exit(run_worker(protocol, worker_of, console))
    if users is not None and ramp is not None:
        raise click.UsageError("give --users or --ramp, not both")
    try:
        steps = parse_ramp(ramp) if ramp is not None else [users or DEFAULT_USERS]
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--ramp") from None
    if remote_workers and master_bind is None:
        raise click.UsageError("--remote-workers needs --master-bind HOST:PORT to listen on")
    config = LoadTestConfig(
        url=url.rstrip("/"),
        model=model,
        protocol=protocol,
        users=steps,
        duration_s=duration,
        out=out,
        grpc_target=(grpc_url or default_grpc_target(url)) if protocol == "grpc" else None,
        model_version=model_version,
        batch_size=batch_size,
        dynamic_size=dynamic_size,
        cache_hit_fraction=cache_hit_fraction,
        api_keys=(*api_keys, *read_key_file(api_key_file)),
        slo_p99_ms=slo_p99_ms,
        max_error_fraction=max_error_fraction,
        workers=workers,
        remote_workers=remote_workers,
        master_bind=parse_host_port(master_bind, "--master-bind") if master_bind else None,
        metrics_url=metrics_url,
        timeout_s=timeout_s,
        seed=seed,
    )
    try:
        with ProgressDisplay(console, len(steps)) as display:
            result = run_load_test(config, display)
    except LoadTestError as exc:
        console.print(Text("load test failed: ", style="bold red") + Text(str(exc)))
        sys.exit(EXIT_FAILED)
    write_report(result, out)
    print_summary(console, result, str(out))
    if result.interrupted:
        sys.exit(EXIT_INTERRUPTED)
    if result.verdict == "fail":
        sys.exit(EXIT_SLO_MISSED)
