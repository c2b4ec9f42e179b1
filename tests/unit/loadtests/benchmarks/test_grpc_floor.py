"""loadtests.benchmarks.grpc_floor: the summary of repeated rounds and the table of each server
against grpc.aio's floor in the same round."""

from __future__ import annotations

from typing import Any

from loadtests.benchmarks.grpc_floor import KINDS, summary, table


def test_a_summary_is_the_median_and_range() -> None:
    assert summary([3.0, 1.0, 2.0, 10.0]) == {"median": 2.5, "min": 1.0, "max": 10.0}


def measured(throughput: float, batch: float | None = None) -> dict[str, Any]:
    row = {"throughput": throughput, "server_cpu_us_per_call": 120.0, "p50_us": 900.0,
           "p99_us": 2100.0}  # fmt: skip
    return row if batch is None else {**row, "mean_batch": batch}


def test_each_server_is_a_share_of_the_floor_of_its_own_round() -> None:
    rounds = [
        {kind: measured(10_000.0) for kind in KINDS} | {"sluice": measured(5_000.0, 1.5)},
        {kind: measured(20_000.0) for kind in KINDS} | {"sluice": measured(8_000.0, 2.5)},
    ]
    report = {
        "rounds": rounds,
        "command": "python -m loadtests.benchmarks.grpc_floor",
        "model": "mlp",
        "concurrency": 16,
        "seconds": 2.0,
        "machine": {"cpus": 2},
    }
    lines = table(report).splitlines()
    sluice = next(line for line in lines if line.startswith("| sluice |"))
    assert sluice == "| sluice | 6,500 (5,000-8,000) | 45% (40%-50%) | 120 | 2.00 | 900 | 2,100 |"
    floor = next(line for line in lines if line.startswith("| floor |"))
    assert "| 100% (100%-100%) |" in floor
    assert floor.split(" | ")[4] == "-"  # the floor runs no batches
