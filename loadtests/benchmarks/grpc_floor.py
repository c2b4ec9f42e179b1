"""gRPC per-call cost: sluice's ModelInfer on the tiny MLP against grpc.aio's own floor (a no-op
servicer answering a fixed ModelInferResponse of the same shape), in one run, each server pinned
to core 0 and the grpc.aio load generator (loadtests/benchmarks/grpc_load.py) to core 1.

    python -m loadtests.benchmarks.grpc_floor [--out DIR] [--seconds 5] [--rounds 5]

The machine may be shared, so the floor and sluice are measured alternately for `--rounds`
rounds; the table gives each figure's median and range, and sluice's calls/s as a ratio of the
floor's in the same round. Writes grpc_floor.json and grpc_floor.md. Needs taskset.

    python -m loadtests.benchmarks.grpc_floor --serve-floor PORT [--request-id] [--uvloop]
        (the floor server alone)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import uvloop

from loadtests.benchmarks.batching import SERVER_CORE, grpc_load, machine
from loadtests.benchmarks.harness import (
    cpu_s,
    free_port,
    markdown_table,
    pinned,
    require,
    running,
    sluice_command,
    write_results,
)
from loadtests.benchmarks.models import MLP_SIZES, write_repository
from server.grpc.proto import grpc_service_pb2 as pb
from server.grpc.proto import grpc_service_pb2_grpc as pb_grpc

MODEL = "mlp"
CONCURRENCY = 16
KINDS = ("floor", "floor+id", "floor+id-uvloop", "sluice", "sluice-window")
"""`floor+id` is the floor that also reads the call's metadata and deadline and sends a request
id as trailing metadata, as every sluice call does: what those grpc calls cost by themselves.
`floor+id-uvloop` is that floor on uvloop's event loop, which sluice runs on (the floor is
grpc.aio's default, asyncio's own loop): what the same grpc work costs under sluice's loop.
`sluice-window` is sluice with `dispatch_when_idle: false`: each batch waits its 2 ms window
instead of leaving at once when the model is idle, so calls share batches."""


class FloorServicer(pb_grpc.GRPCInferenceServiceServicer):
    """The least a grpc.aio ModelInfer can do: return one prebuilt answer of the MLP's shape."""

    def __init__(self, request_id: bool = False) -> None:
        self.request_id = request_id
        self.answer = pb.ModelInferResponse(model_name=MODEL, model_version="1")
        classes = MLP_SIZES[-1]
        self.answer.outputs.add(name="probabilities", datatype="FP32", shape=[1, classes])
        self.answer.raw_output_contents.append(np.full(classes, 0.1, np.float32).tobytes())

    async def ModelInfer(self, request: Any, context: Any) -> Any:
        if self.request_id:  # what every sluice call does besides its own work (see the table)
            context.invocation_metadata()
            context.time_remaining()
            context.set_trailing_metadata((("x-request-id", os.urandom(16).hex()),))
        return self.answer


async def serve_floor(port: int, request_id: bool) -> None:
    server = grpc.aio.server()
    servicer = FloorServicer(request_id)
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


@contextmanager
def started(kind: str, repos: dict[str, Path]) -> Iterator[tuple[str, int, str]]:
    """One server pinned to SERVER_CORE; yields its gRPC target, pid and HTTP URL (sluice's)
    once it answers ModelInfer."""
    port, http_port = free_port(), free_port()
    if kind in repos:
        command = sluice_command(repos[kind], http_port, port)
    else:
        command = [
            sys.executable,
            "-m",
            "loadtests.benchmarks.grpc_floor",
            "--serve-floor",
            str(port),
            *(["--request-id"] if kind.startswith("floor+id") else []),
            *(["--uvloop"] if kind.endswith("uvloop") else []),
        ]
    target = f"127.0.0.1:{port}"
    with running(pinned(SERVER_CORE, *command), lambda: _answers(target), f"{kind} server") as p:
        yield target, p.pid, f"http://127.0.0.1:{http_port}"


def _answers(target: str) -> bool:
    request = pb.ModelInferRequest(model_name=MODEL)
    features = MLP_SIZES[0]
    request.inputs.add(name="x", datatype="FP32", shape=[1, features])
    request.raw_input_contents.append(bytes(features * 4))
    try:
        with grpc.insecure_channel(target) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
            stub.ModelInfer(request, timeout=2.0)
    except grpc.RpcError:
        return False
    return True


def mean_batch(url: str) -> float:
    """Requests per batch the model ran (Triton statistics: inferences over executions)."""
    stats = httpx.get(f"{url}/v2/models/{MODEL}/stats", timeout=5).json()["model_stats"][0]
    return float(stats["inference_count"]) / max(1, int(stats["execution_count"]))


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("loadtests/benchmarks/results"))
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=CONCURRENCY)
    parser.add_argument("--serve-floor", type=int, metavar="PORT")
    parser.add_argument("--request-id", action="store_true", help="with --serve-floor: floor+id")
    parser.add_argument("--uvloop", action="store_true", help="with --serve-floor: on uvloop")
    args = parser.parse_args()
    if args.serve_floor is not None:
        run = uvloop.run if args.uvloop else asyncio.run
        run(serve_floor(args.serve_floor, args.request_id))
        return
    require("taskset")
    args.out.mkdir(parents=True, exist_ok=True)
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        repos = {"sluice": write_repository(Path(tmp) / "idle")}
        repos["sluice-window"] = write_repository(Path(tmp) / "window")
        for config in repos["sluice-window"].glob("*/config.yaml"):
            text = config.read_text().replace(
                "dynamic_batching:\n", "dynamic_batching:\n  dispatch_when_idle: false\n"
            )
            config.write_text(text)
        for index in range(args.rounds):
            measured: dict[str, Any] = {"round": index}
            for kind in KINDS:
                with started(kind, repos) as (target, pid, url):
                    before = cpu_s(pid)
                    result = grpc_load(target, MODEL, args.concurrency, args.seconds)
                    calls = max(result["requests"], 1)
                    result["server_cpu_us_per_call"] = (cpu_s(pid) - before) / calls * 1e6
                    if kind in repos:
                        result["mean_batch"] = mean_batch(url)
                    measured[kind] = result
            measured["ratio"] = measured["sluice"]["throughput"] / measured["floor"]["throughput"]
            rounds.append(measured)
            print(json.dumps(measured), flush=True)
    report = {
        "model": MODEL,
        "concurrency": args.concurrency,
        "seconds": args.seconds,
        "rounds": rounds,
        "machine": machine(),
        "command": "python -m loadtests.benchmarks.grpc_floor " + " ".join(sys.argv[1:]),
    }
    write_results(args.out, "grpc_floor", report, table(report))


def table(report: dict[str, Any]) -> str:
    rounds = report["rounds"]
    lines = [
        "# gRPC per-call cost: sluice against grpc.aio's floor",
        "",
        f"`{report['command']}`: ModelInfer on `{report['model']}` (batch 1, raw contents), "
        f"{report['concurrency']} concurrent calls for {report['seconds']:g} s per server, server "
        f"on core 0, grpc.aio client on core 1, {len(rounds)} rounds (median, min-max); "
        f"{report['machine']}.",
        "",
    ]
    columns = [
        "server",
        "calls/s",
        "of the floor",
        "server CPU µs per call",
        "requests per batch",
        "p50 µs",
        "p99 µs",
    ]
    cells = []
    for kind in KINDS:
        calls = summary([r[kind]["throughput"] for r in rounds])
        ratio = summary([r[kind]["throughput"] / r["floor"]["throughput"] for r in rounds])
        cpu = statistics.median(r[kind]["server_cpu_us_per_call"] for r in rounds)
        p50 = statistics.median(r[kind]["p50_us"] for r in rounds)
        p99 = statistics.median(r[kind]["p99_us"] for r in rounds)
        batch = [r[kind]["mean_batch"] for r in rounds if "mean_batch" in r[kind]]
        per_batch = f"{statistics.median(batch):.2f}" if batch else "-"
        cells.append(
            [
                kind,
                f"{calls['median']:,.0f} ({calls['min']:,.0f}-{calls['max']:,.0f})",
                f"{ratio['median']:.0%} ({ratio['min']:.0%}-{ratio['max']:.0%})",
                f"{cpu:,.0f}",
                per_batch,
                f"{p50:,.0f}",
                f"{p99:,.0f}",
            ]
        )
    lines += markdown_table(columns, cells)
    lines += [
        "",
        "`of the floor`: calls/s over the floor's in the same round. Server CPU per call is the "
        "server process's user + system time (every thread) over the calls it answered, so it "
        "holds when the machine is shared. `floor+id` also reads the call's metadata and "
        "deadline and sends an `x-request-id` trailer, as every sluice call does; "
        "`floor+id-uvloop` is that floor on uvloop, the event loop sluice runs on. "
        "`sluice-window`: the same sluice with `dispatch_when_idle: false`, so every batch waits "
        "its 2 ms window. By default an idle model sends a batch at once unless its callers have "
        "been coming together (grpc.aio hands the loop one call at a time): then it waits for as "
        "many as its last idle batch gathered.",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
