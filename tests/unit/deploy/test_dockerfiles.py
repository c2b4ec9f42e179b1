"""Dockerfile and Dockerfile.gpu: hadolint, structure, and the HEALTHCHECK run for real.

No container engine runs here, so what a build would check is checked from the files."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from server.settings import Settings
from tests.redis_process import free_port
from tests.unit.deploy.dockerfile import Dockerfile, parse
from tests.unit.deploy.scripted_replica import ScriptedReplica
from tests.unit.deploy.tools import ROOT, tool

DOCKERFILES = [ROOT / "Dockerfile", ROOT / "Dockerfile.gpu"]


@pytest.fixture(params=DOCKERFILES, ids=lambda path: path.name)
def dockerfile(request: pytest.FixtureRequest) -> Path:
    path = request.param
    assert isinstance(path, Path)
    return path


def test_hadolint_finds_nothing(dockerfile: Path) -> None:
    result = subprocess.run(
        [tool("hadolint"), "--no-color", str(dockerfile)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert (result.returncode, result.stdout + result.stderr) == (0, "")


def test_multi_stage_with_a_pinned_base(dockerfile: Path) -> None:
    parsed = parse(dockerfile)
    assert [stage.name for stage in parsed.stages] == ["build", "runtime"]
    (base_arg,) = parsed.args
    assert {stage.base for stage in parsed.stages} == {f"${{{base_arg}}}"}
    default = parsed.args[base_arg]
    assert re.search(r":\d+\.\d+\.\d+[-\w.]*$", default), f"{default} is not an exact tag"
    copies = [i.text for i in parsed.final.all("COPY")]
    assert "--from=build /opt/sluice /opt/sluice" in copies


def test_runs_as_a_dedicated_non_root_user(dockerfile: Path) -> None:
    final = parse(dockerfile).final
    user = final.one("USER").text
    assert re.fullmatch(r"(\d+):(\d+)", user), "numeric, so Kubernetes' runAsNonRoot can check it"
    uid, gid = (int(part) for part in user.split(":"))
    assert uid >= 1000
    run = " ".join(i.text for i in final.all("RUN"))
    assert f"--uid {uid}" in run
    assert f"--gid {gid}" in run


def test_ports_and_environment_match_the_settings(dockerfile: Path) -> None:
    final = parse(dockerfile).final
    env = final.env()
    defaults = Settings()
    exposed = sorted(int(port) for port in final.one("EXPOSE").text.split())
    assert exposed == [defaults.http_port, defaults.grpc_port]
    assert (int(env["SLUICE_HTTP_PORT"]), int(env["SLUICE_GRPC_PORT"])) == tuple(exposed)
    assert env["SLUICE_HOST"] == "0.0.0.0"
    assert "SLUICE_ALLOW_UNAUTHENTICATED" not in env  # safe default: API keys are required
    volume = final.one("VOLUME").exec_form()
    assert volume == [env["SLUICE_MODEL_REPOSITORY"]]


def test_signals_reach_the_server(dockerfile: Path) -> None:
    final = parse(dockerfile).final
    assert final.one("STOPSIGNAL").text == "SIGTERM"
    entrypoint = final.one("ENTRYPOINT").exec_form()
    assert entrypoint == ["/usr/bin/tini", "--", "/usr/local/bin/docker-entrypoint.sh"]
    assert "tini=" in " ".join(i.text for i in final.all("RUN"))
    copies = [i.text for i in final.all("COPY")]
    assert "--chmod=0755 deploy/docker-entrypoint.sh /usr/local/bin/docker-entrypoint.sh" in copies


def test_the_image_packages_every_python_package(dockerfile: Path) -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {
        name.rstrip("*") for name in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    }
    build = parse(dockerfile).stages[0]
    copied = {i.text.split()[0].rstrip("/") for i in build.all("COPY")}
    assert packages <= copied
    assert {"pyproject.toml", "README.md"} <= {
        token for i in build.all("COPY") for token in i.text.split()
    }


def test_dockerignore_lets_in_exactly_what_the_dockerfiles_copy() -> None:
    lines = [
        line
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    assert lines[0] == "*"
    allowed = {line[1:].rstrip("/") for line in lines if line.startswith("!")}
    sources: set[str] = set()
    for path in DOCKERFILES:
        for stage in parse(path).stages:
            for copy in stage.all("COPY"):
                tokens = [t for t in copy.text.split() if not t.startswith("--")]
                if "--from=" not in copy.text:
                    sources.update(t.rstrip("/") for t in tokens[:-1])
    assert sources - {"pyproject.toml", "README.md"} <= allowed
    assert allowed <= sources
    assert all((ROOT / source).exists() for source in allowed - {"README.md"})


def test_gpu_image_swaps_in_onnxruntime_gpu() -> None:
    build = parse(ROOT / "Dockerfile.gpu").stages[0]
    run = " ".join(i.text for i in build.all("RUN"))
    assert '"/src[gpu]"' in run
    assert run.index("pip uninstall --yes onnxruntime ") < run.index("--force-reinstall --no-deps")


def healthcheck(parsed: Dockerfile, port: int) -> int:
    command = parsed.final.one("HEALTHCHECK").exec_form()
    assert command[0] == "python"  # the venv's, first on the image's PATH
    env = {"SLUICE_HTTP_PORT": str(port), "PATH": "/usr/bin:/bin"}
    result = subprocess.run(
        [sys.executable, *command[1:]], env=env, capture_output=True, timeout=30, check=False
    )
    return result.returncode


def test_healthcheck_passes_only_when_ready(dockerfile: Path) -> None:
    parsed = parse(dockerfile)
    assert "/v2/health/ready" in parsed.final.one("HEALTHCHECK").text
    replica = ScriptedReplica("a")
    try:
        assert healthcheck(parsed, replica.port) == 0
        replica.status = 503  # loading or draining
        assert healthcheck(parsed, replica.port) != 0
        assert replica.hits == 2
        assert [h["Host"] for h in replica.seen_headers] == [f"127.0.0.1:{replica.port}"] * 2
    finally:
        replica.stop()
    assert healthcheck(parsed, free_port()) != 0  # nothing listening
