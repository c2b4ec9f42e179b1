"""`sluice bundle`: the checks before building, install.sh's own checks, and (slow) a real bundle
built from PyPI, installed with no network into a fresh venv, serving an inference."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

import httpx
import numpy as np
import onnxruntime as ort
import pytest
from click.testing import CliRunner

from engine.demo import mlp_model, write_demo_repository
from server.bundle import (
    BundleError,
    build_bundle,
    build_wheel,
    bundle,
    copy_config,
    copy_models,
    install_script,
    locate_source,
    this_python,
    write_checksums,
)
from tests.redis_process import free_port

ROOT = Path(__file__).resolve().parents[3]


def run_install(
    folder: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["/bin/sh", str(folder / "install.sh"), *args],
        capture_output=True, text=True, timeout=300, check=False, env={**os.environ, **(env or {})},
    )  # fmt: skip


@pytest.fixture
def staged(tmp_path: Path) -> Path:
    """A bundle folder without wheels: enough for install.sh's checks, which come first."""
    folder = tmp_path / "sluice-0.1.0"
    (folder / "wheelhouse").mkdir(parents=True)
    (folder / "wheelhouse" / "sluice-0.1.0-py3-none-any.whl").write_bytes(b"not really a wheel")
    (folder / "install.sh").write_text(install_script("0.1.0", this_python(), (), False, False))
    write_checksums(folder)
    return folder


def test_install_script_passes_shellcheck(tmp_path: Path) -> None:
    shellcheck = shutil.which("shellcheck") or str(Path(sys.executable).parent / "shellcheck")
    script = tmp_path / "install.sh"
    script.write_text(install_script("0.1.0", "3.11", ("gpu",), models=True, config=True))
    result = subprocess.run(
        [shellcheck, "--shell=sh", str(script)], capture_output=True, text=True, check=False
    )
    assert (result.returncode, result.stdout) == (0, "")
    text = script.read_text()
    assert '"sluice[gpu]==0.1.0"' in text
    assert "pip uninstall --quiet --yes onnxruntime" in text
    assert (
        'serve --config \\"$here/config/server.yaml\\" --model-repository \\"$here/models\\""'
        in text
    )


def test_install_refuses_another_python(staged: Path, tmp_path: Path) -> None:
    fake = tmp_path / "python3.9"
    fake.write_text("#!/bin/sh\necho 3.9\n")
    fake.chmod(0o755)
    result = run_install(staged, str(tmp_path / "venv"), env={"PYTHON": str(fake)})
    assert result.returncode == 1
    assert f"this bundle is for Python {this_python()}, {fake} is 3.9" in result.stderr
    assert not (tmp_path / "venv").exists()


def test_install_refuses_a_damaged_bundle(staged: Path, tmp_path: Path) -> None:
    (staged / "wheelhouse" / "sluice-0.1.0-py3-none-any.whl").write_bytes(b"tampered")
    result = run_install(staged, str(tmp_path / "venv"), env={"PYTHON": sys.executable})
    assert result.returncode == 1
    assert "files differ from SHA256SUMS: the bundle is damaged" in result.stderr
    assert not (tmp_path / "venv").exists()


def test_checksums_cover_every_file(staged: Path) -> None:
    lines = (staged / "SHA256SUMS").read_text().splitlines()
    assert [line.split("  ")[1] for line in lines] == [
        "install.sh", "wheelhouse/sluice-0.1.0-py3-none-any.whl",
    ]  # fmt: skip


def test_models_are_checked_before_they_are_copied(tmp_path: Path) -> None:
    repo = write_demo_repository(tmp_path / "repo")
    assert copy_models(repo, tmp_path / "copy") == ["demo"]
    assert (tmp_path / "copy" / "demo" / "1" / "model.onnx").is_file()
    (repo / "broken").mkdir()
    with pytest.raises(BundleError, match=r"no servable version in broken; expected <name>/<vers"):
        copy_models(repo, tmp_path / "copy2")
    (repo / "demo" / "config.yaml").write_text("max_batch_size: -3\n")
    with pytest.raises(BundleError, match=r"max_batch_size: Input should be greater than or equal"):
        copy_models(repo, tmp_path / "copy3")


def test_a_dangling_link_in_the_repository_is_a_bundle_error(tmp_path: Path) -> None:
    """shutil.copytree's Error came out of `sluice bundle` as a traceback."""
    repo = write_demo_repository(tmp_path / "repo")
    (repo / "demo" / "notes.txt").symlink_to(tmp_path / "gone.txt")
    with pytest.raises(
        BundleError, match=r"1 file\(s\) could not be copied; the first: .*notes.txt"
    ):
        copy_models(repo, tmp_path / "copy")


def test_the_config_is_checked_but_its_repository_path_need_not_exist(tmp_path: Path) -> None:
    config = tmp_path / "server.yaml"
    config.write_text("model_repository: /srv/elsewhere\ndrain_timeout_s: 12\n")
    copy_config(config, tmp_path / "out" / "server.yaml")
    assert (tmp_path / "out" / "server.yaml").read_text() == config.read_text()
    config.write_text("drain_timeout: 12\n")
    with pytest.raises(
        BundleError, match=rf"{re.escape(str(config))}.*\n  drain_timeout: unknown key"
    ):
        copy_config(config, tmp_path / "out2" / "server.yaml")


def test_cli_reports_a_missing_repository(tmp_path: Path) -> None:
    result = CliRunner().invoke(bundle, ["--model-repository", str(tmp_path / "nope")])
    assert result.exit_code == 2
    assert "does not exist" in result.output


def test_the_source_tree_is_this_checkout() -> None:
    assert locate_source() == ROOT


@pytest.mark.slow
def test_the_wheel_is_built_from_a_clean_copy_of_the_source(tmp_path: Path) -> None:
    # setuptools packs a tree's build/lib whole: built in place, a module deleted since an
    # earlier build shipped in the bundle's wheel (and the build left build/ in the checkout).
    source = tmp_path / "source"
    checkout_only = ("tests", "docs", "deploy", ".*", "build", "*.egg-info", "__pycache__")
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*checkout_only))
    stale = source / "build" / "lib" / "server" / "deleted_since.py"
    stale.parent.mkdir(parents=True)
    stale.write_text("STALE = True\n")
    wheel = build_wheel(source, tmp_path / "wheelhouse")
    with zipfile.ZipFile(wheel) as built:
        names = built.namelist()
    assert "server/bundle.py" in names
    assert "server/deleted_since.py" not in names
    assert sorted(p.name for p in (source / "build" / "lib").iterdir()) == ["server"]


def wait_ready(url: str, process: subprocess.Popen[bytes], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, f"sluice exited with {process.returncode}"
        try:
            if httpx.get(f"{url}/v2/health/ready", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"sluice did not become ready within {timeout_s} s")


def offline() -> list[str]:
    """A prefix that runs a command in a fresh network namespace (no network at all), if the
    machine allows it (root, or unprivileged user namespaces)."""
    unshare = shutil.which("unshare")
    if unshare and subprocess.run([unshare, "-n", "true"], capture_output=True).returncode == 0:
        return [unshare, "-n"]
    return []


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_real_bundle_installs_offline_and_serves(tmp_path: Path) -> None:
    repo = write_demo_repository(tmp_path / "repo")
    config = tmp_path / "server.yaml"
    config.write_text("drain_timeout_s: 5\nlog_format: text\n")
    tarball = build_bundle(tmp_path / "sluice.tar.gz", model_repository=repo, config_file=config)

    target = tmp_path / "target"
    with tarfile.open(tarball) as tar:
        tar.extractall(target, filter="data")
    (folder,) = target.iterdir()
    manifest = json.loads((folder / "bundle.json").read_text())
    assert (manifest["sluice"], manifest["python"], manifest["models"]) == (
        "0.1.0", this_python(), ["demo"],
    )  # fmt: skip
    assert any(name.startswith("onnxruntime-") for name in manifest["wheels"])

    install = subprocess.run(
        [*offline(), "/bin/sh", str(folder / "install.sh"), str(tmp_path / "venv")],
        capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert install.returncode == 0, install.stderr
    serve_line = install.stdout.strip().splitlines()[-1]
    command = shlex.split(serve_line)
    assert command == [
        str(tmp_path / "venv/bin/sluice"), "serve",
        "--config", str(folder / "config/server.yaml"),
        "--model-repository", str(folder / "models"),
    ]  # fmt: skip

    http_port = free_port()
    process = subprocess.Popen(
        [*command, "--http-port", str(http_port), "--grpc-port", str(free_port())],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{http_port}"
    try:
        wait_ready(url, process)
        x = np.random.default_rng(7).standard_normal((2, 16)).astype(np.float32)
        body = {"inputs": [{"name": "x", "shape": [2, 16], "datatype": "FP32",
                            "data": x.ravel().tolist()}]}  # fmt: skip
        response = httpx.post(f"{url}/v2/models/demo/infer", json=body, timeout=10)
        assert response.status_code == 200, response.text
        (output,) = response.json()["outputs"]
        session = ort.InferenceSession(mlp_model().SerializeToString())
        (expected,) = session.run(None, {"x": x})
        assert output["shape"] == [2, 10]
        np.testing.assert_allclose(np.array(output["data"]).reshape(2, 10), expected, rtol=1e-5)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
