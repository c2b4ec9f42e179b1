"""cuda-python's runtime (`cuda.bindings.runtime`), called as documented: enum arguments, every
call's `(cudaError_t, value...)` result checked, a failure raised as a BackendError that names
the call, its arguments and CUDA's own name and text for the error. Device buffers, pinned host
buffers and non-blocking streams are owned objects with an explicit `close()`.

Imported lazily by the TensorRT backend and the CUDA shared-memory regions
(engine/cuda_regions.py), so CPU-only installs never load it. `load_runtime` and `load_driver`
are the one place each module is imported (tests put fakes of them in `sys.modules`)."""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from engine.errors import BackendError


def load_runtime() -> Any:
    """The `cuda.bindings.runtime` module (ImportError without cuda-python >= 12.6)."""
    from cuda.bindings import runtime

    return runtime


def load_driver() -> Any:
    """The `cuda.bindings.driver` module (ImportError without cuda-python >= 12.6)."""
    from cuda.bindings import driver

    return driver


IPC_HANDLE_BYTES = 64
"""The size of a `cudaIpcMemHandle_t` (CUDA_IPC_HANDLE_SIZE): what cudaIpcGetMemHandle gives."""


class Cuda:
    """Checked calls into one runtime module."""

    def __init__(self, runtime: Any) -> None:
        self.rt = runtime
        self.ok = runtime.cudaError_t.cudaSuccess
        try:  # cuda-python >= 12.9.1 deprecates int(stream) in favour of this
            from cuda.bindings.utils import get_cuda_native_handle

            self._native: Any = get_cuda_native_handle
        except ImportError:
            self._native = int
        self.to_device = runtime.cudaMemcpyKind.cudaMemcpyHostToDevice
        self.to_host = runtime.cudaMemcpyKind.cudaMemcpyDeviceToHost
        self.no_device = ""
        """Why `device_count()` last answered 0 (empty when it has not)."""

    def call(self, name: str, *args: Any) -> Any:
        """`runtime.<name>(*args)`'s value (None, one value, or a tuple of them)."""
        err, *values = getattr(self.rt, name)(*args)
        if err != self.ok:
            raise BackendError(
                f"{name}({', '.join(self._show(a) for a in args)}) failed: {self.describe(err)}"
            )
        if not values:
            return None
        return values[0] if len(values) == 1 else tuple(values)

    def describe(self, err: Any) -> str:
        """CUDA's name and text for an error, e.g. `cudaErrorInvalidValue (invalid argument)`."""
        _, name = self.rt.cudaGetErrorName(err)
        _, text = self.rt.cudaGetErrorString(err)
        return f"{_text(name)} ({_text(text)})"

    def native_handle(self, obj: Any) -> int:
        """The address behind a CUDA object such as a stream (what TensorRT takes)."""
        return int(self._native(obj))

    def device_count(self) -> int:
        """CUDA devices visible to this process; 0, with the reason in `no_device`, when there
        are none or the driver does not load."""
        try:
            err, count = self.rt.cudaGetDeviceCount()
        except RuntimeError as exc:  # cuda-python < 12.9 raises when libcuda cannot be loaded
            self.no_device = f"the CUDA driver does not load: {exc}"
            return 0
        if err != self.ok:
            self.no_device = f"cudaGetDeviceCount() failed: {self.describe(err)}"
            return 0
        if not count:
            self.no_device = "the CUDA driver reports no devices"
        return int(count)

    def properties(self, device: int) -> tuple[str, str]:
        """(name, compute capability as "major.minor") of a device."""
        props = self.call("cudaGetDeviceProperties", device)
        return _text(props.name), f"{props.major}.{props.minor}"

    def ipc_handle(self, raw: bytes) -> Any:
        """A `cudaIpcMemHandle_t` holding `raw`, a handle's IPC_HANDLE_BYTES as another process's
        cudaIpcGetMemHandle gave them. Written through `getPtr()` (the address of the handle's
        storage), which cuda-python 12 and 13 both have: 13 dropped the `reserved` field."""
        if len(raw) != IPC_HANDLE_BYTES:
            raise ValueError(f"a CUDA IPC handle is {IPC_HANDLE_BYTES} bytes, got {len(raw)}")
        handle = self.rt.cudaIpcMemHandle_t()
        ctypes.memmove(handle.getPtr(), raw, IPC_HANDLE_BYTES)
        return handle

    def _show(self, arg: Any) -> str:
        name = getattr(arg, "name", None)
        if isinstance(name, str):  # an enum member (cuda-python's enums are IntEnum-like)
            return name
        if isinstance(arg, int) and arg > 1 << 32:
            return hex(arg)
        if isinstance(arg, int):
            return str(arg)
        if isinstance(arg, self.rt.cudaStream_t):  # getPtr() is its storage, not the handle
            return f"stream {self.native_handle(arg):#x}"
        return repr(arg)


class DeviceBuffer:
    """`nbytes` of device memory on the current device."""

    def __init__(self, cuda: Cuda, nbytes: int) -> None:
        self._cuda = cuda
        self.nbytes = nbytes
        self.ptr: int = int(cuda.call("cudaMalloc", nbytes))

    def close(self) -> None:
        if self.ptr:
            ptr, self.ptr = self.ptr, 0
            self._cuda.call("cudaFree", ptr)


class PinnedBuffer:
    """`nbytes` of page-locked host memory, so async copies are truly async (pageable memory
    makes the driver stage through its own buffer, synchronously)."""

    def __init__(self, cuda: Cuda, nbytes: int) -> None:
        self._cuda = cuda
        self.nbytes = nbytes
        self.ptr: int = int(cuda.call("cudaMallocHost", nbytes))
        memory = (ctypes.c_char * max(nbytes, 1)).from_address(self.ptr)
        self.bytes = np.frombuffer(memoryview(memory).cast("B"), np.uint8)

    def close(self) -> None:
        if self.ptr:
            ptr, self.ptr = self.ptr, 0
            del self.bytes
            self._cuda.call("cudaFreeHost", ptr)


class Stream:
    """A non-blocking stream: its work never waits on the legacy default stream, so instances
    on one device overlap."""

    def __init__(self, cuda: Cuda) -> None:
        self._cuda = cuda
        # cudaStreamNonBlocking is 0x01 in CUDA's ABI; the module exports it as a constant.
        flags = getattr(cuda.rt, "cudaStreamNonBlocking", 1)
        self.handle: Any = cuda.call("cudaStreamCreateWithFlags", flags)

    def __int__(self) -> int:
        return self._cuda.native_handle(self.handle)

    def copy_in(self, device: DeviceBuffer, host: PinnedBuffer, nbytes: int) -> None:
        self._cuda.call(
            "cudaMemcpyAsync", device.ptr, host.ptr, nbytes, self._cuda.to_device, self.handle
        )

    def copy_out(self, host: PinnedBuffer, device: DeviceBuffer, nbytes: int) -> None:
        self._cuda.call(
            "cudaMemcpyAsync", host.ptr, device.ptr, nbytes, self._cuda.to_host, self.handle
        )

    def synchronize(self) -> None:
        self._cuda.call("cudaStreamSynchronize", self.handle)

    def close(self) -> None:
        if self.handle is not None:
            handle, self.handle = self.handle, None
            self._cuda.call("cudaStreamDestroy", handle)


def allocation_range(driver: Any, ptr: int) -> tuple[int, int]:
    """(base, size) of the device allocation (or opened IPC mapping) holding `ptr`, from the
    driver's cuMemGetAddressRange; BackendError naming the driver's error when it holds none."""
    err, base, size = driver.cuMemGetAddressRange(ptr)
    if err != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(err)
        _, text = driver.cuGetErrorString(err)
        raise BackendError(f"cuMemGetAddressRange({ptr:#x}) failed: {_text(name)} ({_text(text)})")
    return int(base), int(size)


def _text(value: Any) -> str:
    return value.decode(errors="replace").rstrip("\0") if isinstance(value, bytes) else str(value)
