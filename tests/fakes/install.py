"""Puts the fakes where `import` finds them, for one test (through pytest's monkeypatch, which
restores sys.modules afterwards). The code under test imports them exactly as it imports the
real modules: this is the seam, not a patch of the code's internals."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

import pytest

from tests.fakes import tensorrt as fake_tensorrt
from tests.fakes.cuda_driver import FakeCudaDriver
from tests.fakes.cuda_runtime import FakeCudaRuntime, get_cuda_native_handle


def _package(name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    module.__path__ = []
    return module


def install_cuda(monkeypatch: pytest.MonkeyPatch, runtime: FakeCudaRuntime) -> None:
    """`import cuda.bindings.runtime` (and the legacy `from cuda import cudart`) give `runtime`,
    and `import cuda.bindings.driver` a fake driver over its memory."""
    driver = FakeCudaDriver(runtime)
    driver.__spec__ = importlib.machinery.ModuleSpec("cuda.bindings.driver", None)  # type: ignore[attr-defined]
    runtime.__spec__ = importlib.machinery.ModuleSpec("cuda.bindings.runtime", None)  # type: ignore[attr-defined]
    cuda, bindings = _package("cuda"), _package("cuda.bindings")
    utils = types.ModuleType("cuda.bindings.utils")
    utils.__spec__ = importlib.machinery.ModuleSpec("cuda.bindings.utils", None)
    utils.get_cuda_native_handle = get_cuda_native_handle  # type: ignore[attr-defined]
    bindings.runtime = runtime  # type: ignore[attr-defined]
    bindings.driver = driver  # type: ignore[attr-defined]
    bindings.utils = utils  # type: ignore[attr-defined]
    cuda.bindings = bindings  # type: ignore[attr-defined]
    cuda.cudart = runtime  # type: ignore[attr-defined]
    for name, module in {
        "cuda": cuda,
        "cuda.bindings": bindings,
        "cuda.bindings.runtime": runtime,
        "cuda.bindings.driver": driver,
        "cuda.bindings.utils": utils,
        "cuda.cudart": runtime,
    }.items():
        monkeypatch.setitem(sys.modules, name, module)


def hide_package(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """`import name` and `import name.anything` raise ImportError for one test, as if the package
    were not installed, even where it (or a fake of it) was imported earlier in this process.

    Hiding only `sys.modules[name]` is not enough: Python answers `import cuda.bindings` from
    `sys.modules["cuda.bindings"]` without looking at its parent, so a submodule that an earlier
    test (or a test module's collection, e.g. `real_cuda()`) imported would still be found."""
    for module in [m for m in sys.modules if m == name or m.startswith(f"{name}.")] + [name]:
        monkeypatch.setitem(sys.modules, module, None)


def install_tensorrt(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """`import tensorrt` gives the fake TensorRT 10 (its version restored after the test)."""
    monkeypatch.setitem(sys.modules, "tensorrt", fake_tensorrt)
    monkeypatch.setattr(fake_tensorrt, "__version__", fake_tensorrt.__version__)
    monkeypatch.setattr(fake_tensorrt, "refuse", set())
    monkeypatch.setattr(fake_tensorrt, "engines", [])
    monkeypatch.setattr(fake_tensorrt, "configs", [])
    monkeypatch.setattr(fake_tensorrt, "kernel", None)
    return fake_tensorrt


def real_cuda() -> tuple[Any, str]:
    """(the real cuda.bindings.runtime, "") where cuda-python and a GPU are present, else
    (None, why not): for the `gpu`-marked tests that run the real thing."""
    if importlib.util.find_spec("cuda") is None:
        return None, "cuda-python is not installed"
    try:
        from cuda.bindings import runtime
    except ImportError as exc:
        return None, f"cuda.bindings.runtime does not import: {exc}"
    from engine.backends.cuda import Cuda

    cuda = Cuda(runtime)
    if cuda.device_count() == 0:  # never raises, whichever cuda-python release this is
        return None, f"no CUDA GPU ({cuda.no_device})"
    return runtime, ""


def real_cupy() -> tuple[Any, str]:
    """(cupy, "") where cupy imports and the real CUDA runtime sees a GPU, else (None, why
    not): for the gpu-marked tests that run real kernels on engine.backends.cuda's streams."""
    runtime, why_not = real_cuda()
    if runtime is None:
        return None, why_not
    try:
        import cupy
    except ImportError as exc:
        return None, f"cupy does not import: {exc}"
    return cupy, ""


def write_shims(folder: Path, tensorrt: bool = True, nvml: bool = True, **runtime: bool) -> Path:
    """A folder that, first on PYTHONPATH, makes `cuda.bindings.runtime`, `pynvml` and (unless
    told not to) `tensorrt` import as the fakes in a child process (a server, a script), the
    way real installs are found. One fake GPU, "NVIDIA Fake GPU", compute capability 9.0;
    `runtime` goes to FakeCudaRuntime (`int_enums=True`, `driver=False`); `nvml=False` leaves
    NVML out (no GPU in the metrics)."""
    package = folder / "cuda" / "bindings"
    package.mkdir(parents=True)
    (folder / "cuda" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "utils.py").write_text(
        "from tests.fakes.cuda_runtime import get_cuda_native_handle  # noqa: F401\n"
    )
    (package / "runtime.py").write_text(
        "import sys\nfrom tests.fakes.cuda_runtime import FakeCudaRuntime\n"
        f"sys.modules[__name__] = FakeCudaRuntime(**{runtime!r})\n"
    )
    (package / "driver.py").write_text(
        "import sys\nfrom cuda.bindings import runtime\n"
        "from tests.fakes.cuda_driver import FakeCudaDriver\n"
        "sys.modules[__name__] = FakeCudaDriver(runtime)\n"
    )
    if tensorrt:
        (folder / "tensorrt.py").write_text(
            "import sys\nfrom tests.fakes import tensorrt\nsys.modules[__name__] = tensorrt\n"
        )
    if nvml:
        (folder / "pynvml.py").write_text(
            "import sys\nfrom tests.fakes import pynvml as fake\n"
            "fake.DEVICES.append(fake.Device('NVIDIA Fake GPU', 40, 1 << 30, 80 << 30))\n"
            "sys.modules[__name__] = fake\n"
        )
    return folder
