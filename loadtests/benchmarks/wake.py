"""What waking another process costs on this machine: the floor under every crossing between
processes (`--workers N`: a worker and the engine process wake each other on every burst of
requests; so do a load generator and the server). Two processes ping-pong one byte over a unix
socket pair, each blocking in recv until the other's byte arrives, pinned to the same core and
then to two cores; reported per round trip: wall time and each side's CPU time (user + system).

    python -m loadtests.benchmarks.wake --out loadtests/benchmarks/results [--rounds 5]

On bare metal a round trip across cores costs a few µs of CPU a side. In a virtual machine a
wake-up sent to another vCPU that sleeps is an inter-processor interrupt the hypervisor
delivers, and its cost lands on both sides' CPU time; on one core the kernel switches between
the two processes without one. Writes wake.json (every round) and wake.md (medians, with the
range in brackets)."""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import time
from pathlib import Path
from typing import Any

from loadtests.benchmarks.batching import machine
from loadtests.benchmarks.harness import markdown_table, spread, write_results


def round_trips(first: int, second: int, count: int) -> dict[str, float]:
    """`count` round trips between this process on core `first` and a child on core `second`:
    µs per round trip of wall time and of each side's CPU."""
    ours, theirs = socket.socketpair()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    pid = os.fork()
    if pid == 0:  # the child answers every byte, then exits without running the parent's code
        try:
            os.sched_setaffinity(0, {second})
            ours.close()
            for _ in range(count):
                theirs.recv(1)
                theirs.send(b"y")
        finally:
            os._exit(0)
    theirs.close()
    try:
        os.sched_setaffinity(0, {first})
        started, cpu = time.perf_counter(), time.process_time()
        for _ in range(count):
            ours.send(b"x")
            if not ours.recv(1):
                raise RuntimeError("the child process left early")
        wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    finally:
        ours.close()
        os.waitpid(pid, 0)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    child = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return {
        "wall_us": wall / count * 1e6,
        "cpu_us": cpu / count * 1e6,
        "peer_cpu_us": child / count * 1e6,
    }


def measure(cores: list[int], rounds: int, count: int) -> list[dict[str, Any]]:
    """Each round: the same core, then two cores (when there are two), in turn."""
    layouts = {"same core": (cores[0], cores[0])}
    if len(cores) > 1:
        layouts["two cores"] = (cores[0], cores[1])
    rows: list[dict[str, Any]] = []
    home = os.sched_getaffinity(0)
    try:
        for round_ in range(rounds):
            for layout, (first, second) in layouts.items():
                rows.append(
                    {"round": round_, "layout": layout, **round_trips(first, second, count)}
                )
                print(json.dumps(rows[-1]), flush=True)
    finally:
        os.sched_setaffinity(0, home)
    return rows


def table(report: dict[str, Any]) -> str:
    layouts = list(dict.fromkeys(r["layout"] for r in report["rows"]))
    cells = []
    for layout in layouts:
        rows = [r for r in report["rows"] if r["layout"] == layout]
        cells.append(
            [
                layout,
                *(
                    spread([r[f] for r in rows], "{:.1f}")
                    for f in ("wall_us", "cpu_us", "peer_cpu_us")
                ),
            ]
        )
    lines = [
        "# Wake-up benchmark",
        "",
        f"Command: `python -m loadtests.benchmarks.wake --rounds {report['rounds']} --count "
        f"{report['count']}`; {report['machine']}. Two processes ping-pong a byte over a unix "
        "socket pair; µs per round trip, median of the rounds with the range in brackets.",
        "",
    ]
    lines += markdown_table(["layout", "wall µs", "CPU µs, one side", "CPU µs, the other"], cells)
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("loadtests/benchmarks/results"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--count", type=int, default=20_000, help="round trips per measurement")
    args = parser.parse_args()
    rows = measure(sorted(os.sched_getaffinity(0)), args.rounds, args.count)
    report = {"rows": rows, "machine": machine(), "rounds": args.rounds, "count": args.count}
    write_results(args.out, "wake", report, table(report))


if __name__ == "__main__":
    main()
