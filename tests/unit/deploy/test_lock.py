"""The lock files in requirements/: what `./dev.sh`, CI and the CPU image install.

pyproject.toml keeps open ranges for users; the locks pin the exact versions (with hashes) that
this repository tests. These tests fail when the two drift apart: a dependency added or narrowed
in pyproject.toml without `./dev.sh lock`, an extra nobody locks, a pin without a hash."""

from __future__ import annotations

import os
import re
import subprocess
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.unit.deploy.dockerfile import parse
from tests.unit.deploy.tools import ROOT, tool

REQUIREMENTS = ROOT / "requirements"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
UNLOCKED_EXTRAS = {"gpu"}
"""CUDA wheels for another host kind (onnxruntime-gpu replaces onnxruntime): the GPU image
installs the extra's own pins (docs/guides/gpu.md)."""
TARGET = {
    "python_version": "3.11",
    "python_full_version": "3.11.0",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
}


def pins(lock: Path) -> dict[str, tuple[str, list[str]]]:
    """name -> (version, hashes) of every `name==version` entry of a uv/pip-compile lock."""
    found: dict[str, tuple[str, list[str]]] = {}
    for entry in re.split(r"\n(?=\S)", lock.read_text()):
        head = re.match(r"([A-Za-z0-9_.\-]+)==(\S+)", entry)
        if head:
            hashes = re.findall(r"--hash=sha256:([0-9a-f]{64})", entry)
            found[canonicalize_name(head[1])] = (head[2], hashes)
    return found


def wanted(*extras: str) -> list[Requirement]:
    """The base dependencies and those of `extras` that apply on the locked target."""
    names = [*PYPROJECT["project"]["dependencies"]]
    for extra in extras:
        names += PYPROJECT["project"]["optional-dependencies"][extra]
    requirements = [Requirement(name) for name in names]
    return [r for r in requirements if r.marker is None or r.marker.evaluate(TARGET)]


LOCKED_EXTRAS = sorted(set(PYPROJECT["project"]["optional-dependencies"]) - UNLOCKED_EXTRAS)
LOCKS = {"serve.txt": wanted(), "dev.txt": wanted(*LOCKED_EXTRAS)}


@pytest.mark.parametrize("name", LOCKS)
def test_every_pin_satisfies_pyproject(name: str) -> None:
    locked = pins(REQUIREMENTS / name)
    problems = []
    for requirement in LOCKS[name]:
        pin = locked.get(canonicalize_name(requirement.name))
        if pin is None:
            problems.append(f"{requirement} is not in the lock")
        elif not requirement.specifier.contains(pin[0], prereleases=True):
            problems.append(f"{requirement} but the lock pins {pin[0]}")
    assert not problems, f"requirements/{name} is stale (./dev.sh lock): {problems}"


@pytest.mark.parametrize("name", ["serve.txt", "dev.txt", "uv.txt"])
def test_every_pin_carries_its_hashes(name: str) -> None:
    locked = pins(REQUIREMENTS / name)
    assert locked
    assert [pinned for pinned, (_, hashes) in locked.items() if not hashes] == []


def test_the_dev_lock_holds_the_serve_lock_at_the_same_versions() -> None:
    # The suite tests the versions that ./dev.sh serve and the image install.
    serve, dev = pins(REQUIREMENTS / "serve.txt"), pins(REQUIREMENTS / "dev.txt")
    assert {name: serve[name][0] for name in serve} == {name: dev[name][0] for name in serve}


def test_dev_sh_locks_every_extra_but_the_gpu_one() -> None:
    script = (ROOT / "dev.sh").read_text()
    lock_function = script[
        script.index("\nlock() {") : script.index("\n}\n", script.index("\nlock() {"))
    ]
    assert sorted(re.findall(r"--extra (\w+)", lock_function)) == LOCKED_EXTRAS


def test_dev_sh_passes_shellcheck() -> None:
    result = subprocess.run(
        [tool("shellcheck"), str(ROOT / "dev.sh"), str(ROOT / ".ci" / "run")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout


def test_torch_is_the_cpu_build() -> None:
    # An unpinned torch brings a CUDA build of several GB.
    assert pins(REQUIREMENTS / "dev.txt")["torch"][0].endswith("+cpu")


def test_the_cpu_image_installs_the_serve_lock_with_hashes() -> None:
    build = parse(ROOT / "Dockerfile").stages[0]
    run = " ".join(i.text for i in build.all("RUN"))
    assert "--require-hashes --no-deps -r requirements/serve.txt" in run
    assert "pip install --no-deps /src" in run


FAKE_UV = """#!/usr/bin/env bash
# uv's contract for lock files: `pip sync FILE...`, `pip install -r FILE` (an argument given to
# `pip install` is a package or an archive, and a .txt one is refused as uv refuses it).
echo "$*" >> "$LOG"
if [ "$1 $2" = "pip install" ]; then
  previous=
  for arg in "${@:3}"; do
    if [[ $arg == *.txt && $previous != -r ]]; then
      echo "error: Failed to parse: \\`$arg\\`" >&2; exit 2
    fi
    previous=$arg
  done
fi
"""


def test_dev_sh_serve_installs_the_serve_lock_and_serves(tmp_path: Path) -> None:
    # A fresh machine's first command: the .venv exists (pip answers), uv and sluice are
    # stand-ins that record what dev.sh asked of them.
    (tmp_path / "dev.sh").write_text((ROOT / "dev.sh").read_text())
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    scripts = {"python": "#!/bin/sh\nexit 0\n", "uv": FAKE_UV, "sluice": 'echo "$*" >> "$LOG"\n'}
    for name, text in scripts.items():
        (bin_dir / name).write_text(text if text.startswith("#!") else "#!/bin/sh\n" + text)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "calls.log"
    result = subprocess.run(
        ["bash", "dev.sh", "serve", "--http-port", "1"],
        cwd=tmp_path,
        env={"PATH": os.environ["PATH"], "LOG": str(log), "PIP_FIND_LINKS": ""},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    calls = log.read_text().splitlines()
    assert calls[0].startswith("pip install ")
    assert calls[0].endswith("-r requirements/serve.txt")
    assert "--require-hashes" in calls[0]
    assert calls[-1] == "serve --http-port 1"
