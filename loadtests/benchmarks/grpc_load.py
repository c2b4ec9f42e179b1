"""A closed-loop gRPC load generator for the benchmarks: N concurrent ModelInfer calls with raw
input contents, for a fixed time. Prints one JSON line: throughput, p50 and p99.

    taskset -c 1 python -m loadtests.benchmarks.grpc_load HOST:PORT MODEL CONCURRENCY SECONDS
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import grpc
import numpy as np

from loadtests.benchmarks.models import MODELS
from server.grpc.proto import grpc_service_pb2 as pb
from server.grpc.proto import grpc_service_pb2_grpc as pb_grpc


async def run(target: str, model: str, concurrency: int, seconds: float) -> dict[str, float]:
    shape = (1, *MODELS[model][1])
    data = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    request = pb.ModelInferRequest(
        model_name=model,
        inputs=[pb.ModelInferRequest.InferInputTensor(name="x", datatype="FP32", shape=shape)],
        raw_input_contents=[data.tobytes()],
    )
    latencies: list[float] = []
    errors = 0
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
        await stub.ModelInfer(request)  # connect and warm up
        stop = time.monotonic() + seconds

        async def worker() -> None:
            nonlocal errors
            while time.monotonic() < stop:
                started = time.monotonic()
                try:
                    await stub.ModelInfer(request)
                except grpc.aio.AioRpcError:
                    errors += 1
                    continue
                latencies.append(time.monotonic() - started)

        began = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.monotonic() - began
    lat = np.array(latencies or [0.0]) * 1e6  # all calls failed: report the errors, not a crash
    return {
        "requests": len(latencies) + errors,
        "duration_us": elapsed * 1e6,
        "errors": errors,
        "non2xx": 0,
        "p50_us": float(np.percentile(lat, 50)),
        "p99_us": float(np.percentile(lat, 99)),
        "throughput": len(latencies) / elapsed,
    }


if __name__ == "__main__":
    target, model, concurrency, seconds = sys.argv[1:5]
    print(json.dumps(asyncio.run(run(target, model, int(concurrency), float(seconds)))))
