"""deploy/k8s/base/assemble-repository.sh (the init container) run here on real folders, and the
result read by sluice's own repository scanner."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from engine.demo import write_demo_repository
from engine.repository import Repository
from tests.unit.deploy.k8s_render import K8S
from tests.unit.deploy.tools import tool

SCRIPT = K8S / "base" / "assemble-repository.sh"


def assemble(store: Path, configs: Path, repo: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["/bin/sh", str(SCRIPT), str(store), str(configs), str(repo)],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip


@pytest.fixture
def layout(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A store with the demo model (and its config.yaml) plus a model with no config at all,
    the base's model-configs folder, and an empty repository folder."""
    store = write_demo_repository(tmp_path / "store")
    (store / "plain" / "3").mkdir(parents=True)
    (store / "plain" / "3" / "model.onnx").write_bytes((store / "demo/1/model.onnx").read_bytes())
    configs = tmp_path / "configs"
    configs.mkdir()
    (configs / "demo.yaml").write_text((K8S / "base/models/demo.yaml").read_text())
    repo = tmp_path / "models"
    repo.mkdir()
    return store, configs, repo


def test_shellcheck_finds_nothing() -> None:
    result = subprocess.run(
        [tool("shellcheck"), "--shell=sh", str(SCRIPT)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert (result.returncode, result.stdout) == (0, "")


def test_sluice_sees_every_stored_model_with_the_configmap_config(
    layout: tuple[Path, Path, Path],
) -> None:
    store, configs, repo = layout
    for _ in range(2):  # an init container runs again when the pod restarts
        result = assemble(store, configs, repo)
        assert result.returncode == 0, result.stderr
        assert result.stdout == f"assemble-repository: 2 model(s) from {store} in {repo}\n"
    entries = Repository(repo).scan()
    assert sorted(entries) == ["demo", "plain"]
    assert entries["demo"].versions == {1: repo / "demo" / "1" / "model.onnx"}
    assert entries["plain"].versions == {3: repo / "plain" / "3" / "model.onnx"}
    # The ConfigMap's config replaced the store's, which left the result cache off.
    assert entries["demo"].config.cache.enabled is True
    assert yaml.safe_load((repo / "demo/config.yaml").read_text()) == yaml.safe_load(
        (configs / "demo.yaml").read_text()
    )
    assert not (repo / "demo/config.yaml").is_symlink()
    # Version folders are links into the store: nothing was copied.
    assert (repo / "demo" / "1").resolve() == (store / "demo" / "1").resolve()


def test_a_config_for_a_model_missing_from_the_store_fails_the_pod(
    layout: tuple[Path, Path, Path],
) -> None:
    store, configs, repo = layout
    (configs / "resnet.yaml").write_text("max_batch_size: 8\n")
    result = assemble(store, configs, repo)
    assert result.returncode == 1
    assert f"configures model 'resnet', but {store} has no folder 'resnet'" in result.stderr
