"""The batching benchmark: sluice vs the limit (raw in-process ONNX Runtime at its best batch size)
vs a plain FastAPI + onnxruntime server vs the HTTP floor, all in one run, each server pinned to
core 0 and the load generator (wrk; a grpc.aio client for gRPC) to core 1.

    python -m loadtests.benchmarks.batching --out loadtests/benchmarks/results [--seconds 10]

Writes batching.json (every measurement) and batching.md (the table). Needs `wrk` and `taskset`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from loadtests.benchmarks.harness import free_port as free_port  # other benchmarks import it here
from loadtests.benchmarks.harness import markdown_table, pinned, require, serving, write_results
from loadtests.benchmarks.models import MODELS, write_repository

SERVER_CORE, CLIENT_CORE = "0", "1"
CONCURRENCY = (1, 16, 64)
LUA = """
wrk.method = "POST"
local f = io.open("{body}", "rb"); wrk.body = f:read("*a"); f:close()
wrk.headers["Content-Type"] = "{content_type}"
{extra_headers}
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format('RESULT {{"requests": %d, "duration_us": %d, "errors": %d, ' ..
    '"non2xx": %d, "p50_us": %d, "p99_us": %d}}\\n', summary.requests, summary.duration,
    e.connect + e.read + e.write + e.timeout, e.status, latency:percentile(50),
    latency:percentile(99)))
end
"""


@contextmanager
def server(kind: str, repo: Path) -> Iterator[tuple[str, str]]:
    """Start one server pinned to SERVER_CORE; yield its base URL and gRPC target."""
    with serving(kind, repo, SERVER_CORE) as served:
        yield served.url, served.grpc_target


def json_body(model: str) -> bytes:
    shape = (1, *MODELS[model][1])
    data = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    payload = {
        "inputs": [
            {"name": "x", "shape": list(shape), "datatype": "FP32", "data": data.ravel().tolist()}
        ]
    }
    return json.dumps(payload).encode()


def binary_body(model: str) -> tuple[bytes, int]:
    shape = (1, *MODELS[model][1])
    data = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "x",
                    "shape": list(shape),
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": data.nbytes},
                }
            ],
            "outputs": [
                {"name": next(iter(output_names(model))), "parameters": {"binary_data": True}}
            ],
        }
    ).encode()
    return header + data.tobytes(), len(header)


def output_names(model: str) -> list[str]:
    return ["probabilities"] if model == "mlp" else ["logits"]


def wrk(
    url: str,
    body: bytes,
    concurrency: int,
    seconds: float,
    headers: dict[str, str],
    core: str | None = CLIENT_CORE,
) -> dict[str, Any]:
    """Closed-loop POSTs with wrk (pinned to `core`, or anywhere when None)."""
    with tempfile.TemporaryDirectory() as tmp:
        body_path = Path(tmp) / "body"
        body_path.write_bytes(body)
        extra = "\n".join(f'wrk.headers["{k}"] = "{v}"' for k, v in headers.items())
        script = Path(tmp) / "post.lua"
        script.write_text(
            LUA.format(body=body_path, content_type="application/json", extra_headers=extra)
        )
        return run_wrk(script, url, concurrency, seconds, core)


def run_wrk(
    script: Path, url: str, concurrency: int, seconds: float, core: str | None = CLIENT_CORE
) -> dict[str, Any]:
    """wrk with one thread and a Lua `script` whose `done` prints `RESULT <json>` (pinned to
    `core`, or anywhere when None): its result, with the answered requests per second."""
    out = subprocess.run(
        [
            *(pinned(core, "wrk") if core else ["wrk"]),
            "-t1",
            f"-c{concurrency}",
            f"-d{max(1, round(seconds))}s",
            "--timeout",
            "10s",
            "-s",
            str(script),
            url,
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    result: dict[str, Any] = json.loads(out.split("RESULT ", 1)[1].splitlines()[0])
    result["throughput"] = (result["requests"] - result["non2xx"]) / (result["duration_us"] / 1e6)
    return result


def grpc_load(
    target: str, model: str, concurrency: int, seconds: float, core: str = CLIENT_CORE
) -> dict[str, Any]:
    """The grpc.aio load generator (loadtests/benchmarks/grpc_load.py), pinned to `core`."""
    out = subprocess.run(
        pinned(
            core,
            sys.executable,
            "-m",
            "loadtests.benchmarks.grpc_load",
            target,
            model,
            str(concurrency),
            str(seconds),
        ),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return dict(json.loads(out.strip().splitlines()[-1]))


def raw_limit(repo: Path, model: str) -> list[dict[str, float]]:
    out = subprocess.run(
        pinned(SERVER_CORE, sys.executable, "-m", "loadtests.benchmarks.raw", str(repo), model),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("loadtests/benchmarks/results"))
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    require("wrk", "taskset")
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        repo = write_repository(Path(tmp))
        limits = {model: raw_limit(repo, model) for model in MODELS}
        for kind in ("sluice", "plain", "floor"):
            with server(kind, repo) as (url, grpc_target):
                for model in MODELS if kind != "floor" else ["mlp"]:
                    for concurrency in CONCURRENCY:
                        target = f"{url}/v2/models/{model}/infer"
                        result = wrk(target, json_body(model), concurrency, args.seconds, {})
                        rows.append(
                            {
                                "server": kind,
                                "protocol": "json",
                                "model": model,
                                "concurrency": concurrency,
                                **result,
                            }
                        )
                        print(json.dumps(rows[-1]), flush=True)
                        if kind == "sluice":
                            body, length = binary_body(model)
                            headers = {"Inference-Header-Content-Length": str(length)}
                            result = wrk(target, body, concurrency, args.seconds, headers)
                            rows.append(
                                {
                                    "server": kind,
                                    "protocol": "binary",
                                    "model": model,
                                    "concurrency": concurrency,
                                    **result,
                                }
                            )
                            print(json.dumps(rows[-1]), flush=True)
                            result = grpc_load(grpc_target, model, concurrency, args.seconds)
                            rows.append(
                                {
                                    "server": kind,
                                    "protocol": "grpc",
                                    "model": model,
                                    "concurrency": concurrency,
                                    **result,
                                }
                            )
                            print(json.dumps(rows[-1]), flush=True)
    report = {"limits": limits, "rows": rows, "machine": machine()}
    write_results(args.out, "batching", report, table(report, args))


def machine() -> dict[str, Any]:
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
    }


def table(report: dict[str, Any], args: argparse.Namespace) -> str:
    limits = {m: max(r["samples_per_s"] for r in rows) for m, rows in report["limits"].items()}
    best = {
        m: max(rows, key=lambda r: r["samples_per_s"])["batch"]
        for m, rows in report["limits"].items()
    }
    plain = {
        (r["model"], r["concurrency"]): r["throughput"]
        for r in report["rows"]
        if r["server"] == "plain"
    }
    lines = [
        "# Batching benchmark",
        "",
        f"Command: `python -m loadtests.benchmarks.batching --seconds {args.seconds:g}`; "
        f"servers on core {SERVER_CORE}, load generator on core {CLIENT_CORE}; "
        f"{report['machine']}.",
        "",
        "Raw ONNX Runtime (the limit, one thread): "
        + "; ".join(f"{m} {limits[m]:,.0f} samples/s at batch {best[m]}" for m in limits),
        "",
    ]
    columns = [
        "server",
        "protocol",
        "model",
        "concurrency",
        "req/s",
        "% of limit",
        "x plain FastAPI",
        "p50 ms",
        "p99 ms",
        "errors",
    ]
    cells = []
    for r in report["rows"]:
        base = plain.get((r["model"], r["concurrency"]))
        vs_plain = f"{r['throughput'] / base:.2f}" if base and r["server"] != "plain" else "-"
        pct = (
            f"{100 * r['throughput'] / limits[r['model']]:.1f}%" if r["server"] != "floor" else "-"
        )
        cells.append(
            [
                r["server"],
                r["protocol"],
                r["model"],
                r["concurrency"],
                f"{r['throughput']:,.0f}",
                pct,
                vs_plain,
                f"{r['p50_us'] / 1e3:.2f}",
                f"{r['p99_us'] / 1e3:.2f}",
                r["errors"] + r["non2xx"],
            ]
        )
    lines += markdown_table(columns, cells)
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
