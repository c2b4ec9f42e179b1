"""deploy/systemd: systemd's own verifier and security audit, and agreement with sluice's config."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from server.settings import load_settings
from tests.unit.deploy.tools import DEPLOY, ROOT

SYSTEMD = DEPLOY / "systemd"
UNIT = SYSTEMD / "sluice.service"
EXEC = "/opt/sluice/venv/bin/sluice"


def directives(path: Path) -> dict[str, list[str]]:
    """`Section.Key` -> values in order (systemd allows a key more than once)."""
    found: dict[str, list[str]] = {}
    section = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        found.setdefault(f"{section}.{key}", []).append(value)
    return found


def one(found: dict[str, list[str]], key: str) -> str:
    (value,) = found[key]
    return value


def systemd_analyze(*args: str) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("systemd-analyze")
    if binary is None:
        pytest.skip("systemd-analyze is not installed")
    return subprocess.run([binary, *args], capture_output=True, text=True, timeout=60, check=False)


@pytest.fixture
def unit_dir(tmp_path: Path) -> Path:
    """The unit with ExecStart pointing at this checkout's sluice (verify wants a real binary),
    and the GPU drop-in beside it, where systemd looks for drop-ins."""
    sluice = ROOT / ".venv" / "bin" / "sluice"
    target = sluice if sluice.exists() else Path(shutil.which("sluice") or "/bin/true")
    (tmp_path / "sluice.service").write_text(UNIT.read_text().replace(EXEC, str(target)))
    return tmp_path


def test_systemd_verifies_the_unit_and_its_gpu_drop_in(unit_dir: Path) -> None:
    result = systemd_analyze("verify", str(unit_dir / "sluice.service"))
    assert (result.returncode, result.stderr) == (0, "")
    drop_ins = unit_dir / "sluice.service.d"
    drop_ins.mkdir()
    shutil.copy(SYSTEMD / "gpu.conf", drop_ins / "gpu.conf")
    result = systemd_analyze("verify", str(unit_dir / "sluice.service"))
    assert (result.returncode, result.stderr) == (0, "")


@pytest.mark.parametrize("with_gpu", [False, True])
def test_security_exposure_is_low(unit_dir: Path, with_gpu: bool) -> None:
    if with_gpu:
        (unit_dir / "sluice.service.d").mkdir()
        shutil.copy(SYSTEMD / "gpu.conf", unit_dir / "sluice.service.d" / "gpu.conf")
    result = systemd_analyze("security", "--offline=yes", str(unit_dir / "sluice.service"))
    match = re.search(r"Overall exposure level for sluice.service: (\d+\.\d+)", result.stdout)
    assert match, result.stdout + result.stderr
    assert float(match[1]) <= 2.0


def test_stop_timeout_covers_the_drain() -> None:
    found = directives(UNIT)
    settings = load_settings(DEPLOY / "config" / "server.yaml")
    timeout = re.fullmatch(r"(\d+)s?", one(found, "Service.TimeoutStopSec"))
    assert timeout
    assert settings.drain_timeout_s + 5 <= int(timeout[1]) <= settings.drain_timeout_s + 30
    assert one(found, "Service.KillSignal") == "SIGTERM"
    assert one(found, "Service.KillMode") == "mixed"
    assert one(found, "Service.Restart") == "on-failure"
    # reload = SIGHUP, which rotates certificates and keys in place (server.server)
    assert one(found, "Service.ExecReload") == "/bin/kill -HUP $MAINPID"


def test_hardening_and_read_only_paths() -> None:
    found = directives(UNIT)
    assert one(found, "Service.User") == one(found, "Service.Group") == "sluice"
    assert one(found, "Service.ProtectSystem") == "strict"
    assert one(found, "Service.NoNewPrivileges") == "yes"
    assert int(one(found, "Service.LimitNOFILE")) >= 65536
    assert "Service.ReadWritePaths" not in found
    argv = shlex.split(one(found, "Service.ExecStart"))
    assert argv[:2] == [EXEC, "serve"]
    config = Path(argv[argv.index("--config") + 1])
    models = Path(argv[argv.index("--model-repository") + 1])
    read_only = [Path(p) for p in one(found, "Service.ReadOnlyPaths").split()]
    assert models in read_only
    assert any(config.is_relative_to(path) for path in read_only)
    env_file = Path(one(found, "Service.EnvironmentFile"))
    assert any(env_file.is_relative_to(path) for path in read_only)


def test_the_environment_file_is_plain_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    values = {}
    for line in (SYSTEMD / "sluice.env").read_text().splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            assert not value.startswith(("'", '"')), "systemd would strip the quotes"
            values[key] = value
            monkeypatch.setenv(key, value)
    assert values == {"SLUICE_HOST": "0.0.0.0"}
    settings = load_settings(DEPLOY / "config" / "server.yaml")
    assert settings.host == "0.0.0.0"
    assert (settings.http_port, settings.grpc_port) == (8000, 8001)
