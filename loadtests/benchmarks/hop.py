"""The worker hop's own CPU cost (issue 14): requests for the benchmark MLP through a worker's
RemoteEngine, the control socket and the shared arenas to an EngineHost and its Engine, all in
one process on one core, against the same requests given to the Engine directly. The
difference per request is what crossing between a worker and the engine costs in Python, on
both sides together, before any second process is involved: no scheduler turns, no wake-ups,
no caches shared with another process. On a machine where every process has its own core,
that is what `--workers` adds to each request's CPU.

    python -m loadtests.benchmarks.hop --out loadtests/benchmarks/results [--rounds 5]

Both paths run in one uvloop loop with the collector tuned as the server's processes tune it
(server.server.tune_gc); each round measures them in turn at each concurrency (requests
submitted together), so the two figures a difference compares are taken moments apart.
Writes hop.json (every measurement) and hop.md (medians, with the range in brackets)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import uvloop

from engine.engine import Engine
from engine.types import InferRequest, InferResponse
from loadtests.benchmarks.batching import machine
from loadtests.benchmarks.harness import markdown_table, spread, write_results
from loadtests.benchmarks.models import MODELS, write_repository
from server.link.host import EngineHost
from server.link.remote import RemoteEngine
from server.link.shm.arena import Arena
from server.server import tune_gc
from server.settings import load_settings

CONCURRENCY = (1, 16, 64)
ARENA_BYTES = 8 << 20
MODEL = "mlp"

Infer = Callable[[InferRequest], Awaitable[InferResponse]]


async def cpu_us_per_request(
    infer: Infer, make: Callable[[], InferRequest], concurrency: int, requests: int
) -> float:
    """Process CPU µs per request over `requests` requests, `concurrency` at a time."""
    rounds = max(1, requests // concurrency)
    started = time.process_time()
    for _ in range(rounds):
        await asyncio.gather(*(infer(make()) for _ in range(concurrency)))
    return (time.process_time() - started) / (rounds * concurrency) * 1e6


async def measure(repo: Path, socket_dir: str, rounds: int, requests: int) -> list[dict[str, Any]]:
    settings = load_settings(model_repository=repo)
    engine = Engine(settings)
    worker_side = (Arena(ARENA_BYTES), Arena(ARENA_BYTES))
    engine_side = (
        Arena(ARENA_BYTES, os.dup(worker_side[0].fd)),
        Arena(ARENA_BYTES, os.dup(worker_side[1].fd)),
    )
    host = EngineHost(engine, [engine_side])
    path = os.path.join(socket_dir, "engine.sock")
    await engine.start()
    await host.serve(path)
    remote = RemoteEngine(settings, path, 0, worker_side)
    await remote.start()
    name = (await engine.model_metadata(MODEL)).inputs[0].name
    x = np.random.default_rng(1).standard_normal((1, *MODELS[MODEL][1])).astype(np.float32)

    def make() -> InferRequest:
        return InferRequest(MODEL, {name: x.copy()}, {name: "FP32"})

    paths: dict[str, Infer] = {"direct": engine.infer, "remote": remote.infer}
    rows: list[dict[str, Any]] = []
    try:
        direct, through = [(await infer(make())).outputs for infer in paths.values()]
        if direct.keys() != through.keys() or not all(
            np.array_equal(direct[k], through[k]) for k in direct
        ):
            raise AssertionError("the hop answered differently from the engine")
        tune_gc()
        for infer in paths.values():  # warm both paths (first batches, the inline-run choice)
            await cpu_us_per_request(infer, make, 16, 2_000)
        for round_ in range(rounds):
            for concurrency in CONCURRENCY:
                for kind, infer in paths.items():
                    us = await cpu_us_per_request(infer, make, concurrency, requests)
                    rows.append(
                        {"round": round_, "path": kind, "concurrency": concurrency, "cpu_us": us}
                    )
                    print(json.dumps(rows[-1]), flush=True)
    finally:
        await remote.close()
        await host.close()
        await engine.close()
    return rows


def table(report: dict[str, Any]) -> str:
    def figures(path: str, concurrency: int) -> list[float]:
        return [
            r["cpu_us"]
            for r in report["rows"]
            if r["path"] == path and r["concurrency"] == concurrency
        ]

    cells = []
    for concurrency in CONCURRENCY:
        direct, remote = figures("direct", concurrency), figures("remote", concurrency)
        hop = [r - d for d, r in zip(direct, remote, strict=True)]
        ratio = [r / d for d, r in zip(direct, remote, strict=True)]
        cells.append(
            [
                concurrency,
                spread(direct, "{:.1f}"),
                spread(remote, "{:.1f}"),
                spread(hop, "{:.1f}"),
                spread(ratio, "{:.2f}"),
            ]
        )
    lines = [
        "# Worker hop benchmark",
        "",
        f"Command: `python -m loadtests.benchmarks.hop --rounds {report['rounds']} --requests "
        f"{report['requests']}`; the benchmark MLP, one process pinned to one core, "
        f"{report['machine']}. CPU µs per request, median of the rounds with the range in "
        "brackets. direct: the Engine's own `infer`; through the hop: a worker's RemoteEngine, "
        "the control socket and the arenas, the EngineHost, then the same Engine; the hop: "
        "the difference, both sides of the crossing together.",
        "",
    ]
    columns = ["concurrency", "direct µs", "through the hop µs", "the hop µs", "x direct"]
    lines += markdown_table(columns, cells)
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("loadtests/benchmarks/results"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=6_400)
    args = parser.parse_args()
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core: no turns to hand over
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory(dir="/tmp") as sock:
        repo = write_repository(Path(tmp))
        rows = uvloop.run(measure(repo, sock, args.rounds, args.requests))
    report = {"rows": rows, "machine": machine(), "rounds": args.rounds, "requests": args.requests}
    write_results(args.out, "hop", report, table(report))


if __name__ == "__main__":
    main()
