"""The `gpu` extra and Dockerfile.gpu install every module the GPU paths import, so the fix a
missing-package error names (`pip install 'sluice[gpu]'`) is a fix."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]
GPU_SOURCES = [
    "engine/backends/tensorrt.py",
    "engine/backends/tensorrt_instance.py",
    "engine/backends/tensorrt_specs.py",
    "engine/backends/cuda.py",
    "engine/backends/onnxruntime.py",
    "engine/gpu_metrics.py",
    "converters/tensorrt.py",
]
# The top-level module each GPU path imports -> the distribution that provides it there.
PROVIDERS = {
    "tensorrt": "tensorrt",
    "cuda": "cuda-python",
    "pynvml": "nvidia-ml-py",
    "onnxruntime": "onnxruntime-gpu",  # the CUDA and TensorRT providers
}


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def gpu_extra() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extra = project["optional-dependencies"]["gpu"]
    return {re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0] for requirement in extra}


def test_every_gpu_import_is_in_the_gpu_extra() -> None:
    imported = set().union(*(imported_modules(ROOT / source) for source in GPU_SOURCES))
    needed = {PROVIDERS[module] for module in imported & PROVIDERS.keys()}
    assert needed == set(PROVIDERS.values())  # the scan sees every GPU import
    assert needed <= gpu_extra(), f"missing from the gpu extra: {sorted(needed - gpu_extra())}"


def test_the_gpu_image_installs_the_extra_and_checks_every_module() -> None:
    text = (ROOT / "Dockerfile.gpu").read_text()
    assert '"/src[gpu]"' in text
    for module in ("tensorrt", "cuda.bindings.runtime", "pynvml"):
        assert f"'{module}'" in text, f"Dockerfile.gpu does not check that {module} is there"
    assert "onnxruntime as ort" in text
    assert "'CUDAExecutionProvider' not in ort.get_available_providers()" in text
