"""The tuning benchmark, in one run on this machine: `sluice tune` on the compute-bound CNN and
the overhead-bound MLP (req/s at one p99 SLO each, the tuned winner against the default config,
both measured in the tune's own final round, then again in `--confirm-rounds` alternating
rounds), then `max_queue_delay_s: auto` against a fixed 2 ms delay on the CNN with
`latency_target_s` set, alternated in rounds of the same run: at 64 closed-loop users (locust)
and at two fixed arrival rates (`open_loop`), under and over what the fixed delay served in the
round. The server is pinned to core 0 (`--server-cores` to change it; the tune is told how many
cores it has); this process, and so the load generators it runs (locust, the open loop, the
tune), to core 1.

    python -m loadtests.benchmarks.tune --out loadtests/benchmarks/results [--budget-s 240]
        [--server-cores 0-1] [--confirm-rounds 5]

Writes tune.json (every measurement) and tune.md (the tables); each tune's own report folder is
kept under --work (default: a temporary folder).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from loadtests.benchmarks.batching import CLIENT_CORE, SERVER_CORE
from loadtests.benchmarks.harness import free_port, pinned, spread
from loadtests.benchmarks.models import MAX_BATCH, write_repository
from loadtests.benchmarks.open_loop import run_open_loop
from loadtests.harness import LoadTestConfig, run_load_test
from loadtests.plan import parse_ramp
from loadtests.scrape import scrape, server_metrics
from loadtests.tune.search import Trial
from loadtests.tune.server import Original, ServerControl
from loadtests.tune.trial import HarnessTrials

SLO_MS = {"cnn": 150.0, "mlp": 20.0}
"""One p99 SLO per model: the CNN's default reaches ~200 ms at 64 users, the MLP's ~10 ms."""
RAMP = "4:64:x4"
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
CONFIRM_ROUNDS = 5
OPEN_LOADS = (0.8, 1.5)
"""Open-loop offered rates, as parts of the fixed delay's closed-loop req/s in the same round: a
busy server with bursts (Poisson arrivals), and one offered clearly more than it can serve (the
closed loop's req/s moves by a fifth between runs on this host, so 1.25x was not always over)."""


def start_server(repo: Path, log: Path, cores: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "server",
        "serve",
        "--model-repository",
        str(repo),
        "--http-port",
        str(port),
        "--grpc-port",
        str(free_port()),
        "--log-level",
        "warning",
        "--model-control-mode",
        "explicit",
        "--load-model",
        "cnn",
        "--load-model",
        "mlp",
    ]
    with log.open("wb") as out:
        process = subprocess.Popen(pinned(cores, *command), stdout=out, stderr=out)
    url = f"http://127.0.0.1:{port}"
    import httpx

    deadline = time.monotonic() + 90
    while True:
        try:
            if httpx.get(url + "/v2/health/ready", timeout=1.0).status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline or process.poll() is not None:
            raise RuntimeError(f"sluice did not start; see {log}")
        time.sleep(0.2)


def tune_model(
    url: str,
    model: str,
    budget_s: float,
    trial_s: int,
    out: Path,
    confirm_rounds: int,
    cores: int,
) -> dict[str, Any]:
    """One `sluice tune` run (pinned to the client core; told the server has `cores` cores), its
    final-round comparison, and the default and winner measured again in `confirm_rounds` rounds
    (`confirm`)."""
    command = [
        sys.executable,
        "-m",
        "server",
        "tune",
        "--url",
        url,
        "--model",
        model,
        "--slo-p99-ms",
        str(SLO_MS[model]),
        "--protocol",
        "http-binary",
        "--ramp",
        RAMP,
        "--trial-s",
        str(trial_s),
        "--budget-s",
        str(budget_s),
        "--cores",
        str(cores),
        "--out",
        str(out),
    ]
    started = time.monotonic()
    done = subprocess.run(pinned(CLIENT_CORE, *command), capture_output=True, text=True)
    took = time.monotonic() - started
    results = json.loads((out / "results.json").read_text())
    trials = results["trials"]
    finals = {t["key"]: t for t in trials if t["phase"] == "final"}
    baseline = results["baseline"]
    winner = results["winner"]

    def measured(key: str | None) -> list[float]:
        return [t["ok_rps"] for t in trials if t["key"] == key]

    default_final = finals.get(baseline)
    winner_final = finals.get(winner or "")
    return {
        "model": model,
        "slo_p99_ms": SLO_MS[model],
        "server_cores": cores,
        "exit": done.returncode,
        "seconds": round(took, 1),
        "trials": len(trials),
        "grid": results["space"]["grid_size"],
        "budget_exhausted": results["budget_exhausted"],
        "default": baseline,
        "winner": winner,
        "winner_config": results["winner_config"],
        # The final round measures both in the same conditions; the search round too.
        "default_rps": default_final["ok_rps"] if default_final else None,
        "default_p99_ms": default_final["p99_ms"] if default_final else None,
        "tuned_rps": winner_final["ok_rps"] if winner_final else None,
        "tuned_p99_ms": winner_final["p99_ms"] if winner_final else None,
        "default_all_rps": measured(baseline),
        "tuned_all_rps": measured(winner),
        "confirm": confirm(url, model, out, confirm_rounds, trial_s)
        if done.returncode == 0
        else {},
        "stderr_tail": done.stderr[-1500:],
    }


def confirm(url: str, model: str, out: Path, rounds: int, trial_s: int) -> dict[str, Any]:
    """The default and the tune's winner measured again `rounds` times each, in turn, the order
    swapped each round, as the tune measures a candidate (a reload, then the ramp, req/s at the
    SLO): one final round is one measurement each, and on this host one measurement moves by
    half. Empty when the tune chose no winner or kept the default."""
    results = json.loads((out / "results.json").read_text())
    finals = {t["key"]: Trial.from_dict(t) for t in results["trials"] if t["phase"] == "final"}
    baseline, winner = finals.get(results["baseline"]), finals.get(results["winner"] or "")
    if rounds <= 0 or baseline is None or winner is None or winner is baseline:
        return {}
    control = ServerControl(url, model, {})
    original = Original.from_dict(results["original"])
    load = LoadTestConfig(
        url=url,
        model=model,
        protocol="http-binary",
        users=parse_ramp(RAMP),
        duration_s=trial_s,
        out=out / "confirm",
        slo_p99_ms=SLO_MS[model],
    )
    measure = HarnessTrials(control, load, out / "confirm", original=original)
    measured: dict[str, list[float]] = {"default": [], "tuned": []}
    try:
        for round_ in range(rounds):
            pair = [("default", baseline), ("tuned", winner)]
            for name, trial in pair if round_ % 2 == 0 else pair[::-1]:
                index = len(measured["default"]) + len(measured["tuned"]) + 1
                again = measure(trial.candidate, trial.config, "confirm", index)
                measured[name].append(again.ok_rps)
                row = {"model": model, "round": round_, "config": name, "ok_rps": again.ok_rps}
                print(json.dumps(row), flush=True)
    finally:
        control.restore(original)
    # A round where the default met the SLO at no step has no ratio (its req/s at the SLO is 0).
    pairs = zip(measured["default"], measured["tuned"], strict=True)
    return {"rounds": rounds, **measured, "ratios": [t / d for d, t in pairs if d > 0]}


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


def _median(rows: list[dict[str, Any]], key: str) -> float:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else float("nan")


def markdown(data: dict[str, Any]) -> str:
    lines = [
        "# Tuning benchmark",
        "",
        "Commands (a later one re-runs only what it names and keeps the rest): "
        + "; ".join(f"`{c}`" for c in data.get("commands", [data["command"]]))
        + f". Server on core 0 (on cores 0-1 where a row says 2 server cores), load (locust via "
        f"the harness) on core 1; {data['machine']}.",
        "",
        "## `sluice tune`: tuned vs default, req/s at the p99 SLO",
        "",
        "Both measured in the tune's final round (same run, same conditions); `all` lists every "
        "measurement of each (search, final and the tune's paired rounds).",
        "",
        "| model | server cores | SLO p99 | default req/s (p99 ms) | tuned req/s (p99 ms) | "
        "tuned / default | trials / grid | winner | all default | all tuned |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for t in data["tune"]:
        ratio = (
            f"{t['tuned_rps'] / t['default_rps']:.2f}x"
            if t["tuned_rps"] and t["default_rps"]
            else "-"
        )
        lines.append(
            f"| {t['model']} | {t.get('server_cores', 1)} | {t['slo_p99_ms']:g} ms | "
            f"{t['default_rps'] or 0:,.0f} "
            f"({t['default_p99_ms'] or 0:.0f}) | {t['tuned_rps'] or 0:,.0f} "
            f"({t['tuned_p99_ms'] or 0:.0f}) | {ratio} | {t['trials']} / {t['grid']:,} | "
            f"`{t['winner']}` | {', '.join(f'{v:,.0f}' for v in t['default_all_rps'])} | "
            f"{', '.join(f'{v:,.0f}' for v in t['tuned_all_rps'])} |"
        )
    lines += confirm_markdown(data["tune"])
    auto = data.get("auto")
    if isinstance(auto, dict) and auto:
        lines += ["", *auto_markdown(auto)]
    for again in data.get("auto_replicates", []):
        title = f"## `auto` vs fixed 2 ms on the CNN, again: `{again['command']}`"
        lines += ["", *auto_markdown(again, title)]
    lines += ["", *data.get("notes", [])]
    return "\n".join(lines) + "\n"


def confirm_markdown(tunes: list[dict[str, Any]]) -> list[str]:
    """The confirmation rounds' table (`confirm`): each ratio taken within its round."""
    confirmed = [t for t in tunes if t.get("confirm")]
    if not confirmed:
        return []
    lines = [
        "",
        "### The default and the winner measured again, in turn",
        "",
        "After each tune, both configs are measured again as a trial measures them (reload, "
        "ramp, req/s at the SLO), the order swapped each round; tuned / default is taken within "
        "each round, then its median and range.",
        "",
        "| model | server cores | rounds | default req/s | tuned req/s | tuned / default | "
        "each round |",
        "|---|---|---|---|---|---|---|",
    ]
    for t in confirmed:
        c = t["confirm"]
        lines.append(
            f"| {t['model']} | {t.get('server_cores', 1)} | {c['rounds']} | "
            f"{spread(c['default'], '{:,.0f}')} | "
            f"{spread(c['tuned'], '{:,.0f}')} | {spread(c['ratios'], '{:.2f}x')} | "
            + " ".join(f"{r:.2f}" for r in c["ratios"])
            + " |"
        )
    return lines


def _spread(rows: list[dict[str, Any]], key: str, form: str) -> str:
    """`spread` of `key` over the `rows` that have it."""
    return spread([r[key] for r in rows if r.get(key) is not None], form)


def _ms(value: float | None) -> str:
    return "-" if value is None or value != value else f"{value:,.0f}"


def _rows(value: float | None) -> str:
    return "-" if value is None or value != value else f"{value:.1f}"


def auto_markdown(
    auto: dict[str, Any], title: str = "## `auto` vs fixed 2 ms on the CNN"
) -> list[str]:
    """The auto vs fixed tables: closed loop, open loop (when run), and the medians compared."""
    closed, opened = auto["closed"], auto["open"]
    then = ", then a 3 s open-loop run not measured, then each open-loop rate" if opened else ""
    lines = [
        title,
        "",
        f"The CNN served with max_batch_size {auto.get('max_batch', 8)} and "
        f"{auto.get('instances', 1)} instance(s). Each round: {AUTO_USERS} closed-loop users "
        f"under each delay{then}; at each load fixed first in odd rounds, auto first in even "
        "ones. Auto's "
        f"`latency_target_s` is {TARGET_OVER_FLOOR:g} x {AUTO_USERS} users / the fixed delay's "
        "latest closed-loop req/s (a closed loop cannot average below users / throughput), "
        "which also sets the open-loop rates.",
        "",
        f"### {AUTO_USERS} closed-loop users (locust, no wait between requests)",
        "",
        "p50/p99 are locust's, over every answer (a shed 504 included).",
        "",
        "| round | delay | target s | ok req/s | p50 ms | p99 ms | shed (504) | "
        "mean batch rows | locust CPU-bound |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in closed:
        lines.append(
            f"| {r['round']} | {r['delay']} | {r['target_s'] or '-'} | {r['ok_rps']:,.1f} | "
            f"{_ms(r['p50_ms'])} | {_ms(r['p99_ms'])} | {r['error_fraction']:.1%} | "
            f"{_rows(r['mean_batch_rows'])} | {r['generator_cpu_bound']} |"
        )
    for name in dict.fromkeys(r["delay"] for r in closed):
        chosen = [r for r in closed if r["delay"] == name]
        lines.append(
            f"| median | {name} | | {_median(chosen, 'ok_rps'):,.1f} | "
            f"{_ms(_median(chosen, 'p50_ms'))} | {_ms(_median(chosen, 'p99_ms'))} | "
            f"{_median(chosen, 'error_fraction'):.1%} | "
            f"{_rows(_median(chosen, 'mean_batch_rows'))} | |"
        )
    if opened:
        lines += [
            "",
            "### Fixed arrival rate (open loop: Poisson arrivals, the same schedule for both "
            "delays)",
            "",
            "Offered as a part of the fixed delay's closed-loop req/s in the round. Latency "
            "counts from each request's scheduled send; ok req/s counts 200s answered within the "
            "schedule's span, goodput those of them answered within the target.",
            "",
            "| round | load | offered req/s | delay | target s | ok req/s | goodput req/s | "
            "ok p50 ms | ok p99 ms | p99 of all answers ms | shed (504) | mean batch rows | "
            "send lag p99 ms |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in opened:
            lines.append(
                f"| {r['round']} | {r['load']:g}x | {r['offered_rps']:,.1f} | {r['delay']} | "
                f"{r['target_s']} | {r['ok_rps']:,.1f} | {r['goodput_rps']:,.1f} | "
                f"{_ms(r['ok_p50_ms'])} | {_ms(r['ok_p99_ms'])} | {_ms(r['all_p99_ms'])} | "
                f"{r['shed_fraction']:.1%} | {_rows(r['mean_batch_rows'])} | "
                f"{_ms(r['send_lag_p99_ms'])} |"
            )
    lines += [
        "",
        "### Medians over the rounds (range in brackets)",
        "",
        "auto / fixed is per round (the two measured minutes apart), then its median and range.",
        "",
        "| load | fixed ok req/s | auto ok req/s | auto / fixed | fixed goodput | auto goodput | "
        "fixed p99 ms | auto p99 ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    settings: list[tuple[str, list[dict[str, Any]], str]] = [
        (f"{AUTO_USERS} users", closed, "p99_ms")
    ]
    for part in dict.fromkeys(r["load"] for r in opened):
        chosen = [r for r in opened if r["load"] == part]
        settings.append((f"open loop {part:g}x", chosen, "ok_p99_ms"))
    for label, chosen, p99 in settings:
        by_fixed = [r for r in chosen if r["delay"] != "auto"]
        by_auto = [r for r in chosen if r["delay"] == "auto"]
        ratios = [
            {"ratio": a["ok_rps"] / f["ok_rps"]}
            for f, a in zip(by_fixed, by_auto, strict=True)
            if f["ok_rps"]
        ]
        lines.append(
            f"| {label} | {_spread(by_fixed, 'ok_rps', '{:,.1f}')} | "
            f"{_spread(by_auto, 'ok_rps', '{:,.1f}')} | {_spread(ratios, 'ratio', '{:.2f}x')} | "
            f"{_spread(by_fixed, 'goodput_rps', '{:,.1f}')} | "
            f"{_spread(by_auto, 'goodput_rps', '{:,.1f}')} | "
            f"{_spread(by_fixed, p99, '{:,.0f}')} | {_spread(by_auto, p99, '{:,.0f}')} |"
        )
    lines += [
        "",
        "p99 is over every answer in the closed loop (locust's), over the 200s in the open loop.",
    ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("loadtests/benchmarks/results"))
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--budget-s", type=float, default=240.0)
    parser.add_argument("--trial-s", type=int, default=3)
    parser.add_argument("--auto-seconds", type=int, default=10)
    parser.add_argument("--auto-rounds", type=int, default=3)
    parser.add_argument("--models", default="cnn,mlp")
    parser.add_argument(
        "--server-cores",
        default=SERVER_CORE,
        help="the server's CPU list (taskset), e.g. 0-1 to let threads and instances use both; "
        "the load stays on core " + CLIENT_CORE,
    )
    parser.add_argument(
        "--confirm-rounds",
        type=int,
        default=CONFIRM_ROUNDS,
        help="rounds measuring the default and the winner again after each tune (0: none)",
    )
    parser.add_argument(
        "--auto-max-batch",
        type=int,
        default=AUTO_MAX_BATCH,
        help="the CNN's max_batch_size in the auto vs fixed rounds",
    )
    parser.add_argument(
        "--open-loads",
        default=",".join(f"{part:g}" for part in OPEN_LOADS),
        help="open-loop rates after each round's closed loops, as parts of the fixed delay's "
        "req/s; empty for none",
    )
    parser.add_argument(
        "--auto-instances",
        type=int,
        default=AUTO_INSTANCES,
        help="the CNN's instances in the auto vs fixed rounds",
    )
    parser.add_argument(
        "--parts",
        default="tune,auto",
        help="tune, auto or both; a part not run keeps its results from --out/tune.json",
    )
    parser.add_argument(
        "--auto-replicate",
        action="store_true",
        help="add this auto vs fixed run beside the kept one (tables of its own) instead of "
        "replacing it",
    )
    args = parser.parse_args()
    if shutil.which("taskset") is None:
        sys.exit("needs taskset (util-linux)")
    work = args.work or Path(tempfile.mkdtemp(prefix="sluice-tune-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    repo = write_repository(work / "models")
    process, url = start_server(repo, work / "server.log", args.server_cores)
    cores = len(os.sched_getaffinity(process.pid))
    # The load generators run here and in processes started from here (locust, the tune): off
    # the server's core. (The auto rows of 2026-12-01's first commands ran locust unpinned.)
    os.sched_setaffinity(0, {int(CLIENT_CORE)})
    parts = set(args.parts.split(","))
    kept_path = args.out / "tune.json"
    kept = json.loads(kept_path.read_text()) if kept_path.exists() else {}
    try:
        # Models (and server core counts) not run now are kept.
        tuned = {(t["model"], t.get("server_cores", 1)): t for t in kept.get("tune", [])}
        if "tune" in parts:
            for model in args.models.split(","):
                out = work / f"tune-{model}"
                tuned[(model, cores)] = tune_model(
                    url, model, args.budget_s, args.trial_s, out, args.confirm_rounds, cores
                )
        auto = (
            auto_vs_fixed(
                url,
                args.auto_seconds,
                args.auto_rounds,
                work / "auto",
                args.auto_max_batch,
                args.auto_instances,
                tuple(float(part) for part in args.open_loads.split(",") if part),
            )
            if "auto" in parts
            else {}
        )
    finally:
        process.terminate()
        process.wait(30)
    command = "python -m loadtests.benchmarks.tune " + shlex.join(sys.argv[1:])
    replicates = kept.get("auto_replicates", [])
    if auto and args.auto_replicate:
        replicates, auto = [*replicates, {**auto, "command": command}], {}
    auto = auto or kept.get("auto", {})
    data = {
        "command": command,
        "commands": [
            *kept.get("commands", [kept["command"]] if "command" in kept else []),
            command,
        ],
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d"),
        },
        "default_max_batch": MAX_BATCH,
        "tune": [tuned[key] for key in sorted(tuned)],
        "auto": auto,
        "auto_replicates": replicates,
        "work": str(work),
        "notes": kept.get("notes", []),  # written by hand: edit them when a rerun changes them
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tune.json").write_text(json.dumps(data, indent=2) + "\n")
    (args.out / "tune.md").write_text(markdown(data))
    print(markdown(data))


if __name__ == "__main__":
    main()
