"""Rendering the kustomize overlays (kubectl's built-in kustomize) and finding objects in them."""

from __future__ import annotations

import base64
import shutil
import subprocess
from dataclasses import dataclass
from typing import Any

import pytest
import yaml

from tests.unit.deploy.tools import DEPLOY

K8S = DEPLOY / "k8s"
OVERLAYS = sorted(path.name for path in (K8S / "overlays").iterdir())


def kustomize(path: str) -> list[dict[str, Any]]:
    """`kubectl kustomize` of a folder under deploy/k8s, as parsed objects."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed (its built-in kustomize renders the manifests)")
    result = subprocess.run(
        [kubectl, "kustomize", str(K8S / path)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@dataclass
class Rendered:
    """One rendered overlay."""

    name: str
    objects: list[dict[str, Any]]

    def all(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]

    def get(self, kind: str, name: str) -> dict[str, Any]:
        found = [o for o in self.all(kind) if o["metadata"]["name"] == name]
        assert len(found) == 1, f"{self.name}: expected one {kind} {name}, found {len(found)}"
        return found[0]

    def generated(self, kind: str, prefix: str) -> dict[str, Any]:
        """A generator's output, named `<prefix>-<content hash>`."""
        found = [
            o for o in self.all(kind)
            if o["metadata"]["name"].rsplit("-", 1)[0] == prefix
        ]  # fmt: skip
        assert len(found) == 1, f"{self.name}: expected one generated {kind} {prefix}"
        return found[0]

    def secret_value(self, name: str, key: str) -> str:
        secret = self.get("Secret", name)
        return base64.b64decode(secret["data"][key]).decode()

    @property
    def deployment(self) -> dict[str, Any]:
        return self.get("Deployment", "sluice")

    @property
    def pod(self) -> dict[str, Any]:
        spec = self.deployment["spec"]["template"]["spec"]
        assert isinstance(spec, dict)
        return spec

    @property
    def container(self) -> dict[str, Any]:
        (container,) = [c for c in self.pod["containers"] if c["name"] == "sluice"]
        assert isinstance(container, dict)
        return container

    def env(self, name: str) -> dict[str, Any]:
        (entry,) = [e for e in self.container["env"] if e["name"] == name]
        assert isinstance(entry, dict)
        return entry

    def volume_source(self, volume: str) -> dict[str, Any]:
        (found,) = [v for v in self.pod["volumes"] if v["name"] == volume]
        assert isinstance(found, dict)
        return found
