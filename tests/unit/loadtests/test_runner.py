from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from loadtests.locust_csv import StepFiles
from loadtests.runner import (
    PROTOCOLS,
    Progress,
    StepSpec,
    child_env,
    local_master_host,
    main_command,
    read_progress,
    worker_command,
)

FIXTURES = Path(__file__).parent / "fixtures"


def _flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_every_protocol_has_a_locustfile_and_user_class() -> None:
    for locustfile, user_class in PROTOCOLS.values():
        assert locustfile.is_file()
        assert f"class {user_class}(" in locustfile.read_text()


def test_standalone_command(tmp_path: Path) -> None:
    spec = StepSpec("http-binary", "http://h:1", users=12, duration_s=7, prefix=tmp_path / "s-01")
    command = main_command(spec)
    assert command[:3] == [sys.executable, "-m", "locust"]
    assert _flag(command, "-f").endswith("users/http_users.py")
    assert (_flag(command, "--users"), _flag(command, "--spawn-rate")) == ("12", "12")
    assert _flag(command, "--run-time") == "7s"
    assert _flag(command, "--host") == "http://h:1"
    assert _flag(command, "--csv") == str(tmp_path / "s-01")
    assert _flag(command, "--sluice-summary-file") == str(tmp_path / "s-01_summary.json")
    assert _flag(command, "--exit-code-on-error") == "0"
    assert {"--headless", "--csv-full-history", "--reset-stats"} <= set(command)
    assert "--master" not in command
    assert command[-1] == "BinaryInferUser"


def test_master_command_waits_for_local_and_remote_workers(tmp_path: Path) -> None:
    spec = StepSpec(
        "grpc",
        "h:2",
        users=4,
        duration_s=3,
        prefix=tmp_path / "s",
        workers=2,
        remote_workers=3,
        master_bind=("0.0.0.0", 5557),
    )
    command = main_command(spec)
    assert "--master" in command
    assert _flag(command, "--master-bind-host") == "0.0.0.0"
    assert _flag(command, "--master-bind-port") == "5557"
    assert _flag(command, "--expect-workers") == "5"
    assert command[-1] == "GrpcInferUser"


def test_local_workers_find_the_master() -> None:
    def spec(bind: tuple[str, int] | None) -> StepSpec:
        return StepSpec("http", "h", 1, 1, Path("p"), workers=1, master_bind=bind)

    assert local_master_host(spec(None)) == "127.0.0.1"
    assert local_master_host(spec(("0.0.0.0", 5557))) == "127.0.0.1"
    assert local_master_host(spec(("10.1.2.3", 5557))) == "10.1.2.3"


def test_worker_command() -> None:
    command = worker_command("grpc", "driver", 5557)
    assert _flag(command, "-f").endswith("users/grpc_users.py")
    assert command[-5:] == ["--worker", "--master-host", "driver", "--master-port", "5557"]


def test_child_env_puts_the_tree_first_on_the_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    env = child_env({"SLUICE_LOADTEST_MODEL": "demo"})
    root = str(Path(__file__).resolve().parents[3])
    assert env["PYTHONPATH"] == os.pathsep.join([root, "/elsewhere"])
    assert env["SLUICE_LOADTEST_MODEL"] == "demo"


def test_progress_reads_the_last_aggregated_row() -> None:
    assert read_progress(StepFiles(FIXTURES / "grpc_tenants")) == Progress(
        users=0, requests=2368, failures=1533, p99_ms=17.0
    )


def test_progress_before_locust_wrote_anything(tmp_path: Path) -> None:
    assert read_progress(StepFiles(tmp_path / "none")) is None
    files = StepFiles(tmp_path / "half")
    files.history.write_text("Timestamp,User Count,Type,Name\n1,2,,Aggregated\n")
    assert read_progress(files) is None  # a row caught half-written
