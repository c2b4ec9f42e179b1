"""The native TensorRT backend against fakes of cuda-python's runtime and TensorRT 10 that hold
the real contracts (tests/fakes): buffers, streams, shapes, errors and engine compatibility."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from engine.backends.cuda import Cuda
from engine.backends.tensorrt import TensorRTBackend
from engine.errors import BackendError, InvalidInput
from engine.model import warm_up
from engine.model_config import InstanceGroup, TensorRTOptions
from tests.fakes.cuda_runtime import FakeCudaRuntime, cudaDeviceProp, cudaError_t
from tests.fakes.install import install_cuda, install_tensorrt, real_cuda

TENSORS = [
    {"name": "x", "mode": "input", "dtype": "FLOAT", "shape": [-1, 4]},
    {"name": "ids", "mode": "input", "dtype": "INT64", "shape": [-1, -1]},
    {"name": "y", "mode": "output", "dtype": "FLOAT", "shape": [-1, 4], "copy_of": "x"},
    {"name": "ids_out", "mode": "output", "dtype": "INT64", "shape": [-1, -1], "copy_of": "ids"},
]
PROFILE_0 = {"x": [[1, 4], [4, 4], [8, 4]], "ids": [[1, 1], [4, 16], [8, 32]]}
PROFILE_1 = {"x": [[1, 4], [4, 4], [8, 4]], "ids": [[1, 1], [4, 64], [8, 64]]}


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


def write_plan(
    folder: Path, trt: ModuleType, record: dict[str, object] | None = None, **kw: object
) -> Path:
    version = folder / "1"
    version.mkdir(parents=True, exist_ok=True)
    path = version / "model.plan"
    path.write_bytes(trt.plan(TENSORS, kw.pop("profiles", [PROFILE_0]), **kw))  # type: ignore[arg-type]
    if record is not None:
        (version / "conversion.json").write_text(json.dumps({"tensorrt": record}))
    return path


def batch(rows: int, length: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "x": rng.standard_normal((rows, 4)).astype(np.float32),
        "ids": rng.integers(0, 1 << 40, (rows, length), dtype=np.int64),
    }


def open_backend(
    path: Path, groups: list[InstanceGroup] | None = None, **options: object
) -> TensorRTBackend:
    if groups is None:
        return TensorRTBackend(path, TensorRTOptions(**options), "model 'm' version 1")  # type: ignore[arg-type]
    return TensorRTBackend(path, TensorRTOptions(**options), "model 'm' version 1", groups)  # type: ignore[arg-type]


def test_batch_round_trips_through_device_buffers(tmp_path: Path, trt: ModuleType) -> None:
    backend = open_backend(write_plan(tmp_path, trt))
    try:
        for rows, length, seed in [(3, 10, 0), (8, 32, 1), (1, 1, 2)]:
            feed = batch(rows, length, seed)
            out = backend.run(feed)
            np.testing.assert_array_equal(out["y"], feed["x"])
            np.testing.assert_array_equal(out["ids_out"], feed["ids"])
            assert (out["y"].dtype, out["ids_out"].dtype) == (np.float32, np.int64)
    finally:
        backend.close()


def test_metadata_comes_from_the_engine(tmp_path: Path, trt: ModuleType) -> None:
    backend = open_backend(write_plan(tmp_path, trt))
    try:
        assert [(s.name, s.datatype, s.shape) for s in backend.inputs] == [
            ("x", "FP32", (-1, 4)), ("ids", "INT64", (-1, -1))
        ]  # fmt: skip
        assert [s.name for s in backend.outputs] == ["y", "ids_out"]
    finally:
        backend.close()


def test_buffers_and_streams_are_made_once_per_instance(
    tmp_path: Path, trt: ModuleType, cudart: FakeCudaRuntime
) -> None:
    backend = open_backend(write_plan(tmp_path, trt), [InstanceGroup(count=2, kind="gpu")])
    try:
        allocated = (cudart.malloc_calls, cudart.host_alloc_calls)
        assert cudart.streams_created == 2
        assert cudart.live_device_allocations == 2 * (4 + 1)  # every tensor and a block, each
        for seed in range(5):
            backend.run(batch(1 + seed, 2 + seed, seed))
        assert (cudart.malloc_calls, cudart.host_alloc_calls) == allocated
        assert cudart.pageable_copies == 0  # host side of every copy is pinned
        assert cudart.default_stream_uses == 0
        assert cudart.sync_copies == 0  # only async copies on the instance's stream
    finally:
        backend.close()
    assert (cudart.live_device_allocations, cudart.live_pinned_allocations) == (0, 0)
    assert cudart.live_streams == 0


def test_buffers_are_sized_for_the_profile_maximum(
    tmp_path: Path, trt: ModuleType, cudart: FakeCudaRuntime
) -> None:
    backend = open_backend(write_plan(tmp_path, trt))
    try:
        out = backend.run(batch(8, 32))  # the profile's max: must fit without reallocating
        assert out["ids_out"].shape == (8, 32)
        assert cudart.malloc_calls == 4 + 1  # the tensors and the activation block
    finally:
        backend.close()


def test_instances_live_on_their_gpus(
    tmp_path: Path, trt: ModuleType, cudart: FakeCudaRuntime
) -> None:
    backend = open_backend(
        write_plan(tmp_path, trt), [InstanceGroup(count=1, kind="gpu", gpus=[0, 1])]
    )
    try:
        assert (cudart.allocations_on(0), cudart.allocations_on(1)) == (5, 5)
        feed = batch(2, 5)
        for _ in range(4):  # whichever instance runs it, its device is made current first
            np.testing.assert_array_equal(backend.run(feed)["ids_out"], feed["ids"])
    finally:
        backend.close()


def test_an_absent_gpu_fails_the_load(tmp_path: Path, trt: ModuleType) -> None:
    with pytest.raises(BackendError, match=r"cudaSetDevice\(3\) failed: cudaErrorInvalidDevice"):
        open_backend(write_plan(tmp_path, trt), [InstanceGroup(kind="gpu", gpus=[3])])


def test_shape_outside_the_profile_is_invalid_input(tmp_path: Path, trt: ModuleType) -> None:
    backend = open_backend(write_plan(tmp_path, trt))
    try:
        with pytest.raises(InvalidInput) as caught:
            backend.run(batch(2, 40))
        assert str(caught.value) == (
            "input 'ids' has shape [2, 40]; the TensorRT engine's optimization profile 0 allows "
            "[1, 1] to [8, 32]"
        )
        np.testing.assert_array_equal(backend.run(batch(2, 7))["ids_out"], batch(2, 7)["ids"])
    finally:
        backend.close()


# Profiles as `sluice convert` builds them: one per preferred batch size bucket.
SMALL = {"x": [[1, 4], [4, 4], [4, 4]], "ids": [[1, 1], [4, 16], [4, 32]]}
LARGE = {"x": [[5, 4], [8, 4], [8, 4]], "ids": [[5, 1], [8, 16], [8, 32]]}


def test_each_batch_runs_on_the_profile_its_shapes_fit(
    tmp_path: Path, trt: ModuleType, cudart: FakeCudaRuntime
) -> None:
    path = write_plan(tmp_path, trt, profiles=[SMALL, LARGE])
    backend = open_backend(path, [InstanceGroup(count=2, kind="gpu")])
    try:
        for rows, seed in [(3, 0), (7, 1), (4, 2), (5, 3), (8, 4), (1, 5)]:
            feed = batch(rows, 9, seed)
            np.testing.assert_array_equal(backend.run(feed)["ids_out"], feed["ids"])
        # Each instance has a context per profile, each pinned to its profile for good.
        contexts = [context for engine in trt.engines for context in engine.contexts]
        assert [c.active_optimization_profile for c in contexts] == [0, 1, 0, 1]
        ran = {
            profile: sorted(s["x"][0] for c in contexts[profile::2] for s in c.executions)
            for profile in (0, 1)
        }
        assert ran == {0: [1, 3, 4], 1: [5, 7, 8]}
        # The contexts of one instance share its buffers (sized for the largest profile), its
        # activation block and its stream: 4 tensors, a block and a stream per instance.
        assert (cudart.live_device_allocations, cudart.live_streams) == (2 * (4 + 1), 2)
        assert cudart.malloc_calls == 2 * (4 + 1)
    finally:
        backend.close()


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


def test_an_instance_s_contexts_share_one_block_of_device_memory(
    tmp_path: Path, trt: ModuleType, cudart: FakeCudaRuntime
) -> None:
    # Each profile's context would otherwise allocate the engine's activation memory itself
    # (STATIC); an instance runs one batch at a time, so its contexts can share one block.
    path = write_plan(tmp_path, trt, profiles=[SMALL, LARGE], device_memory_bytes=3 << 20)
    backend = open_backend(path, [InstanceGroup(count=2, kind="gpu")])
    try:
        for rows in (2, 6):
            feed = batch(rows, 5, rows)
            np.testing.assert_array_equal(backend.run(feed)["ids_out"], feed["ids"])
        contexts = [context for engine in trt.engines for context in engine.contexts]
        assert {c.strategy for c in contexts} == {
            trt.ExecutionContextAllocationStrategy.USER_MANAGED
        }
        blocks = [c.scratch for c in contexts]
        assert blocks[0] == blocks[1] != blocks[2] == blocks[3]  # per instance, not per context
        assert all(size == 3 << 20 for _, size in blocks)
        assert cudart.live_device_allocations == 2 * (4 + 1)  # tensors and one block each
    finally:
        backend.close()
    assert cudart.live_device_allocations == 0


def test_a_shape_no_profile_allows_names_each_profile(tmp_path: Path, trt: ModuleType) -> None:
    backend = open_backend(write_plan(tmp_path, trt, profiles=[SMALL, LARGE]))
    try:
        with pytest.raises(InvalidInput) as caught:
            backend.run(batch(6, 40))
        assert str(caught.value) == (
            "input 'ids' has shape [6, 40]; the TensorRT engine's optimization profiles allow "
            "[1, 1] to [4, 32] (profile 0) or [5, 1] to [8, 32] (profile 1)"
        )
        with pytest.raises(InvalidInput, match=r"^inputs x \[3, 4\] and ids \[6, 5\] fit no"):
            backend.run({"x": batch(3, 5)["x"], "ids": batch(6, 5)["ids"]})
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
        BackendError, match=r"needs 67108864 bytes .*workspace_bytes allows 1048576"
    ):
        open_backend(path, workspace_bytes=1 << 20)


@pytest.mark.parametrize(
    "call",
    ["cudaMemcpyAsync", "cudaStreamSynchronize", "cudaSetDevice"],
)
def test_a_failed_cuda_call_is_a_backend_error_naming_it(
    tmp_path: Path, trt: ModuleType, cudart: FakeCudaRuntime, call: str
) -> None:
    backend = open_backend(write_plan(tmp_path, trt))
    try:
        cudart.fail_next(call, cudaError_t.cudaErrorIllegalAddress)
        with pytest.raises(BackendError) as caught:
            backend.run(batch(2, 3))
        assert f"{call}" in str(caught.value)
        assert "cudaErrorIllegalAddress (an illegal memory access was encountered)" in str(
            caught.value
        )
    finally:
        backend.close()


def test_a_failed_allocation_at_load_names_the_call(
    tmp_path: Path, trt: ModuleType, cudart: FakeCudaRuntime
) -> None:
    cudart.fail_next("cudaMalloc", cudaError_t.cudaErrorMemoryAllocation)
    with pytest.raises(
        BackendError, match=r"cudaMalloc\(\d+\) failed: cudaErrorMemoryAllocation \(out of memory\)"
    ):
        open_backend(write_plan(tmp_path, trt))
    assert cudart.live_device_allocations == 0  # what was allocated before the failure is freed
    assert cudart.live_streams == 0


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
    monkeypatch.setitem(__import__("sys").modules, "cuda", None)  # import cuda -> ImportError
    with pytest.raises(BackendError) as caught:
        TensorRTBackend(tmp_path / "model.plan", TensorRTOptions(), "model 'm' version 1")
    assert "the 'cuda-python' package" in str(caught.value)
    assert "pip install 'sluice[gpu]'" in str(caught.value)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        ("create_execution_context", r"create_execution_context\(\) on GPU 0 returned None"),
        ("set_tensor_address", r"set_tensor_address\('x'\) returned False"),
    ],
)
def test_tensorrt_refusals_at_load_are_named(
    tmp_path: Path, trt: ModuleType, cudart: FakeCudaRuntime, call: str, message: str
) -> None:
    trt.refuse.add(call)
    with pytest.raises(BackendError, match=message):
        open_backend(write_plan(tmp_path, trt))
    assert (cudart.live_device_allocations, cudart.live_streams) == (0, 0)


def test_a_refused_execution_is_a_backend_error(tmp_path: Path, trt: ModuleType) -> None:
    backend = open_backend(write_plan(tmp_path, trt))
    try:
        trt.refuse.add("execute_async_v3")
        with pytest.raises(BackendError, match="execute_async_v3 returned False"):
            backend.run(batch(2, 3))
        trt.refuse.clear()  # the instance is usable again
        np.testing.assert_array_equal(backend.run(batch(2, 3))["y"], batch(2, 3)["x"])
    finally:
        backend.close()


def test_a_data_dependent_output_shape_is_refused_at_load(tmp_path: Path, trt: ModuleType) -> None:
    path = write_plan(tmp_path, trt)
    tensors = [*TENSORS[:2], {"name": "nz", "mode": "output", "dtype": "INT64", "shape": [-1, 2]}]
    path.write_bytes(trt.plan(tensors, [PROFILE_0]))
    with pytest.raises(BackendError, match=r"output 'nz' has data-dependent shape \[-1, 2\]"):
        open_backend(path)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"dtype": "BF16"}, "tensor 'x' has type DataType.BF16, which sluice cannot serve"),
        ({"shape_tensor": True}, "input 'x' is a shape tensor"),
    ],
)
def test_tensors_the_backend_cannot_feed_are_refused_at_load(
    tmp_path: Path, trt: ModuleType, change: dict[str, object], message: str
) -> None:
    path = write_plan(tmp_path, trt)
    path.write_bytes(trt.plan([{**TENSORS[0], **change}, *TENSORS[1:]], [PROFILE_0]))
    with pytest.raises(BackendError, match=re.escape(message)):
        open_backend(path)


def test_a_build_record_that_is_not_text_is_ignored(tmp_path: Path, trt: ModuleType) -> None:
    record = {"version": 10, "gpu": None, "compute_capability": 8.0}
    backend = open_backend(write_plan(tmp_path, trt, record))  # type: ignore[arg-type]
    backend.close()


def test_close_frees_the_rest_when_one_free_fails(
    tmp_path: Path, trt: ModuleType, cudart: FakeCudaRuntime
) -> None:
    backend = open_backend(write_plan(tmp_path, trt))
    cudart.fail_next("cudaFree", cudaError_t.cudaErrorIllegalAddress)
    backend.close()  # logged, not raised: closing must not stop at the first failure
    assert cudart.live_device_allocations == 1
    assert (cudart.live_pinned_allocations, cudart.live_streams) == (0, 0)


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


def concurrent_batches(backend: TensorRTBackend, count: int) -> None:
    feeds = [batch(1 + seed % 8, 1 + seed % 32, seed) for seed in range(count)]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(backend.run, feeds))
    for feed, out in zip(feeds, results, strict=True):
        np.testing.assert_array_equal(out["y"], feed["x"])
        np.testing.assert_array_equal(out["ids_out"], feed["ids"])


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


REAL, WHY_NOT_REAL = real_cuda()


@pytest.mark.gpu
@pytest.mark.skipif(REAL is None, reason=WHY_NOT_REAL)
def test_real_cuda_buffers_and_streams_under_a_fake_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Real cuda-python: device and pinned buffers, streams, async copies and syncs; the fake
    engine's kernels are device-to-device copies on the instance's real stream."""
    fake_trt = install_tensorrt(monkeypatch)
    _, capability = Cuda(REAL).properties(0)
    major, minor = (int(part) for part in capability.split("."))
    wide = {"x": [[1, 4], [8, 4], [8, 4]], "ids": [[1, 1], [8, 32], [8, 32]]}
    backend = open_backend(
        write_plan(tmp_path, fake_trt, compute_capability=(major, minor), profiles=[wide]),
        [InstanceGroup(count=2, kind="gpu")],
    )
    try:
        concurrent_batches(backend, 200)
    finally:
        backend.close()
    # Two profiles: each instance's contexts share its real buffers and stream.
    backend = open_backend(
        write_plan(tmp_path, fake_trt, compute_capability=(major, minor), profiles=[SMALL, LARGE]),
        [InstanceGroup(count=2, kind="gpu")],
    )
    try:
        concurrent_batches(backend, 200)
    finally:
        backend.close()


def test_without_tensorrt_or_a_gpu_every_missing_piece_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(__import__("sys").modules, "tensorrt", None)
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


def test_a_failed_stream_call_names_the_stream_by_its_handle(
    tmp_path: Path, trt: ModuleType, cudart: FakeCudaRuntime
) -> None:
    backend = open_backend(write_plan(tmp_path, trt))
    try:
        cudart.fail_next("cudaStreamSynchronize", cudaError_t.cudaErrorIllegalAddress)
        with pytest.raises(BackendError, match=r"^cudaStreamSynchronize\(stream 0x5000\) failed"):
            backend.run(batch(2, 3))
    finally:
        backend.close()


def test_a_refused_profile_switch_is_a_backend_error_naming_it(
    tmp_path: Path, trt: ModuleType, cudart: FakeCudaRuntime
) -> None:
    # TensorRT's Python binding raises RuntimeError here (PY_ASSERT_RUNTIME_ERROR), where the
    # C++ call returns false: the load must still fail with a BackendError, freeing what it made.
    trt.refuse.add("set_optimization_profile_async")
    with pytest.raises(BackendError) as caught:
        open_backend(write_plan(tmp_path, trt))
    assert str(caught.value) == (
        "set_optimization_profile_async(0) on GPU 0 failed: Error in set optimization profile "
        "async."
    )
    assert (cudart.live_device_allocations, cudart.live_streams) == (0, 0)
