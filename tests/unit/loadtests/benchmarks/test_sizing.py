"""loadtests.benchmarks.sizing: its table, each configuration against the host's limit (raw
ONNX Runtime at one thread times the cores)."""

from __future__ import annotations

from loadtests.benchmarks.sizing import table


def test_each_configuration_is_rated_against_one_thread_times_the_cores() -> None:
    report = {
        "raw_one_thread": 500.0, "cores": 4, "machine": {"cpus": 4},
        "rows": [{"config": "1 replica x 4 threads", "throughput": 1500.0, "p50_us": 2500.0,
                  "p99_us": 9000.0, "errors": 0, "non2xx": 1}],
    }  # fmt: skip
    text = table(report, 10.0)
    assert "x 4 cores = 2,000." in text
    assert text.splitlines()[-1] == "| 1 replica x 4 threads | 1,500 | 75% | 2.5 | 9.0 | 1 |"
