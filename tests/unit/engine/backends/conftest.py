"""Fixtures for the TensorRT backend's tests: fakes of cuda-python's runtime (two H100s) and of
TensorRT 10, installed where `import` finds them for one test."""

from __future__ import annotations

from types import ModuleType

import pytest

from tests.fakes.cuda_runtime import FakeCudaRuntime, cudaDeviceProp
from tests.fakes.install import install_cuda, install_tensorrt


@pytest.fixture
def cudart(monkeypatch: pytest.MonkeyPatch) -> FakeCudaRuntime:
    runtime = FakeCudaRuntime(
        [cudaDeviceProp(b"NVIDIA H100", 9, 0), cudaDeviceProp(b"NVIDIA H100", 9, 0)]
    )
    install_cuda(monkeypatch, runtime)
    return runtime


@pytest.fixture
def trt(monkeypatch: pytest.MonkeyPatch, cudart: FakeCudaRuntime) -> ModuleType:
    return install_tensorrt(monkeypatch)
