"""An instance of the TensorRT backend on its GPU, against fakes of cuda-python's runtime and
TensorRT 10 that hold the real contracts (tests/fakes): its buffers, stream and contexts, the
profile each batch runs on, the errors of its CUDA and TensorRT calls, and what close frees."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from engine.backends.cuda import Cuda
from engine.errors import BackendError, InvalidInput
from engine.model_config import InstanceGroup
from tests.cupy_kernels import Kernels, engine_expected
from tests.fakes.cuda_runtime import FakeCudaRuntime, cudaError_t
from tests.fakes.install import install_tensorrt, real_cuda, real_cupy
from tests.unit.engine.backends.tensorrt_plans import (
    LARGE,
    PROFILE_0,
    SMALL,
    TENSORS,
    batch,
    concurrent_batches,
    open_backend,
    write_plan,
)


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


def test_close_frees_the_rest_when_one_free_fails(
    tmp_path: Path, trt: ModuleType, cudart: FakeCudaRuntime
) -> None:
    backend = open_backend(write_plan(tmp_path, trt))
    cudart.fail_next("cudaFree", cudaError_t.cudaErrorIllegalAddress)
    backend.close()  # logged, not raised: closing must not stop at the first failure
    assert cudart.live_device_allocations == 1
    assert (cudart.live_pinned_allocations, cudart.live_streams) == (0, 0)


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


def test_the_engine_kernel_hook_runs_on_the_instances_stream(
    tmp_path: Path, trt: ModuleType, cudart: FakeCudaRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CPU twin of the cupy test below: the same hook and expectations, the kernel queued on
    the fake stream (so the outputs exist only once the instance syncs it)."""

    def kernel(
        *,
        output: int,
        source: int,
        shape: tuple[int, ...],
        dtype: type,
        profile: int,
        stream_handle: int,
    ) -> bool:
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize

        def run() -> None:
            src, out = cudart.device_memory(source, nbytes), cudart.device_memory(output, nbytes)
            assert src is not None
            assert out is not None
            values = np.frombuffer(src, dtype).reshape(shape)
            out[:] = engine_expected(values, profile).tobytes()

        return cudart.enqueue(stream_handle, run)

    monkeypatch.setattr(trt, "kernel", kernel)
    plan = write_plan(tmp_path, trt, profiles=[SMALL, LARGE])
    backend = open_backend(plan, [InstanceGroup(count=2, kind="gpu")])
    feeds = [batch(1 + seed % 8, 1 + seed % 32, seed) for seed in range(24)]
    try:
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(backend.run, feeds))
    finally:
        backend.close()
    for feed, out in zip(feeds, results, strict=True):
        profile = 0 if len(feed["x"]) <= 4 else 1  # SMALL holds batches 1-4, LARGE 5-8
        np.testing.assert_array_equal(out["y"], engine_expected(feed["x"], profile))
        np.testing.assert_array_equal(out["ids_out"], engine_expected(feed["ids"], profile))


CUPY, WHY_NO_CUPY = real_cupy()


@pytest.mark.gpu
@pytest.mark.skipif(CUPY is None, reason=WHY_NO_CUPY)
def test_real_kernels_on_each_instances_stream_and_profile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fake engine's kernels are real (cupy, launched on the stream TensorRT is given): each
    output is `input * 2 + profile`, after a spin that makes a copy-out that does not wait read
    stale memory. Two instances on GPU 0, two profiles (batches 1-4 and 5-8), four threads: each
    answer comes from its own batch, its instance's stream and the profile that holds it."""
    fake_trt = install_tensorrt(monkeypatch)
    kernels = Kernels(CUPY)
    monkeypatch.setattr(fake_trt, "kernel", kernels.engine)
    _, capability = Cuda(REAL).properties(0)
    major, minor = (int(part) for part in capability.split("."))
    profiles = [SMALL, LARGE]
    plan = write_plan(tmp_path, fake_trt, compute_capability=(major, minor), profiles=profiles)
    backend = open_backend(plan, [InstanceGroup(count=2, kind="gpu")])
    feeds = [batch(1 + seed % 8, 1 + seed % 32, seed) for seed in range(120)]
    try:
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(backend.run, feeds))
    finally:
        backend.close()
    for feed, out in zip(feeds, results, strict=True):
        profile = 0 if len(feed["x"]) <= 4 else 1  # SMALL holds batches 1-4, LARGE 5-8
        np.testing.assert_array_equal(out["y"], engine_expected(feed["x"], profile))
        np.testing.assert_array_equal(out["ids_out"], engine_expected(feed["ids"], profile))
