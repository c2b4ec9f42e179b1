from __future__ import annotations

from pathlib import Path

import pytest

from loadtests.locust_csv import StepFiles, read_timeline

FIXTURES = Path(__file__).parent / "fixtures"
HEADER = (
    "Timestamp,User Count,Type,Name,Requests/s,Failures/s,50%,66%,75%,80%,90%,95%,98%,99%,99.9%,"
    "99.99%,100%,Total Request Count,Total Failure Count,Total Median Response Time,"
    "Total Average Response Time,Total Min Response Time,Total Max Response Time,"
    "Total Average Content Size"
)


def _history(tmp_path: Path, rows: list[str]) -> StepFiles:
    files = StepFiles(tmp_path / "step-01")
    files.history.write_text("\n".join([HEADER, *rows]) + "\n")
    return files


def _row(stamp: int, users: int, p50: str, p99: str, requests: int, failures: int) -> str:
    percentiles = [p50, p50, p50, p50, p99, p99, p99, p99, p99, p99, p99]
    return ",".join(
        [
            str(stamp),
            str(users),
            "",
            "Aggregated",
            "0",
            "0",
            *percentiles,
            str(requests),
            str(failures),
            "1",
            "1",
            "1",
            "1",
            "1",
        ]
    )


def test_step_files_are_named_after_the_prefix(tmp_path: Path) -> None:
    files = StepFiles(tmp_path / "step-03")
    assert files.history == tmp_path / "step-03_stats_history.csv"
    assert files.summary == tmp_path / "step-03_summary.json"


def test_throughput_comes_from_count_differences(tmp_path: Path) -> None:
    files = _history(
        tmp_path,
        [
            _row(100, 0, "N/A", "N/A", 0, 0),
            _row(101, 4, "2", "9", 300, 10),
            _row(103, 4, "3", "12", 900, 30),
        ],
    )
    points = read_timeline(files, origin=95.0)
    assert [p.t_s for p in points] == [6.0, 8.0]
    assert [p.rps for p in points] == [300.0, 300.0]
    assert [p.failures_per_s for p in points] == [10.0, 10.0]
    assert [(p.p50_ms, p.p99_ms) for p in points] == [(2.0, 9.0), (3.0, 12.0)]
    assert [p.users for p in points] == [4, 4]


def test_reset_stats_restarts_the_count_and_empty_windows_have_no_latency(tmp_path: Path) -> None:
    files = _history(
        tmp_path,
        [
            _row(100, 4, "5", "50", 800, 0),
            _row(101, 4, "0", "0", 200, 0),  # stats were reset after spawning
        ],
    )
    (point,) = read_timeline(files, origin=100.0)
    assert point.rps == 200.0
    assert point.p99_ms is None  # locust writes 0 until its window has samples


def test_real_history_of_a_multi_tenant_distributed_run() -> None:
    files = StepFiles(FIXTURES / "grpc_tenants")
    points = read_timeline(files, origin=1796053580.0)
    # Only the Aggregated rows count; the first of them is the baseline.
    assert [p.t_s for p in points] == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert sum(p.rps for p in points) == 2368
    assert points[-1].p99_ms == 17.0


def test_real_history_of_a_standalone_run() -> None:
    points = read_timeline(StepFiles(FIXTURES / "http"), origin=1796053561.0)
    assert [p.rps for p in points] == [518.0, 326.0]
    assert points[0].p99_ms is None
    assert points[1].p99_ms == 20.0


@pytest.mark.parametrize("content", ["", HEADER + "\n"])
def test_empty_history(tmp_path: Path, content: str) -> None:
    files = StepFiles(tmp_path / "s")
    files.history.write_text(content)
    assert read_timeline(files, origin=0.0) == []
    assert read_timeline(StepFiles(tmp_path / "absent"), origin=0.0) == []
