"""The result-cache benchmark: the hit path against the computed path over HTTP, for the
compute-bound CNN, with the memory and the Redis backends, in one run. sluice is pinned to core 0;
the load generator (wrk) and redis-server to core 1.

    python -m loadtests.benchmarks.cache --out loadtests/benchmarks/results [--seconds 10]

The computed path sends `"parameters": {"cache": false}`; the hit path repeats one request whose
result is cached after the first call. Writes cache.json and cache.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from loadtests.benchmarks.batching import CLIENT_CORE, free_port, machine, pinned, server, wrk
from loadtests.benchmarks.harness import write_results
from loadtests.benchmarks.models import MODELS, write_repository

CONCURRENCY = 16


def bodies(model: str, cache: bool) -> dict[str, tuple[bytes, dict[str, str]]]:
    """JSON and binary request bodies (and headers) for one input of `model`."""
    shape = [1, *MODELS[model][1]]
    data = np.random.default_rng(2).standard_normal(shape).astype(np.float32)
    parameters = {} if cache else {"cache": False}
    plain = {
        "parameters": parameters,
        "inputs": [
            {"name": "x", "shape": shape, "datatype": "FP32", "data": data.ravel().tolist()}
        ],
    }
    header = json.dumps(
        {
            "parameters": parameters,
            "inputs": [
                {
                    "name": "x",
                    "shape": shape,
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": data.nbytes},
                }
            ],
        }
    )
    return {
        "json": (json.dumps(plain).encode(), {}),
        "binary": (
            header.encode() + data.tobytes(),
            {"Inference-Header-Content-Length": str(len(header))},
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("loadtests/benchmarks/results"))
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    redis_binary = shutil.which("redis-server")
    if redis_binary is None or shutil.which("wrk") is None:
        sys.exit("needs redis-server and wrk (apt-get install redis-server wrk)")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        repo = write_repository(Path(tmp) / "models")
        config = repo / "cnn" / "config.yaml"
        config.write_text(config.read_text() + "cache: {enabled: true, ttl_s: 600}\n")
        redis_port = free_port()
        redis = subprocess.Popen(
            pinned(
                CLIENT_CORE,
                redis_binary,
                "--port",
                str(redis_port),
                "--save",
                "",
                "--appendonly",
                "no",
            ),
            stdout=subprocess.DEVNULL,
        )
        try:
            for backend in ("memory", "redis"):
                os.environ["SLUICE_CACHE__BACKEND"] = backend
                os.environ["SLUICE_CACHE__REDIS_URL"] = f"redis://127.0.0.1:{redis_port}/0"
                with server("sluice", repo) as (url, _grpc):
                    target = f"{url}/v2/models/cnn/infer"
                    for path, cache in (("computed", False), ("hit", True)):
                        for protocol, (body, headers) in bodies("cnn", cache).items():
                            result = wrk(target, body, CONCURRENCY, args.seconds, headers)
                            rows.append(
                                {"backend": backend, "path": path, "protocol": protocol, **result}
                            )
                            print(json.dumps(rows[-1]), flush=True)
        finally:
            redis.terminate()
            redis.wait(10)
    report = {"rows": rows, "machine": machine(), "concurrency": CONCURRENCY}
    write_results(args.out, "cache", report, table(report, args.seconds))


def table(report: dict[str, Any], seconds: float) -> str:
    computed = {
        (r["backend"], r["protocol"]): r["throughput"]
        for r in report["rows"]
        if r["path"] == "computed"
    }
    lines = [
        "# Result cache benchmark",
        "",
        f"Command: `python -m loadtests.benchmarks.cache --seconds {seconds:g}`; CNN "
        f"(3x64x64), {report['concurrency']} connections; sluice on core 0, wrk and "
        f"redis-server on core {CLIENT_CORE}; {report['machine']}.",
        "",
        "| backend | path | protocol | req/s | x computed | p50 ms | p99 ms | errors |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        ratio = r["throughput"] / computed[(r["backend"], r["protocol"])]
        lines.append(
            f"| {r['backend']} | {r['path']} | {r['protocol']} | {r['throughput']:,.0f} | "
            f"{ratio:.1f} | {r['p50_us'] / 1e3:.2f} | {r['p99_us'] / 1e3:.2f} | "
            f"{r['errors'] + r['non2xx']} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
