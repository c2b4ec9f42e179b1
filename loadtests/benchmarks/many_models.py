"""The many-models benchmark (issue 36): a repository of 200 MLPs of 0.3-30 MB of weights and
4 two-step pipelines, served under a memory budget of about a quarter of what they measure
loaded, with Zipf-distributed traffic (s=1.1) over HTTP at a fixed Poisson rate. In one run, on
the same trace: sluice with every model loaded at start (mode `none`: the warm-latency baseline,
and where each model's measured bytes come from), `on_demand` with LRU by bytes (sluice's rule),
`on_demand` with LRU by count (Ray Serve's multiplexing rule: `model_memory.max_models` = the
budget over the mean model's bytes, with the same byte budget), and the offline simulation of
the trace (loadtests/benchmarks/eviction_sim.py) with the measured sizes.

    python -m loadtests.benchmarks.many_models --out loadtests/benchmarks/results \
        [--seconds 180 | --quick] [--rate 20] [--server-cores 0 --client-cores 1]

Reported per server: hit ratio (requests that needed no load), cold-start p50/p99 (load and
first answer, from the client), warm p50/p99, evictions per second, the server's idle and peak
resident set (VmRSS once ready, VmHWM at the end), errors; then the targets met or missed. The
repository is written once into the temp folder and reused (`--cache`). With --server-cores and
--client-cores, the server runs under taskset and the load generator (this process) is pinned.
Writes many_models.json (every figure and the trace's settings) and many_models.md (the tables),
or --name's files."""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from loadtests.benchmarks.batching import machine
from loadtests.benchmarks.eviction_sim import RULES, simulate
from loadtests.benchmarks.harness import (
    free_port,
    http_ready,
    pinned,
    require,
    running,
    sluice_command,
    write_results,
)
from loadtests.benchmarks.many_models_repo import (
    Plan,
    Trace,
    cached_repository,
    make_trace,
    request_body,
)
from loadtests.benchmarks.many_models_stats import Answer, summarize, table
from loadtests.benchmarks.open_loop import Connections, ResponseError

HEADERS = {"Content-Type": "application/json"}
QUICK_S = 20.0
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@contextmanager
def server(repo: Path, cores: str | None, env: dict[str, str]) -> Iterator[tuple[str, int]]:
    """sluice on `repo` (with `env`), under taskset on `cores` when given, once ready: its URL
    and process id (taskset and env exec the server, so the id is the server's)."""
    port = free_port()
    command = [
        "env",
        *(f"{k}={v}" for k, v in env.items()),
        *sluice_command(repo, port, free_port()),
    ]
    if cores is not None:
        command = pinned(cores, *command)
    url = f"http://127.0.0.1:{port}"
    # Loading every model at start (mode none) takes a while.
    with running(command, http_ready(url + "/v2/health/ready"), "sluice", 900, 60) as process:
        yield url, process.pid


def status_bytes(pid: int, field: str) -> int:
    """A field of /proc/PID/status in bytes (VmRSS: resident now; VmHWM: the peak)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/{pid}/status")


def scrape(url: str) -> Samples:
    text = httpx.get(url + "/metrics", timeout=30).raise_for_status().text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def per_model(samples: Samples, name: str, **labels: str) -> dict[str, int]:
    """Samples of `name` (with `labels`) summed per `model` label."""
    totals: dict[str, int] = {}
    for (sample, pairs), value in samples.items():
        found = dict(pairs)
        if sample == name and all(found.get(k) == v for k, v in labels.items()):
            totals[found["model"]] = totals.get(found["model"], 0) + int(value)
    return totals


def cold_start_mean_ms(before: Samples, after: Samples) -> float:
    """The server's mean cold start between two scrapes (sluice_model_cold_start_seconds: from
    a request finding its model not resident to the model serving); NaN for none."""
    name = "sluice_model_cold_start_seconds"
    total, count = (
        after.get((f"{name}_{k}", ()), 0.0) - before.get((f"{name}_{k}", ()), 0.0)
        for k in ("sum", "count")
    )
    return total / count * 1e3 if count else math.nan


async def send(url: str, trace: Trace, drain_s: float) -> list[Answer]:
    """Each request of `trace` at its time, whatever the answers; latency from its scheduled
    time (a generator that falls behind does not hide the server's delay)."""
    bodies = {name: request_body(name) for name in set(trace.names)}
    connections = Connections(url)
    loop = asyncio.get_running_loop()
    start = loop.time() + 0.05
    answers: dict[int, Answer] = {}

    async def one(index: int, name: str, due: float) -> None:
        try:
            status = str(await connections.post(f"/v2/models/{name}/infer", bodies[name], HEADERS))
        except (OSError, ResponseError):
            status = "error"
        answers[index] = Answer(name, status, loop.time() - due)

    tasks = []
    try:
        for index, (offset, name) in enumerate(zip(trace.times, trace.names, strict=True)):
            wait = start + offset - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            tasks.append(asyncio.create_task(one(index, name, start + offset)))
        _done, pending = await asyncio.wait(tasks, timeout=drain_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    finally:
        await connections.close()
    given_up = loop.time()
    return [
        answers.get(i) or Answer(name, "unanswered", given_up - start - offset)
        for i, (offset, name) in enumerate(zip(trace.times, trace.names, strict=True))
    ]


def measure(
    repo: Path,
    trace: Trace,
    seconds: float,
    cores: str | None,
    env: dict[str, str],
    sizes: dict[str, int] | None = None,
) -> tuple[dict[str, Any], dict[str, int]]:
    """One server's run of `trace`: its figures (cold starts by size too with each model's
    measured `sizes`), and the bytes each model measured (summed over versions) in the last
    scrape."""
    with server(repo, cores, env) as (url, pid):
        idle = status_bytes(pid, "VmRSS")
        before = scrape(url)
        answers = asyncio.run(send(url, trace, drain_s=60))
        after = scrape(url)
        peak = status_bytes(pid, "VmHWM")
    loaded_before = per_model(before, "sluice_model_loads_total", outcome="loaded")
    loads = {
        model: count - loaded_before.get(model, 0)
        for model, count in per_model(after, "sluice_model_loads_total", outcome="loaded").items()
    }
    evictions = sum(per_model(after, "sluice_model_evictions_total").values()) - sum(
        per_model(before, "sluice_model_evictions_total").values()
    )
    rss = {"idle": idle, "peak": peak}
    summary = summarize(answers, loads, evictions, seconds, rss, sizes)
    summary["server_cold_mean_ms"] = cold_start_mean_ms(before, after)
    print(f"{env.get('SLUICE_MODEL_CONTROL_MODE', 'none')} {env}: {summary}", flush=True)
    return summary, per_model(after, "sluice_model_resident_bytes")


def unit_sizes(plan: Plan, resident: dict[str, int]) -> dict[str, int]:
    """What each requested model measured: a pipeline with its steps (they load with it)."""
    missing = [name for name in plan.weights() if name not in resident]
    if missing:
        raise RuntimeError(f"models not loaded by the all-loaded server: {missing[:5]}")
    sizes = {name: resident[name] for name in plan.targets() if name in resident}
    for pipeline, steps in plan.steps().items():
        sizes[pipeline] = resident.get(pipeline, 0) + sum(resident[step] for step in steps)
    return sizes


def check_memory(plan: Plan) -> None:
    """Exit before loading everything at start where the machine cannot hold it (loaded, a
    model costs about 1.3x its weights plus ~1.2 MB on CPU: docs/guides/many-models.md)."""
    weights = plan.weights()
    need = sum(weights.values()) * 1.5 + len(weights) * 2_000_000
    available = psutil.virtual_memory().available
    if need > 0.7 * available:
        sys.exit(
            f"the all-loaded server needs about {need / 1e9:.1f} GB and "
            f"{available / 1e9:.1f} GB is available: lower --models or --max-bytes"
        )


def cores_of(spec: str) -> set[int]:
    """A CPU list such as "0", "0-2" or "0,3" as a set."""
    cores: set[int] = set()
    for part in spec.split(","):
        first, _, last = part.partition("-")
        cores.update(range(int(first), int(last or first) + 1))
    return cores


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("loadtests/benchmarks/results"))
    parser.add_argument("--name", default="many_models")
    parser.add_argument("--seconds", type=float, default=180.0, help="each server's trace")
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_S:g} s traces")
    parser.add_argument("--rate", type=float, default=20.0, help="requests per second")
    parser.add_argument("--zipf", type=float, default=1.1)
    parser.add_argument("--budget-share", type=float, default=0.25)
    parser.add_argument("--models", type=int, default=200)
    parser.add_argument("--pipelines", type=int, default=4)
    parser.add_argument("--min-bytes", type=int, default=300_000, help="weights, smallest")
    parser.add_argument("--max-bytes", type=int, default=30_000_000, help="weights, largest")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--server-cores")
    parser.add_argument("--client-cores")
    args = parser.parse_args()
    if (args.server_cores is None) != (args.client_cores is None):
        parser.error("give both --server-cores and --client-cores, or neither")
    if args.quick:
        args.seconds = QUICK_S
    return args


def main() -> None:
    args = arguments()
    if args.server_cores is not None:
        require("taskset")
        os.sched_setaffinity(0, cores_of(args.client_cores))
    plan = Plan(args.models, args.pipelines, args.min_bytes, args.max_bytes, args.seed)
    check_memory(plan)
    started = time.monotonic()
    repo = cached_repository(plan, args.cache)
    print(f"repository {repo} ready in {time.monotonic() - started:.1f} s", flush=True)
    trace = make_trace(plan.targets(), args.rate, args.seconds, args.zipf, args.seed)
    runs: dict[str, dict[str, Any]] = {}
    runs["all_loaded"], resident = measure(repo, trace, args.seconds, args.server_cores, {})
    sizes = unit_sizes(plan, resident)
    budget = int(sum(sizes.values()) * args.budget_share)
    max_models = max(1, budget // max(1, round(sum(sizes.values()) / len(sizes))))
    on_demand = {
        "SLUICE_MODEL_CONTROL_MODE": "on_demand",
        "SLUICE_MODEL_MEMORY__HOST_BYTES": str(budget),
    }
    runs["lru_bytes"], _ = measure(repo, trace, args.seconds, args.server_cores, on_demand, sizes)
    by_count = {**on_demand, "SLUICE_MODEL_MEMORY__MAX_MODELS": str(max_models)}
    runs["lru_count"], _ = measure(repo, trace, args.seconds, args.server_cores, by_count, sizes)
    simulation = {}
    for rule in RULES:
        outcome = simulate(trace.names, sizes, budget, rule)
        simulation[rule] = {**asdict(outcome), "hit_ratio": outcome.hit_ratio}
    report = {
        "command": " ".join(["python -m loadtests.benchmarks.many_models", *sys.argv[1:]]),
        "machine": machine(),
        "plan": asdict(plan),
        "rate_rps": args.rate,
        "seconds": args.seconds,
        "zipf": args.zipf,
        "budget_share": args.budget_share,
        "budget_bytes": budget,
        "max_models": max_models,
        "repository_bytes": sum(sizes.values()),
        "sizes": sizes,
        "runs": runs,
        "simulation": simulation,
    }
    write_results(args.out, args.name, report, table(report))


if __name__ == "__main__":
    main()
