"""loadtests.benchmarks.harness: what the benchmarks share: the commands they start servers with,
the wait for a server and its stop, the CPU time it used, and their results tables (a server
started by `serving`: test_versus.py)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from loadtests.benchmarks.harness import (
    baseline_command,
    cpu_s,
    markdown_table,
    pinned,
    require,
    running,
    sluice_command,
    spread,
    write_results,
)


def test_a_spread_is_the_median_and_the_range() -> None:
    assert spread([3.0, 1.0, 2.5], "{:,.1f}") == "2.5 (1.0-3.0)"
    assert spread([1234.5], "{:,.0f}") == "1,234"  # one value alone (banker's rounding)
    assert spread([], "{:.1f}") == "-"


def test_a_markdown_table() -> None:
    assert markdown_table(["users", "rps"], [(1, 10.5), ("2", None)]) == [
        "| users | rps |",
        "|---|---|",
        "| 1 | 10.5 |",
        "| 2 | None |",
    ]


def test_results_are_json_and_the_table_printed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_results(tmp_path / "out", "bench", {"rps": [1, 2]}, "| a |\n")
    assert json.loads((tmp_path / "out" / "bench.json").read_text()) == {"rps": [1, 2]}
    assert (tmp_path / "out" / "bench.md").read_text() == "| a |\n"
    assert capsys.readouterr().out == "| a |\n\n"


def test_the_commands_servers_start_with(tmp_path: Path) -> None:
    assert sluice_command(tmp_path, 1, 2, "--workers", "2") == [
        sys.executable, "-m", "server", "serve", "--model-repository", str(tmp_path),
        "--http-port", "1", "--grpc-port", "2", "--log-level", "warning", "--workers", "2",
    ]  # fmt: skip
    assert baseline_command("plain", tmp_path, 3) == [
        sys.executable, "-m", "loadtests.benchmarks.baseline", "plain", str(tmp_path), "3",
    ]  # fmt: skip
    assert pinned("0-2", "a", "b") == ["taskset", "-c", "0-2", "a", "b"]


def test_a_missing_tool_names_its_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    require("sh")
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on it
    with pytest.raises(SystemExit, match=r"^taskset is needed \(apt-get install util-linux\)$"):
        require("taskset")
    with pytest.raises(SystemExit, match=r"^sh is needed \(apt-get install sh\)$"):
        require("sh")


def test_a_server_that_exits_before_it_answers_is_named() -> None:
    with (
        pytest.raises(RuntimeError, match=r"^toy server did not start$"),
        running([sys.executable, "-c", "pass"], lambda: False, "toy server"),
    ):
        pass


def test_a_ready_server_is_stopped_on_the_way_out() -> None:
    command = [sys.executable, "-c", "import time; time.sleep(60)"]
    with running(command, lambda: True, "sleeper", stop_s=10) as process:
        assert process.poll() is None
    assert process.returncode is not None


def test_cpu_time_of_a_process_counts_what_it_spent() -> None:
    before = cpu_s(os.getpid())
    deadline = time.process_time() + 0.05
    while time.process_time() < deadline:
        pass
    assert cpu_s(os.getpid()) - before >= 0.03
    assert cpu_s(os.getpid(), main_thread=True) <= cpu_s(os.getpid())
