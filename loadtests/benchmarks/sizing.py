"""The sizing benchmark behind the README's sizing guidance: on this host, how should cores be
spent on the compute-bound CNN — ONNX Runtime threads, model instances, or replicas?

    python -m loadtests.benchmarks.sizing --out loadtests/benchmarks/results [--seconds 10]

Every configuration serves the same CNN over binary HTTP to wrk (32 connections); the limit is
raw in-process ONNX Runtime at one thread times the cores given. Writes sizing.json and sizing.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from loadtests.benchmarks.batching import binary_body, machine, raw_limit, wrk
from loadtests.benchmarks.harness import (
    free_port,
    http_ready,
    markdown_table,
    running,
    sluice_command,
    write_results,
)
from loadtests.benchmarks.models import write_repository

CONCURRENCY = 32
NGINX = """
worker_processes 1;
pid {dir}/nginx.pid;
error_log {dir}/error.log;
events {{ worker_connections 1024; }}
http {{
  access_log off;
  client_body_temp_path {dir}/body;
  proxy_temp_path {dir}/proxy;
  upstream sluice {{ {servers} keepalive 64; }}
  server {{
    listen 127.0.0.1:{port};
    client_max_body_size 80m;
    client_body_buffer_size 1m;
    location / {{
      proxy_pass http://sluice;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
    }}
  }}
}}
"""
# name -> (replicas, instances per replica, intra-op threads per instance)
CONFIGS = {
    "1 replica, 1 instance x 1 thread": (1, 1, 1),
    "1 replica, 1 instance x 2 threads": (1, 1, 2),
    "1 replica, 2 instances x 1 thread": (1, 2, 1),
    "2 replicas behind nginx, 1 instance x 1 thread each": (2, 1, 1),
}


@contextmanager
def replica(repo: Path, instances: int, threads: int) -> Iterator[int]:
    config = repo / "cnn" / "config.yaml"
    config.write_text(
        "max_batch_size: 8\n"
        f"instances: {instances}\n"
        f"onnxruntime: {{intra_op_threads: {threads}, inter_op_threads: 1}}\n"
    )
    port = free_port()
    command = sluice_command(repo, port, free_port())
    with running(command, http_ready(f"http://127.0.0.1:{port}/v2/health/ready"), "sluice"):
        yield port


@contextmanager
def balancer(ports: list[int], workdir: Path) -> Iterator[int]:
    port = free_port()
    servers = " ".join(f"server 127.0.0.1:{p};" for p in ports)
    conf = workdir / "nginx.conf"
    conf.write_text(NGINX.format(dir=workdir, servers=servers, port=port))
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    command = [nginx, "-c", str(conf), "-p", str(workdir), "-g", "daemon off;"]
    ready = http_ready(f"http://127.0.0.1:{port}/v2/health/ready")
    with running(command, ready, "nginx", stop_s=10):
        yield port


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("loadtests/benchmarks/results"))
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        single = max(r["samples_per_s"] for r in raw_limit(write_repository(root / "raw"), "cnn"))
        body, length = binary_body("cnn")
        headers = {"Inference-Header-Content-Length": str(length)}
        for name, (replicas, instances, threads) in CONFIGS.items():
            with ExitStack() as stack:
                ports = [
                    stack.enter_context(
                        replica(write_repository(root / f"{name}-{i}"), instances, threads)
                    )
                    for i in range(replicas)
                ]
                if replicas > 1:
                    (root / "nginx").mkdir(exist_ok=True)
                    ports = [stack.enter_context(balancer(ports, root / "nginx"))]
                url = f"http://127.0.0.1:{ports[0]}/v2/models/cnn/infer"
                result = wrk(url, body, CONCURRENCY, args.seconds, headers, core=None)
            rows.append({"config": name, **result})
            print(json.dumps(rows[-1]), flush=True)
    report = {"rows": rows, "raw_one_thread": single, "cores": cores, "machine": machine()}
    write_results(args.out, "sizing", report, table(report, args.seconds))


def table(report: dict[str, Any], seconds: float) -> str:
    limit = report["raw_one_thread"] * report["cores"]
    lines = [
        "# Sizing benchmark",
        "",
        f"Command: `python -m loadtests.benchmarks.sizing --seconds {seconds:g}`; CNN over binary "
        f"HTTP, {CONCURRENCY} connections, wrk sharing the host's {report['cores']} cores; "
        f"{report['machine']}. Limit: raw ONNX Runtime at one thread "
        f"({report['raw_one_thread']:,.0f} samples/s) x {report['cores']} cores = {limit:,.0f}.",
        "",
    ]
    columns = ["configuration", "req/s", "% of limit", "p50 ms", "p99 ms", "errors"]
    cells = [
        [
            r["config"],
            f"{r['throughput']:,.0f}",
            f"{100 * r['throughput'] / limit:.0f}%",
            f"{r['p50_us'] / 1e3:.1f}",
            f"{r['p99_us'] / 1e3:.1f}",
            r["errors"] + r["non2xx"],
        ]
        for r in report["rows"]
    ]
    lines += markdown_table(columns, cells)
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
