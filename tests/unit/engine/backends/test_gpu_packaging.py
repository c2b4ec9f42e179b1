"""The `gpu` extra and Dockerfile.gpu install every module the GPU paths import, so the fix a
missing-package error names (`pip install 'sluice[gpu]'`) is a fix; the extra's pins are on the
base image's CUDA major; the image puts TensorRT's libraries where ONNX Runtime's TensorRT
provider finds them, and its build checks that the providers' libraries load."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

from tests.unit.deploy.dockerfile import parse

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
    "tensorrt": "tensorrt-cu12",
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


def requirements() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [Requirement(text) for text in project["optional-dependencies"]["gpu"]]


def gpu_extra() -> set[str]:
    return {requirement.name for requirement in requirements()}


def test_every_gpu_import_is_in_the_gpu_extra() -> None:
    imported = set().union(*(imported_modules(ROOT / source) for source in GPU_SOURCES))
    needed = {PROVIDERS[module] for module in imported & PROVIDERS.keys()}
    assert needed == set(PROVIDERS.values())  # the scan sees every GPU import
    assert needed <= gpu_extra(), f"missing from the gpu extra: {sorted(needed - gpu_extra())}"


# Released versions (PyPI, as `pip index versions` lists them) and the CUDA major each is
# built for, read from their metadata (onnxruntime-gpu's `cuda` extra names nvidia-*-cu12 up to
# 1.26.0 and nvidia-*~=13.0 from 1.27.0; the 1.24.4 and 1.26.0 wheels say cuda_version 12.8).
ONNXRUNTIME_GPU = [
    "1.18.1", "1.19.2", "1.20.2", "1.21.1", "1.22.0", "1.23.2", "1.24.1", "1.24.4", "1.25.1",
    "1.26.0", "1.27.0", "1.28.0", "1.29.0", "1.30.0", "1.31.1",
]  # fmt: skip
CUDA_PYTHON = ["11.8.7", "12.6.0", "12.6.2.post1", "12.8.0", "12.9.10", "13.0.0", "13.4.4"]


def onnxruntime_gpu_cuda_major(version: Version) -> int:
    """PyPI's onnxruntime-gpu: CUDA 11.8 up to 1.18, CUDA 12 from 1.19, CUDA 13 from 1.27."""
    if version < Version("1.19"):
        return 11
    return 12 if version < Version("1.27") else 13


def base_cuda_major() -> int:
    image = parse(ROOT / "Dockerfile.gpu").args["CUDA_IMAGE"]
    match = re.fullmatch(r"nvidia/cuda:(\d+)\.\d+\.\d+-[\w.-]+", image)
    assert match, f"{image} is not an nvidia/cuda image with an exact CUDA version"
    return int(match.group(1))


def admitted(requirement: Requirement, releases: list[str]) -> list[Version]:
    return [
        v for v in map(Version, releases) if requirement.specifier.contains(v, prereleases=False)
    ]


def test_the_gpu_extra_is_pinned_to_the_base_images_cuda_major() -> None:
    major = base_cuda_major()
    pins = {requirement.name: requirement for requirement in requirements()}
    onnxruntime = admitted(pins["onnxruntime-gpu"], ONNXRUNTIME_GPU)
    assert onnxruntime, "the onnxruntime-gpu pin admits no released version"
    assert {onnxruntime_gpu_cuda_major(v) for v in onnxruntime} == {major}, onnxruntime
    # get_provider_graph_assignment_info (require_providers' placement check): 1.24 and later.
    assert min(onnxruntime) >= Version("1.24")
    # `tensorrt` is a meta package whose CUDA major moved (10.13.3 on: tensorrt-cu13).
    assert f"tensorrt-cu{major}" in pins, sorted(pins)
    assert not pins[f"tensorrt-cu{major}"].specifier.contains("11.0.0")  # libnvinfer.so.10
    cuda_python = admitted(pins["cuda-python"], CUDA_PYTHON)
    assert cuda_python
    assert {v.major for v in cuda_python} == {major}, cuda_python


def test_the_major_check_would_catch_a_mismatch() -> None:
    # What the extra had before: onnxruntime-gpu>=1.17,<2 admits CUDA 11, 12 and 13 builds.
    loose = admitted(Requirement("onnxruntime-gpu>=1.17,<2"), ONNXRUNTIME_GPU)
    assert {onnxruntime_gpu_cuda_major(v) for v in loose} == {11, 12, 13}


TENSORRT_LIBS = "/opt/sluice/lib/python3.12/site-packages/tensorrt_libs"


def test_tensorrt_libraries_are_on_the_library_path_of_both_stages() -> None:
    parsed = parse(ROOT / "Dockerfile.gpu")
    build_run = " ".join(i.text for i in parsed.stages[0].all("RUN"))
    # The venv's Python is the base's python3 at the version apt is pinned to.
    assert "python3=3.12.*" in build_run
    for stage in parsed.stages:
        path = stage.env()["LD_LIBRARY_PATH"].split(":")
        assert path[0] == TENSORRT_LIBS
        assert "" not in path  # an empty entry would search the working directory
        assert {"/usr/local/nvidia/lib", "/usr/local/nvidia/lib64"} <= set(path)  # the base's


def test_the_gpu_image_installs_the_extra_and_checks_every_module() -> None:
    build = parse(ROOT / "Dockerfile.gpu").stages[0]
    run = " ".join(i.text for i in build.all("RUN"))
    assert '"/src[gpu]"' in run
    for module in ("tensorrt", "cuda.bindings.runtime", "pynvml"):
        assert f"'{module}'" in run, f"Dockerfile.gpu does not check that {module} is there"
    # Compiled-in providers are not enough: their libraries must resolve (no GPU needed).
    assert f"test -f {TENSORRT_LIBS}/libnvinfer.so.10" in run
    assert run.endswith("/opt/sluice/bin/python -m engine.backends.provider_libraries")
    assert "python -m engine.backends.provider_check" in (ROOT / "Dockerfile.gpu").read_text()
