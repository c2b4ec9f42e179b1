"""This checkout of sluice against another one, on one core: each server's CPU per request, in
rounds that alternate the two in the same minutes. On a shared machine a figure from another
hour says little about what a change did; two servers measured seconds apart, many times, do.

    git worktree add /tmp/before <commit>
    python -m loadtests.benchmarks.versus --base /tmp/before [--rounds 8] [--seconds 3]
        [--cases mlp:json:16,mlp:json:64] [--workers 1] [--out DIR]

A case is model:protocol:concurrency, the protocol `json` (wrk) or `grpc`; the servers run on
core 0 and the load on core 1, with --workers worker processes each (1: one process; more: a
supervisor, an engine process and the workers, whose CPU is counted together). The base server
runs in --base, so `python -m server` imports that checkout's code. Prints the table; with
--out, writes versus.json and versus.md there.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import psutil

from loadtests.benchmarks.batching import SERVER_CORE, grpc_load, machine, wrk
from loadtests.benchmarks.harness import Served, markdown_table, require, serving, spread
from loadtests.benchmarks.json_cost import json_body
from loadtests.benchmarks.models import write_repository
from loadtests.benchmarks.workers import cpu_s

KINDS = ("base", "this")
PERCENTILES = ("p50_us", "p99_us")


def measure(served: Served, case: str, seconds: float) -> dict[str, Any]:
    """One case's load on `served`: calls/s and the server's CPU µs per answered call."""
    model, protocol, concurrency = case.split(":")
    server = psutil.Process(served.pid)
    used = cpu_s(server)
    if protocol == "json":
        url = f"{served.url}/v2/models/{model}/infer"
        result = wrk(url, json_body(model), int(concurrency), seconds, {})
        answered = result["requests"] - result["non2xx"]
    elif protocol == "grpc":
        result = grpc_load(served.grpc_target, model, int(concurrency), seconds)
        answered = result["requests"] - result["errors"]
    else:
        raise SystemExit(f"case {case}: protocol must be json or grpc")
    cpu_us = (cpu_s(server) - used) / max(answered, 1) * 1e6
    return {
        "throughput": result["throughput"],
        "cpu_us": cpu_us,
        "p50_us": result["p50_us"],
        "p99_us": result["p99_us"],
        "errors": result["requests"] - answered,
    }


def table(report: dict[str, Any]) -> str:
    rows = report["rows"]
    workers = f" --workers {report['workers']}" if report.get("workers", 1) != 1 else ""
    cells = []
    for case in report["cases"]:
        mine = {k: [r for r in rows if (r["case"], r["server"]) == (case, k)] for k in KINDS}
        ratios = [
            b["cpu_us"] / t["cpu_us"] for b, t in zip(mine["base"], mine["this"], strict=True)
        ]
        latency = [
            " / ".join(f"{statistics.median(r[p] for r in mine[k]):,.0f}" for p in PERCENTILES)
            for k in KINDS
        ]
        cells.append(
            [
                case,
                *(spread([r["cpu_us"] for r in mine[k]], "{:.1f}") for k in KINDS),
                spread(ratios, "{:.2f}"),
                " ".join(f"{x:.2f}" for x in ratios),
                *latency,
                sum(r["errors"] for r in rows if r["case"] == case),
            ]
        )
    lines = [
        "# This checkout against another",
        "",
        f"Command: `python -m loadtests.benchmarks.versus --base {report['base']} --rounds "
        f"{report['rounds']} --seconds {report['seconds']:g} --cases "
        f"{','.join(report['cases'])}{workers}`; base: {report['base_commit']}, this: "
        f"{report['this_commit']}; servers on core {SERVER_CORE}, load on the other core; "
        f"{report['machine']}. Server CPU µs per answered request (every process of it), median "
        "of the rounds with the range in brackets; base / this is taken within each round "
        "(above 1: this checkout costs less). p50 / p99: the load generator's "
        "latency percentiles, µs, median of the rounds.",
        "",
    ]
    columns = [
        "case",
        "base µs",
        "this µs",
        "base / this",
        "each round",
        "base p50 / p99",
        "this p50 / p99",
        "errors",
    ]
    return "\n".join([*lines, *markdown_table(columns, cells)]) + "\n"


def commit(code: Path) -> str:
    """The short commit checked out at `code`."""
    out = subprocess.run(
        ["git", "-C", str(code), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, required=True, help="the checkout to compare with")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--cases", default="mlp:json:16,mlp:json:64")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    require("wrk", "taskset")
    cases = args.cases.split(",")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        repo = write_repository(Path(tmp))
        codes = dict(zip(KINDS, (args.base.resolve(), None), strict=True))
        servers = {
            kind: stack.enter_context(
                serving("sluice", repo, SERVER_CORE, "--workers", str(args.workers), cwd=code)
            )
            for kind, code in codes.items()
        }
        for served in servers.values():  # warm each: first batches, the inline-run choice
            measure(served, cases[0], 1)
        for round_ in range(args.rounds):
            order = KINDS if round_ % 2 == 0 else KINDS[::-1]  # neither always goes first
            for case in cases:
                for kind in order:
                    row = {
                        "round": round_,
                        "case": case,
                        "server": kind,
                        **measure(servers[kind], case, args.seconds),
                    }
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    report = {
        "rows": rows,
        "cases": cases,
        "rounds": args.rounds,
        "seconds": args.seconds,
        "workers": args.workers,
        "base": str(args.base),
        "base_commit": commit(args.base),
        "this_commit": commit(Path.cwd()),
        "machine": machine(),
    }
    text = table(report)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "versus.json").write_text(json.dumps(report, indent=1))
        (args.out / "versus.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
