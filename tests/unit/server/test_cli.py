"""`sluice serve` flag parsing, --help and start-up refusals. Every case here stops before a
server would start (flag parse errors and settings errors), so nothing long-running is left."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from server.cli import main

FLAGS = (
    "--config",
    "--model-repository",
    "--host",
    "--http-port",
    "--grpc-port",
    "--log-level",
)


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.upper().startswith("SLUICE_"):
            monkeypatch.delenv(name)


def run(*args: str, env: dict[str, str] | None = None) -> Result:
    return CliRunner().invoke(main, list(args), env=env)


def test_serve_help_lists_every_required_flag() -> None:
    result = run("serve", "--help")
    assert result.exit_code == 0
    for flag in FLAGS:
        assert flag in result.output
    assert "Serve models over HTTP and gRPC" in result.output


def test_top_level_help_lists_serve() -> None:
    # Listing subcommands imports the lazy ones; one that is missing must not break --help.
    result = run("--help")
    assert result.exit_code == 0, result.output
    assert "serve" in result.output


def test_version() -> None:
    result = run("--version")
    assert (result.exit_code, result.output.strip()) == (0, "sluice, version 0.1.0")


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--http-port", "abc"], "Invalid value for '--http-port': 'abc' is not a valid integer"),
        (["--grpc-port", "1.5"], "Invalid value for '--grpc-port'"),
        (["--log-level", "verbose"], "'verbose' is not one of 'debug', 'info', 'warning', 'error'"),
        (["--log-format", "xml"], "Invalid value for '--log-format'"),
        (["--model-control-mode", "auto"], "Invalid value for '--model-control-mode'"),
        (["--drain-timeout-s", "soon"], "Invalid value for '--drain-timeout-s'"),
        (["--no-such-flag"], "No such option '--no-such-flag'"),
    ],
)
def test_flag_parse_errors_exit_2(args: list[str], fragment: str) -> None:
    result = run("serve", *args)
    assert result.exit_code == 2
    assert fragment in result.output


def test_config_that_is_a_directory_is_a_usage_error(tmp_path: Path) -> None:
    result = run("serve", "--config", str(tmp_path))
    assert result.exit_code == 2
    assert "is a directory" in result.output


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["--http-port", "70000"], ["http_port", "less than 65536", "(got 70000)"]),
        (["--grpc-port", "-5"], ["grpc_port", "(got -5)"]),
        (["--drain-timeout-s", "-1"], ["drain_timeout_s", "(got -1.0)"]),
    ],
)
def test_out_of_range_flag_values_name_key_and_value(args: list[str], fragments: list[str]) -> None:
    result = run("serve", *args)
    assert result.exit_code == 1
    assert "invalid configuration" in result.output
    for fragment in fragments:
        assert fragment in result.output


def test_missing_model_repository_is_named(tmp_path: Path) -> None:
    result = run("serve", "--model-repository", str(tmp_path / "absent"))
    assert result.exit_code == 1
    assert f"model repository '{tmp_path / 'absent'}' is not a directory" in result.output


def test_missing_config_file_is_named(tmp_path: Path) -> None:
    result = run("serve", "--config", str(tmp_path / "absent.yaml"))
    assert result.exit_code == 1
    assert f"cannot read {tmp_path / 'absent.yaml'}" in result.output


def test_bad_config_file_key_is_named(tmp_path: Path) -> None:
    config = tmp_path / "server.yaml"
    config.write_text("http_port: 8000\nlisten: 0.0.0.0\n")
    result = run("serve", "--config", str(config))
    assert result.exit_code == 1
    assert "listen: unknown key; allowed keys here:" in result.output
    assert str(config) in result.output


def test_flags_override_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # The env value is valid, the flag's is not: the error proves the flag won.
    monkeypatch.setenv("SLUICE_HTTP_PORT", "8123")
    result = run("serve", "--http-port", "99999")
    assert result.exit_code == 1
    assert "(got 99999)" in result.output


def test_environment_reaches_serve_when_no_flag_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICE_GRPC_PORT", "123456")
    result = run("serve")
    assert result.exit_code == 1
    assert "grpc_port" in result.output
    assert "123456" in result.output


def test_flags_override_the_config_file(tmp_path: Path) -> None:
    config = tmp_path / "server.yaml"
    config.write_text("log_level: debug\nhttp_port: 8000\n")
    result = run("serve", "--config", str(config), "--http-port", "65536")
    assert result.exit_code == 1
    assert "(got 65536)" in result.output
