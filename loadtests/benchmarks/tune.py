"""The tuning benchmark, in one run on this machine: `sluice tune` on the compute-bound CNN and
the overhead-bound MLP (req/s at one p99 SLO each, the tuned winner against the default config,
both measured in the tune's own final round), then `max_queue_delay_s: auto` against a fixed
2 ms delay on the CNN at 64 users with `latency_target_s` set (alternated, same run). The server
is pinned to core 0 and the load (locust, the harness's generator) to core 1.

    python -m loadtests.benchmarks.tune --out loadtests/benchmarks/results [--budget-s 240]

Writes tune.json (every measurement) and tune.md (the tables); each tune's own report folder is
kept under --work (default: a temporary folder).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from loadtests.benchmarks.batching import CLIENT_CORE, SERVER_CORE, free_port, pinned
from loadtests.benchmarks.models import MAX_BATCH, write_repository
from loadtests.harness import LoadTestConfig, run_load_test
from loadtests.tune.server import ServerControl

SLO_MS = {"cnn": 150.0, "mlp": 20.0}
"""One p99 SLO per model: the CNN's default reaches ~200 ms at 64 users, the MLP's ~10 ms."""
RAMP = "4:64:x4"
AUTO_USERS = 64
LATENCY_TARGETS_S = (0.1, 0.4)
"""Well under the fixed delay's median latency at 64 users (~0.35 s here), and between its median
and its p99 (only the tail is late)."""


def start_server(repo: Path, log: Path) -> tuple[subprocess.Popen[bytes], str]:
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
        process = subprocess.Popen(pinned(SERVER_CORE, *command), stdout=out, stderr=out)
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


def tune_model(url: str, model: str, budget_s: float, trial_s: int, out: Path) -> dict[str, Any]:
    """One `sluice tune` run (pinned to the client core) and its final-round comparison."""
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
        "1",
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
        "stderr_tail": done.stderr[-1500:],
    }


def auto_vs_fixed(url: str, seconds: int, rounds: int, work: Path) -> list[dict[str, Any]]:
    """The CNN at AUTO_USERS users: fixed 2 ms, then auto at each latency target, alternated."""
    control = ServerControl(url, "cnn")
    original = control.original()
    base = dict(original.config)
    fixed = {
        **base,
        "dynamic_batching": {**base.get("dynamic_batching", {}), "max_queue_delay_s": 0.002},
    }
    configs = [("fixed 2 ms", fixed)]
    for target in LATENCY_TARGETS_S:
        batching = {
            **base.get("dynamic_batching", {}),
            "max_queue_delay_s": "auto",
            "latency_target_s": target,
        }
        configs.append((f"auto, target {target:g} s", {**base, "dynamic_batching": batching}))
    rows = []
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
    try:
        for round_ in range(rounds):
            for index, (name, config) in enumerate(configs):
                control.load(config)
                result = run_load_test(dataclasses.replace(load, out=work / f"{round_}-{index}"))
                step = result.steps[0]
                server = step.server
                rows.append(
                    {
                        "round": round_ + 1,
                        "delay": name,
                        "users": AUTO_USERS,
                        "ok_rps": step.total.ok_rps,
                        "p50_ms": step.total.latency.p50_ms,
                        "p99_ms": step.total.latency.p99_ms,
                        "error_fraction": step.error_fraction,
                        "errors": dict(step.errors),
                        "generator_cpu_bound": step.generator_cpu_bound,
                        "server_by_status": server.requests_by_status if server else None,
                        "mean_batch_rows": server.batch_size.mean
                        if server and server.batch_size
                        else None,
                    }
                )
    finally:
        control.restore(original)
    return rows


def _summary(rows: list[dict[str, Any]], name: str) -> dict[str, float]:
    chosen = [r for r in rows if r["delay"] == name]
    return {
        key: sum(r[key] or 0.0 for r in chosen) / len(chosen)
        for key in ("ok_rps", "p50_ms", "p99_ms", "error_fraction")
    }


def markdown(data: dict[str, Any]) -> str:
    lines = [
        "# Tuning benchmark",
        "",
        "Commands (a later one re-runs only what it names and keeps the rest): "
        + "; ".join(f"`{c}`" for c in data.get("commands", [data["command"]]))
        + f". Server on core 0, load (locust via the harness) on core 1; {data['machine']}.",
        "",
        "## `sluice tune`: tuned vs default, req/s at the p99 SLO",
        "",
        "Both measured in the tune's final round (same run, same conditions); `all` lists every "
        "measurement of each (search and final).",
        "",
        "| model | SLO p99 | default req/s (p99 ms) | tuned req/s (p99 ms) | tuned / default | "
        "trials / grid | winner | all default | all tuned |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for t in data["tune"]:
        ratio = (
            f"{t['tuned_rps'] / t['default_rps']:.2f}x"
            if t["tuned_rps"] and t["default_rps"]
            else "-"
        )
        lines.append(
            f"| {t['model']} | {t['slo_p99_ms']:g} ms | {t['default_rps'] or 0:,.0f} "
            f"({t['default_p99_ms'] or 0:.0f}) | {t['tuned_rps'] or 0:,.0f} "
            f"({t['tuned_p99_ms'] or 0:.0f}) | {ratio} | {t['trials']} / {t['grid']:,} | "
            f"`{t['winner']}` | {', '.join(f'{v:,.0f}' for v in t['default_all_rps'])} | "
            f"{', '.join(f'{v:,.0f}' for v in t['tuned_all_rps'])} |"
        )
    lines += [
        "",
        f"## `auto` vs fixed 2 ms: CNN at {AUTO_USERS} users, latency_target_s "
        f"{' and '.join(f'{t:g} s' for t in LATENCY_TARGETS_S)}",
        "",
        "p50/p99 are locust's, over every answer (a shed 504 included).",
        "",
        "| round | delay | ok req/s | p50 ms | p99 ms | failed fraction (504 shed) | "
        "mean batch rows | locust CPU-bound |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in data["auto"]:
        rows = r.get("mean_batch_rows")
        lines.append(
            f"| {r['round']} | {r['delay']} | {r['ok_rps']:,.1f} | {r['p50_ms'] or 0:.0f} | "
            f"{r['p99_ms'] or 0:.0f} | {r['error_fraction']:.1%} | "
            f"{'-' if rows is None else f'{rows:.1f}'} | {r.get('generator_cpu_bound', '-')} |"
        )
    for name in dict.fromkeys(r["delay"] for r in data["auto"]):
        s = _summary(data["auto"], name)
        lines.append(
            f"| mean | {name} | {s['ok_rps']:,.1f} | {s['p50_ms']:.0f} | {s['p99_ms']:.0f} | "
            f"{s['error_fraction']:.1%} | | |"
        )
    lines += ["", *data.get("notes", [])]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("loadtests/benchmarks/results"))
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--budget-s", type=float, default=240.0)
    parser.add_argument("--trial-s", type=int, default=3)
    parser.add_argument("--auto-seconds", type=int, default=10)
    parser.add_argument("--auto-rounds", type=int, default=2)
    parser.add_argument("--models", default="cnn,mlp")
    parser.add_argument(
        "--parts",
        default="tune,auto",
        help="tune, auto or both; a part not run keeps its results from --out/tune.json",
    )
    args = parser.parse_args()
    if shutil.which("taskset") is None:
        sys.exit("needs taskset (util-linux)")
    work = args.work or Path(tempfile.mkdtemp(prefix="sluice-tune-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    repo = write_repository(work / "models")
    process, url = start_server(repo, work / "server.log")
    parts = set(args.parts.split(","))
    kept_path = args.out / "tune.json"
    kept = json.loads(kept_path.read_text()) if kept_path.exists() else {}
    try:
        tuned = {t["model"]: t for t in kept.get("tune", [])}  # models not run now are kept
        if "tune" in parts:
            for model in args.models.split(","):
                out = work / f"tune-{model}"
                tuned[model] = tune_model(url, model, args.budget_s, args.trial_s, out)
        auto = (
            auto_vs_fixed(url, args.auto_seconds, args.auto_rounds, work / "auto")
            if "auto" in parts
            else kept.get("auto", [])
        )
    finally:
        process.terminate()
        process.wait(30)
    command = "python -m loadtests.benchmarks.tune " + " ".join(sys.argv[1:])
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
        "tune": [tuned[model] for model in sorted(tuned)],
        "auto": auto,
        "work": str(work),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tune.json").write_text(json.dumps(data, indent=2) + "\n")
    (args.out / "tune.md").write_text(markdown(data))
    print(markdown(data))


if __name__ == "__main__":
    main()
