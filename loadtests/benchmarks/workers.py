"""The worker-process benchmark (issue 14): `sluice serve --workers 1` (one process) vs
`--workers 2` (a supervisor, an engine process and two front-end workers) in one run, on the
benchmark MLP over JSON, binary HTTP and gRPC at concurrency 16 and 64, and the CNN over binary
HTTP at 64. Reported per row: req/s, p99, server CPU-seconds per 1,000 requests (every process of
the server, from /proc, and the engine process's part of it), the engine process's read system
calls per request (about one a wake-up, each bringing the frames the workers sent meanwhile),
context switches of the server's processes per request, and the average batch size (Triton
statistics; for the CNN req/s are samples/s).

    python -m loadtests.benchmarks.workers --out loadtests/benchmarks/results \
        [--seconds 5] [--server-cores 0-2] [--client-cores 3] [--engine-cores 3]

The server is pinned to --server-cores and the load generator (wrk; a grpc.aio client for gRPC)
to --client-cores; the defaults give the client the last core and the server the rest. With
--engine-cores, the engine process of `--workers 2` is moved to those cores once it serves (its
workers stay on --server-cores): what the worker mode costs when its engine does not take turns
on one core with its workers, as on a machine with a core to spare for it. Both
servers run for the whole benchmark (an idle one costs nothing) and each round loads every case
on one, then the other, so the figures a ratio compares are measured seconds apart, not one
half of the run after the other. Writes workers.json (every measurement) and workers.md (the
medians of the rounds, with the 2-worker/1-worker ratios), or --name's files."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import psutil

from loadtests.benchmarks.batching import binary_body, grpc_load, json_body, machine, wrk
from loadtests.benchmarks.harness import (
    free_port,
    http_ready,
    markdown_table,
    pinned,
    require,
    running,
    sluice_command,
    spread,
    write_results,
)
from loadtests.benchmarks.models import write_repository

WORKERS = (1, 2)
MLP_CASES = [(protocol, c) for protocol in ("json", "binary", "grpc") for c in (16, 64)]
CNN_CONCURRENCY = 64


@contextmanager
def server(
    repo: Path, workers: int, cores: str, engine_cores: str | None = None
) -> Iterator[tuple[str, str, psutil.Process]]:
    """A sluice server with `workers`, pinned to `cores`, its engine process (if any) then to
    `engine_cores` (every thread of it: taskset -a)."""
    port, grpc_port = free_port(), free_port()
    command = pinned(cores, *sluice_command(repo, port, grpc_port, "--workers", str(workers)))
    url = f"http://127.0.0.1:{port}"
    # A supervisor forks an engine and the workers (slower to start) and drains them all on stop.
    ready = http_ready(url + "/v2/health/ready")
    with running(command, ready, "sluice", timeout_s=90, stop_s=60) as process:
        root = psutil.Process(process.pid)
        engine = engine_process(root)
        if engine_cores and engine is not None:
            subprocess.run(
                ["taskset", "-a", "-p", "-c", engine_cores, str(engine.pid)],
                check=True,
                capture_output=True,
            )
        yield url, f"127.0.0.1:{grpc_port}", root


def cpu_s(root: psutil.Process) -> float:
    """User + system CPU seconds of `root` and every process under it."""
    total = 0.0
    for proc in [root, *root.children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def switches(root: psutil.Process) -> int:
    """Context switches (voluntary and not) of `root` and every process under it: each is a
    process going to sleep or being put aside, which a crossing between processes adds."""
    total = 0
    for proc in [root, *root.children(recursive=True)]:
        try:
            total += sum(proc.num_ctx_switches())
        except psutil.NoSuchProcess:
            continue
    return total


def engine_process(root: psutil.Process) -> psutil.Process | None:
    """The engine process of a `--workers N` server (the supervisor's child that listens on no
    TCP port: the workers hold the HTTP and gRPC sockets), or None for one process."""
    for child in root.children():
        try:
            if not any(c.status == psutil.CONN_LISTEN for c in child.net_connections("tcp")):
                return child
        except psutil.NoSuchProcess:
            continue
    return None


def reads(proc: psutil.Process | None) -> int:
    """The read system calls `proc` has made (0 for none)."""
    if proc is None:
        return 0
    try:
        return int(proc.io_counters().read_count)
    except psutil.NoSuchProcess:
        return 0


def process_cpu_s(proc: psutil.Process | None) -> float:
    if proc is None:
        return 0.0
    try:
        times = proc.cpu_times()
    except psutil.NoSuchProcess:
        return 0.0
    return times.user + times.system


def stats(url: str, model: str) -> tuple[int, int]:
    row = httpx.get(f"{url}/v2/models/{model}/stats").json()["model_stats"][0]
    return int(row["inference_count"]), int(row["execution_count"])


def measure(
    url: str,
    grpc_target: str,
    root: psutil.Process,
    model: str,
    protocol: str,
    concurrency: int,
    seconds: float,
    client: str,
) -> dict[str, Any]:
    target = f"{url}/v2/models/{model}/infer"
    engine = engine_process(root)
    before_stats, before_cpu, before_engine = stats(url, model), cpu_s(root), process_cpu_s(engine)
    before_switches, before_reads = switches(root), reads(engine)
    if protocol == "grpc":
        result = grpc_load(grpc_target, model, concurrency, seconds, client)
    elif protocol == "json":
        result = wrk(target, json_body(model), concurrency, seconds, {}, core=client)
    else:
        body, length = binary_body(model)
        headers = {"Inference-Header-Content-Length": str(length)}
        result = wrk(target, body, concurrency, seconds, headers, core=client)
    used, switched = cpu_s(root) - before_cpu, switches(root) - before_switches
    engine_used, engine_reads = process_cpu_s(engine) - before_engine, reads(engine) - before_reads
    after = stats(url, model)
    rows, batches = after[0] - before_stats[0], after[1] - before_stats[1]
    served = max(1, result["requests"] - result.get("non2xx", 0) - result["errors"])
    return {
        "model": model,
        "protocol": protocol,
        "concurrency": concurrency,
        **result,
        "cpu_s_per_1000": 1000 * used / served,
        # The engine process's part (serial: one per server); None with one process.
        "engine_cpu_s_per_1000": None if engine is None else 1000 * engine_used / served,
        # Its reads: about one per wake-up, which brings the frames the workers sent meanwhile.
        "engine_reads_per_request": None if engine is None else engine_reads / served,
        "avg_batch": rows / batches if batches else 0.0,
        "switches_per_request": switched / served,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("loadtests/benchmarks/results"))
    parser.add_argument("--seconds", type=float, default=5.0)
    cores = sorted(os.sched_getaffinity(0))
    default_server = ",".join(map(str, cores[:-1] or cores))
    parser.add_argument("--server-cores", default=default_server)
    parser.add_argument("--client-cores", default=str(cores[-1]))
    parser.add_argument("--engine-cores", default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--name", default="workers", help="the results files' name")
    args = parser.parse_args()
    require("wrk", "taskset")
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    cases = [("mlp", p, c) for p, c in MLP_CASES] + [("cnn", "binary", CNN_CONCURRENCY)]
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        repo = write_repository(Path(tmp))
        servers = {
            n: stack.enter_context(server(repo, n, args.server_cores, args.engine_cores))
            for n in WORKERS
        }
        for round_ in range(args.rounds):
            for model, protocol, concurrency in cases:
                for workers, (url, grpc_target, root) in servers.items():
                    row = measure(
                        url,
                        grpc_target,
                        root,
                        model,
                        protocol,
                        concurrency,
                        args.seconds,
                        args.client_cores,
                    )
                    rows.append({"round": round_, "workers": workers, **row})
                    print(json.dumps(rows[-1]), flush=True)
    report = {
        "rows": rows,
        "machine": machine(),
        "server_cores": args.server_cores,
        "client_cores": args.client_cores,
        "engine_cores": args.engine_cores,
        "seconds": args.seconds,
        "rounds": args.rounds,
        "name": args.name,
    }
    write_results(args.out, args.name, report, table(report))


def table(report: dict[str, Any]) -> str:
    rows = report["rows"]
    name = "" if report.get("name", "workers") == "workers" else f" --name {report['name']}"
    engine = f" --engine-cores {report['engine_cores']}" if report.get("engine_cores") else ""
    rounds = sorted({r.get("round", 0) for r in rows})
    keys = list(
        dict.fromkeys((r["workers"], r["model"], r["protocol"], r["concurrency"]) for r in rows)
    )
    by = {
        (r.get("round", 0), r["workers"], r["model"], r["protocol"], r["concurrency"]): r
        for r in rows
    }
    lines = [
        "# Worker processes benchmark" + (f" ({report['name']})" if name else ""),
        "",
        f"Command: `python -m loadtests.benchmarks.workers --seconds {report['seconds']:g} "
        f"--rounds {len(rounds)} --server-cores {report['server_cores']} "
        f"--client-cores {report['client_cores']}{engine}{name}`; {report['machine']}. Medians of "
        f"{len(rounds)} rounds, the range in brackets; a ratio is taken within each round "
        "(2 workers over 1, measured seconds apart) and its median shown.",
        "",
    ]
    columns = [
        "workers",
        "model",
        "protocol",
        "concurrency",
        "req/s",
        "x 1 worker",
        "p99 ms",
        "CPU s / 1,000 req",
        "x 1 worker",
        "engine process",
        "engine reads / req",
        "switches / req",
        "avg batch",
        "errors",
    ]
    cells = []
    for key in keys:
        runs = [by[(n, *key)] for n in rounds if (n, *key) in by]
        bases = [by.get((n, 1, *key[1:])) for n in rounds if (n, *key) in by]
        pairs = [] if key[0] == 1 or None in bases else list(zip(runs, bases, strict=True))
        cells.append(
            [
                *key,
                spread([r["throughput"] for r in runs], "{:,.0f}"),
                ratio(pairs, "throughput"),
                f"{statistics.median(r['p99_us'] for r in runs) / 1e3:.2f}",
                spread([r["cpu_s_per_1000"] for r in runs], "{:.3f}"),
                ratio(pairs, "cpu_s_per_1000"),
                engine_part(runs),
                median_of(runs, "engine_reads_per_request"),
                median_of(runs, "switches_per_request"),
                f"{statistics.median(r['avg_batch'] for r in runs):.1f}",
                sum(r["errors"] + r.get("non2xx", 0) for r in runs),
            ]
        )
    lines += markdown_table(columns, cells)
    return "\n".join(lines) + "\n"


def ratio(pairs: list[tuple[dict[str, Any], Any]], field: str) -> str:
    """The median over rounds of a 2-worker row's `field` over the 1-worker row's; "-" without
    pairs (a 1-worker row)."""
    if not pairs:
        return "-"
    return f"{statistics.median(row[field] / base[field] for row, base in pairs):.2f}"


def median_of(rows: list[dict[str, Any]], field: str) -> str:
    """The median of `field` over `rows` that have it, two decimals ("-" where none has: one
    process for the engine's figures, or runs from before a figure was counted)."""
    values = [r[field] for r in rows if r.get(field) is not None]
    return f"{statistics.median(values):.2f}" if values else "-"


def engine_part(rows: list[dict[str, Any]]) -> str:
    """The engine process's CPU s / 1,000 requests (the rest is the workers' and the
    supervisor's), median of `rows`; "-" for one process."""
    parts = [r["engine_cpu_s_per_1000"] for r in rows if r.get("engine_cpu_s_per_1000")]
    return f"{statistics.median(parts):.3f}" if parts else "-"


if __name__ == "__main__":
    main()
