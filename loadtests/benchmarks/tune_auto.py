"""The tuning benchmark's `max_queue_delay_s: auto` against a fixed 2 ms delay: rounds of the CNN
with `latency_target_s` set, alternated in the same run, at AUTO_USERS closed-loop users (locust)
and at fixed arrival rates (`open_loop`) under and over what the fixed delay served in the round.
Run by loadtests/benchmarks/tune.py (its `auto` part); its tables are in tune_tables.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
from pathlib import Path
from typing import Any

from loadtests.benchmarks.open_loop import run_open_loop
from loadtests.harness import LoadTestConfig, run_load_test
from loadtests.scrape import scrape, server_metrics
from loadtests.tune.server import ServerControl

AUTO_USERS = 64
TARGET_OVER_FLOOR = 1.5
"""`latency_target_s` of each round: this times the closed loop's floor, AUTO_USERS / the fixed
delay's req/s in the round. By Little's law a closed loop of N users waits N / throughput on
average whatever the server does, so no target below that floor can be met: auto could only shed,
and each shed user resends at once (the targets once fixed here, 0.1 and 0.4 s, were both under
a floor of ~0.6 s on this host). The floor moves 3x with the host's load, hence one per round,
and ~20% between two runs in a row, hence 1.5x (at 1.25x, auto shed 8-12% in half the rounds)."""
AUTO_MAX_BATCH = 32
AUTO_INSTANCES = 2
"""The CNN's batching in the auto vs fixed rounds. A delay only matters for a batch that forms
while another runs: with one instance and `dispatch_when_idle` a batch goes the moment the model
is free, under either delay, and at 64 users and batches of 8 every batch is full, so the two
delays sent the same batches (2026-12-01's first runs). With two instances and room for 32 rows,
the fixed delay sends what came in 2 ms beside the running batch; auto waits for the rows its
head's deadline allows (or for the running batch to end)."""
OPEN_LOADS = (0.8, 1.5)
"""Open-loop offered rates, as parts of the fixed delay's closed-loop req/s in the same round: a
busy server with bursts (Poisson arrivals), and one offered clearly more than it can serve (the
closed loop's req/s moves by a fifth between runs on this host, so 1.25x was not always over)."""


def auto_vs_fixed(
    url: str,
    seconds: int,
    rounds: int,
    work: Path,
    max_batch: int,
    instances: int,
    open_loads: tuple[float, ...] = OPEN_LOADS,
) -> dict[str, Any]:
    """Rounds of the CNN, served with `max_batch` and `instances`, under a fixed 2 ms delay and
    under auto: closed loop at AUTO_USERS users, then an unmeasured open-loop run, then each
    open-loop rate; fixed first in odd rounds and auto first in even ones, at each load. Auto's
    target and the open-loop rates come from the fixed delay's latest closed-loop req/s (round
    1 measures it before anything else)."""
    control = ServerControl(url, "cnn")
    original = control.original()
    base = {**original.config, "max_batch_size": max_batch, "instances": instances}
    batching = dict(base.get("dynamic_batching", {}))
    fixed = {**base, "dynamic_batching": {**batching, "max_queue_delay_s": 0.002}}

    def auto(target_s: float) -> dict[str, Any]:
        delay = {**batching, "max_queue_delay_s": "auto", "latency_target_s": target_s}
        return {**base, "dynamic_batching": delay}

    load = LoadTestConfig(
        url=url,
        model="cnn",
        protocol="http-binary",
        users=[AUTO_USERS],
        duration_s=seconds,
        out=work,
        max_error_fraction=1.0,
        slo_p99_ms=None,
    )
    closed: list[dict[str, Any]] = []
    opened: list[dict[str, Any]] = []
    target_s = capacity = 0.0
    try:
        for round_ in range(1, rounds + 1):
            names = ("fixed 2 ms", "auto") if round_ % 2 else ("auto", "fixed 2 ms")
            for name in names:
                control.load(fixed if name != "auto" else auto(target_s))
                out = work / f"{round_}-closed-{name.split()[0]}"
                step = run_load_test(dataclasses.replace(load, out=out)).steps[0]
                server = step.server
                row = {
                    "round": round_,
                    "delay": name,
                    "target_s": target_s if name == "auto" else None,
                    "ok_rps": step.total.ok_rps,
                    "p50_ms": step.total.latency.p50_ms,
                    "p99_ms": step.total.latency.p99_ms,
                    "error_fraction": step.error_fraction,
                    "errors": dict(step.errors),
                    "generator_cpu_bound": step.generator_cpu_bound,
                    "mean_batch_rows": server.batch_size.mean
                    if server and server.batch_size
                    else None,
                }
                closed.append(row)
                if name != "auto":
                    floor_s = AUTO_USERS / max(step.total.ok_rps, 1.0)
                    target_s = round(TARGET_OVER_FLOOR * floor_s, 3)
                    capacity = step.total.ok_rps
            # Whichever delay ran first after the closed loop had a tail at 0.8x that the second
            # did not (p99 226-576 against 27-53 ms): an unmeasured open-loop run absorbs that.
            control.load(fixed)
            if open_loads:
                warm = open_loads[0] * capacity
                asyncio.run(run_open_loop(url, "cnn", warm, 3.0, warmup_s=0.5))
            for part in open_loads:
                rate = round(part * capacity, 1)
                pair = [("fixed 2 ms", fixed), ("auto", auto(target_s))]
                for name, config in pair if round_ % 2 else pair[::-1]:
                    control.load(config)
                    before = scrape(url + "/metrics", {})
                    result = asyncio.run(run_open_loop(url, "cnn", rate, seconds, seed=round_))
                    server = server_metrics(before, scrape(url + "/metrics", {}), "cnn")
                    opened.append(
                        {
                            "round": round_,
                            "load": part,
                            "delay": name,
                            "target_s": target_s,
                            **result.summary(target_s),
                            "mean_batch_rows": server.batch_size.mean
                            if server.batch_size
                            else None,
                        }
                    )
                    print(f"round {round_}: {part:g}x {name}: {opened[-1]}", file=sys.stderr)
    finally:
        control.restore(original)
    return {"max_batch": max_batch, "instances": instances, "closed": closed, "open": opened}
