from __future__ import annotations

from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from loadtests.cli import default_grpc_target, loadtest, parse_host_port, read_key_file
from tests.redis_process import free_port


def _run(*args: str) -> tuple[int, str]:
    outcome = CliRunner().invoke(loadtest, list(args))
    return outcome.exit_code, outcome.output


def test_users_and_ramp_exclude_each_other() -> None:
    code, output = _run("--users", "2", "--ramp", "1:4:1")
    assert code == 2
    assert "give --users or --ramp, not both" in output


def test_bad_ramp_is_a_usage_error() -> None:
    code, output = _run("--ramp", "4:1:1")
    assert code == 2
    assert "need 1 <= START <= STOP, got START=4 STOP=1" in output


def test_remote_workers_need_a_bind_address() -> None:
    code, output = _run("--remote-workers", "2")
    assert code == 2
    assert "--remote-workers needs --master-bind" in output


def test_unreachable_server_exits_3(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    code, output = _run("--url", url, "--users", "1", "--duration", "1", "--out", str(tmp_path))
    assert code == 3
    assert f"cannot reach the server at {url}/v2/models/demo" in " ".join(output.split())
    assert not (tmp_path / "report.md").exists()


def test_an_unreachable_grpc_target_exits_3(tmp_path: Path) -> None:
    """It ran every step against nothing and exited 0 ("0.0 ok req/s")."""
    target = f"127.0.0.1:{free_port()}"
    # Nothing listens there: the check waits out its whole bound, --timeout-s.
    code, output = _run("--protocol", "grpc", "--grpc-url", target, "--users", "1", "--duration",
                        "1", "--timeout-s", "0.2", "--out", str(tmp_path))  # fmt: skip
    assert code == 3
    assert f"cannot reach the gRPC server at {target}" in " ".join(output.split())
    assert not (tmp_path / "report.md").exists()


def test_parse_host_port() -> None:
    assert parse_host_port("0.0.0.0:5557", "--master-bind") == ("0.0.0.0", 5557)
    assert parse_host_port("[::1]:80", "--x") == ("[::1]", 80)
    for bad in ("host", ":80", "host:0", "host:http"):
        with pytest.raises(click.BadParameter, match=f"'{bad}' is not HOST:PORT"):
            parse_host_port(bad, "--master-bind")


def test_default_grpc_target() -> None:
    assert default_grpc_target("http://10.0.0.5:8000") == "10.0.0.5:8001"
    assert default_grpc_target("https://infer.example.com") == "infer.example.com:8001"


def test_key_file(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("# tenants\nkey-a\n\n  key-b  \n")
    assert read_key_file(path) == ["key-a", "key-b"]
    assert read_key_file(None) == []
