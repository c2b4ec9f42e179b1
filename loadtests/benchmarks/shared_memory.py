"""Client shared memory against binary HTTP and gRPC, in one run: sluice pinned to core 0,
perf_analyzer (the load generator) to core 1, the limit (raw in-process ONNX Runtime at its best
batch size) measured on core 0 in the same run.

    python -m loadtests.benchmarks.shared_memory --out loadtests/benchmarks/results [--seconds 10]

Two loads: the CNN (3x64x64, batch 1) at 1, 16 and 64 concurrent clients, as samples/s and % of
the limit; and a large input through a light model (3x224x224 FP32, batch 8, a global average
pool), where moving the bytes is the cost, as requests/s. Each row gives the server's CPU per
request (the process's user + system time over the run, over the requests its statistics
counted). JSON bodies are not among them: perf_analyzer sends tensors as binary data (the
batching benchmark measures JSON with wrk). Writes shared_memory.json and shared_memory.md.
Needs perf_analyzer (`./dev.sh test` installs it) and taskset.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx
import onnx
from onnx import TensorProto, helper

from loadtests.benchmarks.harness import (
    cpu_s,
    markdown_table,
    pinned,
    require,
    serving,
    write_results,
)
from loadtests.benchmarks.models import write_repository

SERVER_CORE, CLIENT_CORE = "0", "1"
CONCURRENCY = (1, 16, 64)
LARGE = (3, 224, 224)
PROTOCOLS = {
    "system shared memory (HTTP)": ["-i", "http", "--shared-memory", "system"],
    "system shared memory (gRPC)": ["-i", "grpc", "--shared-memory", "system"],
    "binary HTTP": ["-i", "http"],
    "gRPC": ["-i", "grpc"],
}
PERF_ANALYZER = Path(sys.executable).parent / "perf_analyzer"
THROUGHPUT = re.compile(r"Concurrency: (\d+), throughput: ([\d.]+) infer/sec")


def pool_model() -> onnx.ModelProto:
    """`x` FP32 [-1, 3, 224, 224] -> global average pool -> `y` [-1, 3, 1, 1]: almost no compute
    per byte, so the cost is moving the input."""
    graph = helper.make_graph(
        [helper.make_node("GlobalAveragePool", ["x"], ["y"])],
        "pool",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", *LARGE])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3, 1, 1])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def repository(root: Path) -> Path:
    write_repository(root)
    (root / "pool" / "1").mkdir(parents=True, exist_ok=True)
    onnx.save(pool_model(), root / "pool" / "1" / "model.onnx")
    (root / "pool" / "config.yaml").write_text("max_batch_size: 8\n")
    return root


def limit(repo: Path) -> dict[str, float]:
    """Raw ONNX Runtime's best samples/s of the CNN on SERVER_CORE, and at which batch size."""
    command = pinned(
        SERVER_CORE, sys.executable, "-m", "loadtests.benchmarks.raw", str(repo), "cnn"
    )
    lines = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    rows = [json.loads(line) for line in lines.splitlines() if line.strip()]
    best = max(rows, key=lambda row: row["samples_per_s"])
    return {"batch": best["batch"], "samples_per_s": best["samples_per_s"]}


def successes(url: str, model: str) -> int:
    stats = httpx.get(f"{url}/v2/models/{model}/stats", timeout=10).json()["model_stats"]
    return sum(int(s["inference_stats"]["success"]["count"]) for s in stats)


def run(
    served: Any, model: str, batch: int, concurrency: int, options: list[str], seconds: float
) -> dict[str, Any]:
    """One perf_analyzer run: its throughput (samples/s) and the server's CPU per request."""
    url = served.grpc_target if "grpc" in options else served.url.removeprefix("http://")
    command = pinned(
        CLIENT_CORE,
        str(PERF_ANALYZER),
        "-m",
        model,
        "-u",
        url,
        "-b",
        str(batch),
        *options,
        "--concurrency-range",
        str(concurrency),
        "--measurement-interval",
        str(int(seconds * 1000)),
        "--output-shared-memory-size",
        "1048576",
        "--stability-percentage",
        "999",
        "--max-trials",
        "3",
    )
    before_cpu, before = cpu_s(served.pid), successes(served.url, model)
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    cpu, requests = cpu_s(served.pid) - before_cpu, successes(served.url, model) - before
    found = THROUGHPUT.search(done.stdout)
    if done.returncode != 0 or found is None:
        raise RuntimeError(f"perf_analyzer failed: {done.stdout[-2000:]}{done.stderr[-2000:]}")
    return {
        "samples_per_s": float(found[2]),
        "requests": requests,
        "cpu_us_per_request": cpu / max(requests, 1) * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("loadtests/benchmarks/results"))
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, nargs="+", default=list(CONCURRENCY))
    args = parser.parse_args()
    require("taskset")
    if not PERF_ANALYZER.exists():
        sys.exit(f"{PERF_ANALYZER} is needed (./dev.sh test installs it)")
    with tempfile.TemporaryDirectory() as tmp:
        repo = repository(Path(tmp) / "repo")
        ceiling = limit(repo)
        results: list[dict[str, Any]] = []
        os.environ["SLUICE_SHARED_MEMORY__ENABLED"] = "true"  # the server inherits it
        with serving("sluice", repo, SERVER_CORE) as served:
            for name, options in PROTOCOLS.items():
                for concurrency in args.concurrency:
                    row = run(served, "cnn", 1, concurrency, options, args.seconds)
                    row.update(load="cnn", protocol=name, concurrency=concurrency)
                    row["of_limit"] = row["samples_per_s"] / ceiling["samples_per_s"]
                    results.append(row)
                row = run(served, "pool", 8, 16, options, args.seconds)
                row.update(load="large", protocol=name, concurrency=16)
                row["requests_per_s"] = row["samples_per_s"] / 8
                results.append(row)
    cnn = [
        [
            r["protocol"],
            r["concurrency"],
            f"{r['samples_per_s']:,.0f}",
            f"{r['of_limit']:.0%}",
            f"{r['cpu_us_per_request']:,.0f}",
        ]
        for r in results
        if r["load"] == "cnn"
    ]
    large = [
        [r["protocol"], f"{r['requests_per_s']:,.1f}", f"{r['cpu_us_per_request']:,.0f}"]
        for r in results
        if r["load"] == "large"
    ]
    limit_line = (
        f"Limit: raw ONNX Runtime, {ceiling['samples_per_s']:,.0f} samples/s at batch "
        f"{ceiling['batch']} on core {SERVER_CORE}."
    )
    table = "\n".join(
        [
            "# Client shared memory vs binary HTTP and gRPC",
            "",
            limit_line,
            "",
            "CNN (3x64x64, batch 1):",
            "",
            *markdown_table(
                ["protocol", "clients", "samples/s", "of limit", "server CPU µs/request"], cnn
            ),
            "",
            "Large input (3x224x224 FP32, batch 8, global average pool), 16 clients:",
            "",
            *markdown_table(["protocol", "requests/s", "server CPU µs/request"], large),
            "",
        ]
    )
    report = {"limit": ceiling, "seconds": args.seconds, "results": results}
    write_results(args.out, "shared_memory", report, table)


if __name__ == "__main__":
    main()
