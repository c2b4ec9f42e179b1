"""The worker-process benchmark's accounting (loadtests/benchmarks/workers.py): the engine
process's reads, counted from /proc, and the table's medians and ratios by round."""

from __future__ import annotations

import os
import tempfile

import psutil

from loadtests.benchmarks import workers


def test_reads_count_a_process_s_read_system_calls() -> None:
    me = psutil.Process(os.getpid())
    before = workers.reads(me)
    with tempfile.TemporaryFile() as file:
        for _ in range(5):
            os.pread(file.fileno(), 1, 0)
    assert workers.reads(me) - before >= 5
    assert workers.reads(None) == 0  # one process: no engine process to count


def row(workers_: int, round_: int, cpu: float, reads: float | None) -> dict[str, object]:
    return {"round": round_, "workers": workers_, "model": "mlp", "protocol": "grpc",
            "concurrency": 16, "throughput": 1000.0, "p99_us": 5000.0, "cpu_s_per_1000": cpu,
            "engine_cpu_s_per_1000": None if workers_ == 1 else 0.1, "avg_batch": 8.0,
            "switches_per_request": 1.0, "engine_reads_per_request": reads,
            "errors": 0}  # fmt: skip


def test_the_table_gives_the_engine_s_reads_and_ratios_within_rounds() -> None:
    rows = [row(1, 0, 0.2, None), row(2, 0, 0.4, 0.9), row(1, 1, 0.4, None), row(2, 1, 0.4, 0.5),
            row(2, 2, 0.3, 0.7), row(1, 2, 0.2, None)]  # fmt: skip
    report = {"rows": rows, "seconds": 4, "server_cores": "0", "client_cores": "1",
              "machine": {}, "rounds": 3}  # fmt: skip
    lines = workers.table(report).splitlines()
    header = [cell.strip() for cell in lines[-4].strip("|").split("|")]
    one, two = ([cell.strip() for cell in line.strip("|").split("|")] for line in lines[-2:])
    reads = header.index("engine reads / req")
    assert (one[reads], two[reads]) == ("-", "0.70")
    # CPU ratios taken within rounds (2.0, 1.0, 1.5): median 1.50, where the medians' ratio
    # would say 2.00.
    assert header[8] == "x 1 worker"
    assert two[8] == "1.50"
