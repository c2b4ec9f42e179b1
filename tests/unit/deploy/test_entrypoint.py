"""deploy/docker-entrypoint.sh outside a container: the command it builds and that it execs.

The seam is the `sluice` executable on PATH: a recording stand-in writes the argv and pid it
was started with, which shows what the container would run and that the shell replaced itself
(so SIGTERM from the runtime reaches the server, not a shell). The last tests run the real
`sluice` the same way."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.redis_process import free_port
from tests.unit.deploy.dockerfile import parse
from tests.unit.deploy.tools import ROOT, tool

ENTRYPOINT = ROOT / "deploy" / "docker-entrypoint.sh"
RECORDER = """#!/bin/sh
printf '%s\\n' "$$" > "$RECORD.pid"
for arg in "$@"; do printf '%s\\n' "$arg"; done > "$RECORD.argv"
"""


def run(
    tmp_path: Path, *args: str, config: Path | None = None, env: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    (bindir / "sluice").write_text(RECORDER)
    (bindir / "sluice").chmod(0o755)
    record = tmp_path / "record"
    for suffix in (".argv", ".pid"):
        Path(f"{record}{suffix}").unlink(missing_ok=True)
    full_env = {"PATH": f"{bindir}:/usr/bin:/bin", "RECORD": str(record), **(env or {})}
    if config is not None:
        full_env["SLUICE_CONFIG_FILE"] = str(config)
    process = subprocess.Popen(
        ["/bin/sh", str(ENTRYPOINT), *args],
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    stdout, stderr = process.communicate(timeout=30)
    result = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    argv_file = Path(f"{record}.argv")
    if not argv_file.exists():
        return result, []
    # exec: the recorder runs in the very process the runtime started.
    assert int(Path(f"{record}.pid").read_text()) == process.pid
    return result, argv_file.read_text().splitlines()


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "server.yaml"
    path.write_text("drain_timeout_s: 30\n")
    return path


def test_shellcheck_finds_nothing() -> None:
    result = subprocess.run(
        [tool("shellcheck"), "--shell=sh", str(ENTRYPOINT)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (result.returncode, result.stdout) == (0, "")


@pytest.mark.parametrize(
    ("args", "expected_tail"),
    [
        ((), []),
        (("--log-level", "debug"), ["--log-level", "debug"]),
        (("serve", "--http-port", "9000"), ["--http-port", "9000"]),
    ],
)
def test_serves_with_the_mounted_config(
    tmp_path: Path, config: Path, args: tuple[str, ...], expected_tail: list[str]
) -> None:
    result, argv = run(tmp_path, *args, config=config)
    assert result.returncode == 0, result.stderr
    assert argv == ["serve", "--config", str(config), *expected_tail]


def test_serves_from_the_environment_when_no_config_is_mounted(tmp_path: Path) -> None:
    # The image's default path, absent here as in a container started without a config mount.
    if Path("/etc/sluice/server.yaml").exists():
        pytest.skip("this machine has a real /etc/sluice/server.yaml")
    result, argv = run(tmp_path, "--log-level", "debug")
    assert result.returncode == 0, result.stderr
    assert argv == ["serve", "--log-level", "debug"]


def test_a_named_config_that_is_missing_is_an_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    result, argv = run(tmp_path, config=missing)
    assert result.returncode == 64
    assert f"SLUICE_CONFIG_FILE={missing} does not exist" in result.stderr
    assert argv == []


def test_other_commands_run_as_given(tmp_path: Path, config: Path) -> None:
    result, argv = run(tmp_path, "sluice", "convert", "--help", config=config)
    assert argv == ["convert", "--help"]
    result, argv = run(tmp_path, "echo", "hello", config=config)
    assert (result.returncode, result.stdout, argv) == (0, "hello\n", [])


def test_the_image_runs_this_script_with_no_default_arguments() -> None:
    for name in ("Dockerfile", "Dockerfile.gpu"):
        final = parse(ROOT / name).final
        assert final.one("CMD").exec_form() == []
        assert final.one("ENTRYPOINT").exec_form()[-1] == "/usr/local/bin/docker-entrypoint.sh"
    assert os.access(ENTRYPOINT, os.R_OK)


def real_sluice_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The image's environment around this checkout's real `sluice` (the venv's bin on PATH)."""
    image = parse(ROOT / "Dockerfile").final.env()
    env = {k: v for k, v in image.items() if k.startswith("SLUICE_") and k != "SLUICE_HOST"}
    env.pop("SLUICE_MODEL_REPOSITORY")  # /models does not exist here: serve the demo model
    return {
        "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        **env,
        "SLUICE_HTTP_PORT": str(free_port()),
        "SLUICE_GRPC_PORT": str(free_port()),
        **extra,
    }


def test_the_image_defaults_refuse_to_serve_without_keys(tmp_path: Path) -> None:
    env = real_sluice_env(tmp_path, SLUICE_HOST="0.0.0.0")
    result = subprocess.run(
        ["/bin/sh", str(ENTRYPOINT)], env=env, capture_output=True, text=True, timeout=60,
        check=False,
    )  # fmt: skip
    assert result.returncode != 0
    assert "with no API keys configured" in result.stderr
    assert "--allow-unauthenticated" in result.stderr


@pytest.mark.timeout(120)
def test_the_server_reads_the_mounted_config_and_drains_on_sigterm(tmp_path: Path) -> None:
    http_port = free_port()
    config = tmp_path / "server.yaml"
    config.write_text(f"http_port: {http_port}\ndrain_timeout_s: 5\n")
    env = real_sluice_env(tmp_path, SLUICE_HOST="127.0.0.1", SLUICE_CONFIG_FILE=str(config))
    env.pop("SLUICE_HTTP_PORT")  # the image sets it; here the config file must decide
    process = subprocess.Popen(
        ["/bin/sh", str(ENTRYPOINT)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + 60
        status = None
        while time.monotonic() < deadline and status != 200:
            assert process.poll() is None, process.stderr.read() if process.stderr else ""
            try:
                status = httpx.get(f"http://127.0.0.1:{http_port}/v2/health/ready").status_code
            except httpx.TransportError:
                time.sleep(0.1)
        assert status == 200
        # The shell exec'd into sluice, so the runtime's SIGTERM lands on the server itself.
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        if process.stderr:
            process.stderr.close()
