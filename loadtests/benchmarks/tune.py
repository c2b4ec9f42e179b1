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

The `auto` vs fixed rounds are in tune_auto.py, the tables in tune_tables.py.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from loadtests.benchmarks.batching import CLIENT_CORE, SERVER_CORE
from loadtests.benchmarks.harness import free_port, http_ready, pinned, sluice_command
from loadtests.benchmarks.models import MAX_BATCH, write_repository
from loadtests.benchmarks.tune_auto import (
    AUTO_INSTANCES,
    AUTO_MAX_BATCH,
    OPEN_LOADS,
    auto_vs_fixed,
)
from loadtests.benchmarks.tune_tables import markdown
from loadtests.harness import LoadTestConfig
from loadtests.plan import parse_ramp
from loadtests.tune.search import Trial
from loadtests.tune.server import Original, ServerControl
from loadtests.tune.trial import HarnessTrials

SLO_MS = {"cnn": 150.0, "mlp": 20.0}
"""One p99 SLO per model: the CNN's default reaches ~200 ms at 64 users, the MLP's ~10 ms."""
RAMP = "4:64:x4"
CONFIRM_ROUNDS = 5


def start_server(repo: Path, log: Path, cores: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    models = ("--model-control-mode", "explicit", "--load-model", "cnn", "--load-model", "mlp")
    command = sluice_command(repo, port, free_port(), *models)
    with log.open("wb") as out:
        process = subprocess.Popen(pinned(cores, *command), stdout=out, stderr=out)
    url = f"http://127.0.0.1:{port}"
    ready = http_ready(url + "/v2/health/ready")
    deadline = time.monotonic() + 90
    while not ready():
        if time.monotonic() > deadline or process.poll() is not None:
            raise RuntimeError(f"sluice did not start; see {log}")
        time.sleep(0.2)
    return process, url


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
