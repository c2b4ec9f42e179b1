"""The native TensorRT backend against fakes of cuda-python's runtime and TensorRT 10 that hold
the real contracts (tests/fakes): what a load needs and checks (TensorRT, cuda-python and a GPU;
engine compatibility; the configured profile and workspace), an engine per instance where shapes
are dynamic, and batches handed to free instances. Each instance's buffers, streams and errors
are tested in test_tensorrt_instance.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from engine.backends.tensorrt import TensorRTBackend
from engine.errors import BackendError
from engine.model import warm_up
from engine.model_config import InstanceGroup, TensorRTOptions
from tests.fakes.cuda_runtime import FakeCudaRuntime
from tests.fakes.install import hide_package, install_cuda, install_tensorrt
from tests.unit.engine.backends.tensorrt_plans import (
    LARGE,
    PROFILE_0,
    PROFILE_1,
    SMALL,
    batch,
    concurrent_batches,
    open_backend,
    write_plan,
)


def test_an_absent_gpu_fails_the_load(tmp_path: Path, trt: ModuleType) -> None:
    with pytest.raises(BackendError, match=r"cudaSetDevice\(3\) failed: cudaErrorInvalidDevice"):
        open_backend(write_plan(tmp_path, trt), [InstanceGroup(kind="gpu", gpus=[3])])


STATIC = [
    {"name": "x", "mode": "input", "dtype": "FLOAT", "shape": [2, 4]},
    {"name": "y", "mode": "output", "dtype": "FLOAT", "shape": [2, 4], "copy_of": "x"},
]


def test_instances_on_one_gpu_share_an_engine_only_when_its_shapes_are_static(
    tmp_path: Path, trt: ModuleType
) -> None:
    # TensorRT: "If the engine supports dynamic shapes, each execution context in concurrent use
    # must use a separate optimization profile." Instances run concurrently and each may use
    # every profile, so each gets its own engine (as Triton does); static engines are shared.
    groups = [InstanceGroup(count=3, kind="gpu", gpus=[0, 1])]
    backend = open_backend(write_plan(tmp_path, trt, profiles=[SMALL, LARGE]), groups)
    try:
        assert [len(engine.contexts) for engine in trt.engines] == [2] * 6
        concurrent_batches(backend, 40)
        assert all(not engine.violations for engine in trt.engines)
    finally:
        backend.close()
    trt.engines.clear()
    path = write_plan(tmp_path / "static", trt)
    path.write_bytes(trt.plan(STATIC, [{}]))  # built without profiles: none to report
    backend = open_backend(path, groups)
    try:
        assert [len(engine.contexts) for engine in trt.engines] == [3, 3]  # one per GPU
        x = np.arange(8, dtype=np.float32).reshape(2, 4)
        np.testing.assert_array_equal(backend.run({"x": x})["y"], x)
    finally:
        backend.close()


def test_the_configured_profile_is_used(tmp_path: Path, trt: ModuleType) -> None:
    path = write_plan(tmp_path, trt, profiles=[PROFILE_0, PROFILE_1])
    backend = open_backend(path, profile=1)
    try:
        feed = batch(2, 60)  # only profile 1 allows 60
        np.testing.assert_array_equal(backend.run(feed)["ids_out"], feed["ids"])
    finally:
        backend.close()
    with pytest.raises(
        BackendError, match="optimization profile 2; the engine has profiles 0 to 1"
    ):
        open_backend(path, profile=2)


def test_workspace_limit_is_honoured(tmp_path: Path, trt: ModuleType) -> None:
    path = write_plan(tmp_path, trt, device_memory_bytes=64 << 20)
    with pytest.raises(
        BackendError, match=r"needs 67108864 bytes .*activation_memory_bytes allows 1048576"
    ):
        open_backend(path, activation_memory_bytes=1 << 20)


def test_a_plan_that_does_not_deserialize_says_how_to_rebuild(
    tmp_path: Path, trt: ModuleType
) -> None:
    path = write_plan(tmp_path, trt)
    path.write_bytes(b"\x00not a plan")
    with pytest.raises(BackendError) as caught:
        open_backend(path)
    message = str(caught.value)
    assert "TensorRT 10.3.0 cannot deserialize" in message
    assert "rebuild it here with `sluice convert SOURCE --target tensorrt" in message


def test_an_engine_from_another_tensorrt_version_is_named(tmp_path: Path, trt: ModuleType) -> None:
    record = {"version": "10.0.1", "gpu": "NVIDIA A100", "compute_capability": "8.0"}
    path = write_plan(tmp_path, trt, record, version="10.0.1", compute_capability=(8, 0))
    with pytest.raises(BackendError) as caught:
        open_backend(path)
    message = str(caught.value)
    assert "built with TensorRT 10.0.1 for NVIDIA A100 (compute capability 8.0)" in message
    assert "this machine has TensorRT 10.3.0 and NVIDIA H100 (compute capability 9.0)" in message
    assert "rebuild it here with `sluice convert" in message


def test_an_engine_for_another_gpu_is_named(tmp_path: Path, trt: ModuleType) -> None:
    record = {"version": "10.3.0", "gpu": "NVIDIA A100", "compute_capability": "8.0"}
    path = write_plan(tmp_path, trt, record, compute_capability=(8, 0))
    with pytest.raises(
        BackendError, match=r"built with TensorRT 10.3.0 for NVIDIA A100 \(compute capability 8.0\)"
    ):
        open_backend(path)


def test_an_unreadable_conversion_record_does_not_stop_a_good_engine(
    tmp_path: Path, trt: ModuleType
) -> None:
    path = write_plan(tmp_path, trt)
    (path.parent / "conversion.json").write_text('{"tensorrt": [1, 2')
    backend = open_backend(path)
    backend.close()


def test_missing_cuda_python_is_named_with_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    install_tensorrt(monkeypatch)
    # As where cuda-python is installed and an earlier test imported cuda.bindings.runtime (as
    # test_cuda.py's collection does): hiding the package must hide its submodules too.
    install_cuda(monkeypatch, FakeCudaRuntime())
    hide_package(monkeypatch, "cuda")
    with pytest.raises(BackendError) as caught:
        TensorRTBackend(tmp_path / "model.plan", TensorRTOptions(), "model 'm' version 1")
    assert "the 'cuda-python' package" in str(caught.value)
    assert "pip install 'sluice[gpu]'" in str(caught.value)


def test_a_build_record_that_is_not_text_is_ignored(tmp_path: Path, trt: ModuleType) -> None:
    record = {"version": 10, "gpu": None, "compute_capability": 8.0}
    backend = open_backend(write_plan(tmp_path, trt, record))  # type: ignore[arg-type]
    backend.close()


def test_warm_up_runs_every_execution_context(tmp_path: Path, trt: ModuleType) -> None:
    groups = [InstanceGroup(count=3, kind="gpu", gpus=[0, 1])]
    backend = open_backend(write_plan(tmp_path, trt), groups)
    try:
        warm_up(backend, [1, 4], max_batch_size=8)
        contexts = [context for engine in trt.engines for context in engine.contexts]
        assert len(contexts) == 6
        assert [[shapes["x"] for shapes in c.executions] for c in contexts] == [
            [(1, 4), (4, 4)]
        ] * 6
    finally:
        backend.close()


@pytest.mark.parametrize("profiles", [[PROFILE_0], [SMALL, LARGE]], ids=["one", "two"])
def test_concurrent_batches_never_share_an_instance(
    tmp_path: Path, trt: ModuleType, profiles: list[dict[str, list[list[int]]]]
) -> None:
    groups = [InstanceGroup(count=2, kind="gpu", gpus=[0, 1])]
    backend = open_backend(write_plan(tmp_path, trt, profiles=profiles), groups)
    try:
        concurrent_batches(backend, 40)
    finally:
        backend.close()


def test_without_tensorrt_or_a_gpu_every_missing_piece_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hide_package(monkeypatch, "tensorrt")
    install_cuda(monkeypatch, FakeCudaRuntime(devices=[]))
    with pytest.raises(BackendError) as caught:
        TensorRTBackend(tmp_path / "model.plan", TensorRTOptions(), "model 'm' version 1")
    assert str(caught.value).startswith(
        "model 'm' version 1 needs TensorRT, but this machine lacks the 'tensorrt' package and "
        "a CUDA GPU (cudaGetDeviceCount() failed: cudaErrorNoDevice (no CUDA-capable device is "
        "detected)); on a machine with an NVIDIA GPU run pip install 'sluice[gpu]'"
    )


def test_without_a_loadable_cuda_driver_the_gpu_is_named_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # cuda-python 12.6-12.8 raise RuntimeError from any call when libcuda cannot be loaded (a
    # GPU install on a machine without the NVIDIA driver); that is a missing GPU, not a crash.
    install_tensorrt(monkeypatch)
    install_cuda(monkeypatch, FakeCudaRuntime(driver=False))
    with pytest.raises(BackendError) as caught:
        TensorRTBackend(tmp_path / "model.plan", TensorRTOptions(), "model 'm' version 1")
    assert str(caught.value).startswith(
        "model 'm' version 1 needs TensorRT, but this machine lacks a CUDA GPU (the CUDA driver "
        "does not load: Failed to dlopen libcuda.so.1); on a machine with an NVIDIA GPU run "
    )


def test_the_modules_import_without_tensorrt_and_a_load_names_what_is_missing() -> None:
    # In a child process where tensorrt and cuda-python cannot be imported, whatever this
    # machine has: importing the backend's modules must not need them; loading names both.
    code = (
        "import sys\n"
        "sys.modules.update(dict.fromkeys(['tensorrt', 'cuda']))\n"
        "from pathlib import Path\n"
        "from engine.backends.tensorrt import TensorRTBackend\n"
        "from engine.errors import BackendError\n"
        "from engine.model_config import TensorRTOptions\n"
        "try:\n"
        "    TensorRTBackend(Path('model.plan'), TensorRTOptions(), 'model m')\n"
        "except BackendError as exc:\n"
        "    print(exc)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=Path(__file__).resolve().parents[4],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert done.stdout.startswith(
        "model m needs TensorRT, but this machine lacks the 'tensorrt' package and the "
        "'cuda-python' package (cuda.bindings.runtime); on a machine with an NVIDIA GPU run "
        "pip install 'sluice[gpu]'"
    )
