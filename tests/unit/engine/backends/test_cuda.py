"""engine.backends.cuda: checked cuda-python calls, device and pinned buffers, streams. Every
test runs against the fake runtime; the same tests run against the real cuda-python on a CUDA
machine (`-m gpu`), which is how scripts/gpu-check.sh exercises the real buffer and stream code
where TensorRT is absent."""

from __future__ import annotations

import numpy as np
import pytest

from engine.backends.cuda import Cuda, DeviceBuffer, PinnedBuffer, Stream, load_runtime
from engine.errors import BackendError
from tests.cupy_kernels import Kernels, device_array
from tests.fakes.cuda_runtime import FakeCudaRuntime
from tests.fakes.install import install_cuda, real_cuda, real_cupy

REAL, WHY_NOT_REAL = real_cuda()
CUPY, WHY_NO_CUPY = real_cupy()


@pytest.fixture(
    params=[
        "fake",
        pytest.param(
            "real",
            marks=[pytest.mark.gpu, pytest.mark.skipif(REAL is None, reason=WHY_NOT_REAL)],
        ),
    ]
)
def cuda(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Cuda:
    if request.param == "fake":
        fake = FakeCudaRuntime()
        install_cuda(monkeypatch, fake)
        runtime = load_runtime()
        assert runtime is fake  # the code under test imports the fake through the seam
    else:
        runtime = REAL
    checked = Cuda(runtime)
    checked.call("cudaSetDevice", 0)
    return checked


def test_a_host_to_device_to_host_round_trip_on_a_stream(cuda: Cuda) -> None:
    data = np.random.default_rng(0).integers(0, 256, 1 << 16, dtype=np.uint8)
    device = DeviceBuffer(cuda, data.nbytes)
    source, target = PinnedBuffer(cuda, data.nbytes), PinnedBuffer(cuda, data.nbytes)
    stream = Stream(cuda)
    try:
        source.bytes[:] = data
        target.bytes[:] = 0
        stream.copy_in(device, source, data.nbytes)
        stream.copy_out(target, device, data.nbytes)
        stream.synchronize()
        np.testing.assert_array_equal(target.bytes, data)
    finally:
        for owned in (stream, device, source, target):
            owned.close()


def test_copies_wait_for_the_stream(cuda: Cuda) -> None:
    """Each batch's copies are complete after its stream sync, never stale from the last."""
    device = DeviceBuffer(cuda, 4096)
    host_in, host_out = PinnedBuffer(cuda, 4096), PinnedBuffer(cuda, 4096)
    stream = Stream(cuda)
    try:
        for value in (1, 2, 3):
            host_in.bytes[:] = value
            stream.copy_in(device, host_in, 4096)
            stream.copy_out(host_out, device, 4096)
            stream.synchronize()
            assert set(host_out.bytes.tolist()) == {value}
    finally:
        for owned in (stream, device, host_in, host_out):
            owned.close()


def test_a_copy_past_the_allocation_is_an_error_naming_the_call(cuda: Cuda) -> None:
    device = DeviceBuffer(cuda, 1024)
    host = PinnedBuffer(cuda, 4096)
    stream = Stream(cuda)
    try:
        with pytest.raises(BackendError, match=r"^cudaMemcpyAsync\(.*4096, cudaMemcpyHostToDevice"):
            stream.copy_in(device, host, 4096)  # refused at once: CUDA knows each allocation
    finally:
        for owned in (stream, device, host):
            owned.close()


def test_freeing_twice_is_refused_by_cuda_and_once_by_the_buffer(cuda: Cuda) -> None:
    device = DeviceBuffer(cuda, 256)
    pointer = device.ptr
    device.close()
    device.close()  # a second close is a no-op, not a double free
    with pytest.raises(
        BackendError,
        match=r"^cudaFree\(0x[0-9a-f]+\) failed: cudaErrorInvalid(Value|DevicePointer) ",
    ):
        cuda.call("cudaFree", pointer)


def test_an_invalid_device_names_the_call_and_the_error(cuda: Cuda) -> None:
    with pytest.raises(BackendError) as caught:
        cuda.call("cudaSetDevice", 4096)
    assert str(caught.value) == (
        "cudaSetDevice(4096) failed: cudaErrorInvalidDevice (invalid device ordinal)"
    )


def test_device_properties_are_text(cuda: Cuda) -> None:
    name, capability = cuda.properties(0)
    assert isinstance(name, str)
    assert name
    assert "\0" not in name
    major, minor = capability.split(".")
    assert int(major) >= 3
    assert int(minor) >= 0


def test_the_kind_must_be_the_enum(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the old backend got wrong: cudaMemcpy* take cudaMemcpyKind, not an int. Only the
    fake refuses an int on every call: cuda-python 12.6 fails with AttributeError, 12.9 takes
    it, so the real module cannot be asked (the code passes enums, which all of them take)."""
    install_cuda(monkeypatch, FakeCudaRuntime())
    cuda = Cuda(load_runtime())
    device = DeviceBuffer(cuda, 64)
    host = PinnedBuffer(cuda, 64)
    stream = Stream(cuda)
    try:
        with pytest.raises(TypeError):
            cuda.rt.cudaMemcpyAsync(device.ptr, host.ptr, 64, 1, stream.handle)
    finally:
        for owned in (stream, device, host):
            owned.close()


# -- the real runtime against real kernels (cupy), where a GPU, cuda-python and cupy are ----------


@pytest.fixture
def real() -> Cuda:
    if REAL is None or CUPY is None:
        pytest.skip(WHY_NO_CUPY)
    checked = Cuda(REAL)
    checked.call("cudaSetDevice", 0)
    CUPY.cuda.Device(0).use()
    return checked


@pytest.mark.gpu
def test_a_kernel_on_the_stream_runs_between_its_copies(real: Cuda) -> None:
    """Copy in, a cupy kernel launched on the same (non-blocking) stream, copy out, one sync:
    the copy out waits for the kernel (which first spins a millisecond), with no sync between."""
    kernels = Kernels(CUPY)
    count = 1 << 20
    data = np.random.default_rng(1).standard_normal(count).astype(np.float32)
    device = DeviceBuffer(real, data.nbytes)
    source, target = PinnedBuffer(real, data.nbytes), PinnedBuffer(real, data.nbytes)
    stream = Stream(real)
    try:
        assert real.call("cudaStreamGetFlags", stream.handle) == 1  # cudaStreamNonBlocking
        for round_ in range(3):
            source.bytes[:] = (data + round_).view(np.uint8)
            stream.copy_in(device, source, data.nbytes)
            kernels.spin(int(stream))
            with CUPY.cuda.ExternalStream(int(stream)):
                values = device_array(CUPY, device.ptr, (count,), np.float32)
                CUPY.multiply(values, 2, out=values)
            stream.copy_out(target, device, data.nbytes)
            stream.synchronize()
            np.testing.assert_array_equal(target.bytes.view(np.float32), (data + round_) * 2)
    finally:
        for owned in (stream, device, source, target):
            owned.close()


@pytest.mark.gpu
def test_pinned_buffers_are_page_locked_until_closed(real: Cuda) -> None:
    host = PinnedBuffer(real, 1 << 20)
    pointer = host.ptr
    # cudaMemoryTypeHost: page-locked memory the device reaches directly (async copies).
    assert memory_type(pointer) == 1
    host.close()
    assert memory_type(pointer) == 0  # cudaMemoryTypeUnregistered: freed


def memory_type(pointer: int) -> int:
    try:
        return int(CUPY.cuda.runtime.pointerGetAttributes(pointer).type)
    except CUPY.cuda.runtime.CUDARuntimeError:  # older CUDA: an unknown pointer is an error
        return 0


@pytest.mark.gpu
def test_closing_returns_the_device_memory(real: Cuda) -> None:
    size = 256 << 20
    slack = 16 << 20  # the driver's own bookkeeping moves a little
    free_before, _ = CUPY.cuda.runtime.memGetInfo()
    owned: list[DeviceBuffer | Stream] = [
        DeviceBuffer(real, size),
        DeviceBuffer(real, size),
        Stream(real),
    ]
    free_during, _ = CUPY.cuda.runtime.memGetInfo()
    assert free_before - free_during >= 2 * size - slack
    for item in owned:
        item.close()
    free_after, _ = CUPY.cuda.runtime.memGetInfo()
    assert abs(free_before - free_after) <= slack
