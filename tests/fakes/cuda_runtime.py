"""A fake `cuda.bindings.runtime` (cuda-python 12.x/13.x) that holds the real module's contract.

What is the same as the real module:
- every function returns a tuple whose first element is a `cudaError_t` member, followed by the
  call's values (`cudaMalloc(n) -> (err, ptr)`, `cudaFree(p) -> (err,)`);
- enum parameters are typed: `cudaMemcpyAsync(..., kind=1, ...)` raises TypeError, and so does
  `cudaGetErrorString(0)` (cuda-python 12.6 fails on an int there too, with AttributeError;
  12.9 accepts ints: `FakeCudaRuntime(int_enums=True)` behaves so), so code passing here
  passes on every cuda-python 12 release;
- streams are `cudaStream_t` objects: `int(stream)` (or `get_cuda_native_handle`) is the handle
  TensorRT takes, while `getPtr()` is the address of the object's own storage, as in the real
  module;
- without a loadable driver, cuda-python 12.6-12.8 raise RuntimeError("Failed to dlopen
  libcuda.so.1") from any call (`FakeCudaRuntime(driver=False)`), where 12.9 answers
  `cudaErrorInsufficientDriver`;
- async work is queued on its stream and only happens at `cudaStreamSynchronize` (so a reader
  that skips the sync sees stale memory, as it may on a GPU);
- the legacy default stream (0 or None) works, and each use is counted;
- misuse answers an error code, never an exception: a copy past an allocation, a freed or
  unknown pointer, an unknown or destroyed stream, an invalid device.
- CUDA IPC (`cudaIpcGetMemHandle`, `cudaIpcOpenMemHandle`, `cudaIpcCloseMemHandle`) works across
  processes: tests/fakes/cuda_ipc.py says how; tests/fakes/cuda_driver.py is the driver over
  the same memory.

Device memory is host memory in a separate fake address range; pinned host memory is real host
memory (ctypes buffers), so `np.ctypeslib`/`ctypes.from_address` views work as on a GPU machine.
Counters (`malloc_calls`, `pageable_copies`, ...) let tests assert what the code under test did,
and `fail_next(name, error)` makes the next call of one function return an error."""

from __future__ import annotations

import ctypes
import enum
import itertools
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tests.fakes.cuda_ipc import IpcMixin


class cudaError_t(enum.IntEnum):
    cudaSuccess = 0
    cudaErrorInvalidValue = 1
    cudaErrorMemoryAllocation = 2
    cudaErrorInvalidDevicePointer = 17
    cudaErrorInvalidMemcpyDirection = 21
    cudaErrorNoDevice = 100
    cudaErrorInvalidDevice = 101
    cudaErrorInvalidResourceHandle = 400
    cudaErrorIllegalAddress = 700


class cudaMemcpyKind(enum.IntEnum):
    cudaMemcpyHostToHost = 0
    cudaMemcpyHostToDevice = 1
    cudaMemcpyDeviceToHost = 2
    cudaMemcpyDeviceToDevice = 3
    cudaMemcpyDefault = 4


_MESSAGES = {
    cudaError_t.cudaSuccess: "no error",
    cudaError_t.cudaErrorInvalidValue: "invalid argument",
    cudaError_t.cudaErrorMemoryAllocation: "out of memory",
    cudaError_t.cudaErrorInvalidDevicePointer: "invalid device pointer",
    cudaError_t.cudaErrorInvalidMemcpyDirection: "invalid copy direction for memcpy",
    cudaError_t.cudaErrorNoDevice: "no CUDA-capable device is detected",
    cudaError_t.cudaErrorInvalidDevice: "invalid device ordinal",
    cudaError_t.cudaErrorInvalidResourceHandle: "invalid resource handle",
    cudaError_t.cudaErrorIllegalAddress: "an illegal memory access was encountered",
}

_DEVICE_BASE = 0xF000_0000_0000_0000  # above any host address, so the two never mix up
_DEVICE_SPAN = 1 << 48


class cudaStream_t:
    """A stream handle; `int()` gives the value TensorRT's `execute_async_v3` takes."""

    def __init__(self, init_value: int = 0) -> None:
        self._value = int(init_value)

    def __int__(self) -> int:
        # cuda-bindings >= 12.9.1: "Using int(cuda_obj) to retrieve the underlying address of a
        # CUDA object is deprecated"; get_cuda_native_handle() is the way.
        warnings.warn(
            "int(cuda_obj) is deprecated; use cuda.bindings.utils.get_cuda_native_handle",
            DeprecationWarning,
            stacklevel=2,
        )
        return self._value

    def getPtr(self) -> int:
        """The address of this object's storage (not the stream handle), as in cuda-python."""
        return 0x7F00_0000_0000 + id(self) % (1 << 32) * 16

    def __repr__(self) -> str:
        return f"<cudaStream_t {self._value:#x}>"


@dataclass
class cudaDeviceProp:
    """The fields of the real struct that callers read."""

    name: bytes = b"NVIDIA Fake GPU"
    major: int = 9
    minor: int = 0
    totalGlobalMem: int = 80 << 30


@dataclass
class _Allocation:
    device: int
    memory: Any  # a bytearray, or an mmap once exported through IPC (tests/fakes/cuda_ipc.py)


@dataclass
class _Stream:
    device: int
    pending: list[Callable[[], None]] = field(default_factory=list)


def _err(code: cudaError_t) -> tuple[cudaError_t]:
    return (code,)


OK = cudaError_t.cudaSuccess


class FakeCudaRuntime(IpcMixin):
    """An instance stands in for the `cuda.bindings.runtime` module."""

    cudaError_t = cudaError_t
    cudaMemcpyKind = cudaMemcpyKind
    cudaStream_t = cudaStream_t
    cudaDeviceProp = cudaDeviceProp
    cudaStreamDefault = 0
    cudaStreamNonBlocking = 1
    cudaHostAllocDefault = 0
    cudaHostAllocPortable = 1

    def __init__(
        self,
        devices: list[cudaDeviceProp] | None = None,
        *,
        int_enums: bool = False,
        driver: bool = True,
    ) -> None:
        self.__name__ = "cuda.bindings.runtime"
        self.int_enums = int_enums
        self.driver = driver
        self.devices = [cudaDeviceProp()] if devices is None else devices
        self._thread = threading.local()  # the current device is per host thread, as in CUDA
        self._device: dict[int, _Allocation] = {}
        self._exported: dict[int, Any] = {}  # allocations exported through IPC -> their file
        self._opened: set[int] = set()  # pointers cudaIpcOpenMemHandle gave
        self._pinned: dict[int, ctypes.Array[ctypes.c_char]] = {}
        self._streams: dict[int, _Stream] = {}
        self._addresses = itertools.count(_DEVICE_BASE, 1 << 24)
        self._handles = itertools.count(0x5000)
        self._failures: dict[str, cudaError_t] = {}
        self.malloc_calls = 0
        self.free_calls = 0
        self.host_alloc_calls = 0
        self.streams_created = 0
        self.pageable_copies = 0
        self.sync_copies = 0
        self.default_stream_uses = 0
        self._default_stream = _Stream(0)
        self.calls: list[str] = []

    @property
    def current_device(self) -> int:
        return getattr(self._thread, "device", 0)

    @current_device.setter
    def current_device(self, device: int) -> None:
        self._thread.device = device

    # -- test controls -------------------------------------------------------------------------

    def fail_next(self, name: str, error: cudaError_t) -> None:
        """The next call of function `name` returns `error` and does nothing."""
        self._failures[name] = error

    @property
    def live_device_allocations(self) -> int:
        return len(self._device)

    def allocations_on(self, device: int) -> int:
        """Live device allocations on one device."""
        return sum(1 for a in self._device.values() if a.device == device)

    @property
    def live_streams(self) -> int:
        return len(self._streams)

    @property
    def live_pinned_allocations(self) -> int:
        return len(self._pinned)

    def _failure(self, name: str) -> cudaError_t | None:
        self.calls.append(name)
        if not self.driver:
            raise RuntimeError("Failed to dlopen libcuda.so.1")
        return self._failures.pop(name, None)

    # -- devices -------------------------------------------------------------------------------

    def cudaGetDeviceCount(self) -> tuple[cudaError_t, int]:
        if (failed := self._failure("cudaGetDeviceCount")) is not None:
            return failed, 0
        if not self.devices:
            return cudaError_t.cudaErrorNoDevice, 0
        return OK, len(self.devices)

    def cudaSetDevice(self, device: int) -> tuple[cudaError_t]:
        if (failed := self._failure("cudaSetDevice")) is not None:
            return _err(failed)
        if not isinstance(device, int) or isinstance(device, bool):
            raise TypeError(f"an integer is required, got {type(device).__name__}")
        if not 0 <= device < len(self.devices):
            return _err(cudaError_t.cudaErrorInvalidDevice)
        self.current_device = device
        return _err(OK)

    def cudaGetDevice(self) -> tuple[cudaError_t, int]:
        self._failure("cudaGetDevice")
        return OK, self.current_device

    def cudaGetDeviceProperties(self, device: int) -> tuple[cudaError_t, cudaDeviceProp]:
        if (failed := self._failure("cudaGetDeviceProperties")) is not None:
            return failed, cudaDeviceProp()
        if not 0 <= device < len(self.devices):
            return cudaError_t.cudaErrorInvalidDevice, cudaDeviceProp()
        return OK, self.devices[device]

    def cudaGetErrorString(self, error: cudaError_t) -> tuple[cudaError_t, bytes]:
        error = self._enum("error", error, cudaError_t)
        return OK, _MESSAGES[error].encode()

    def cudaGetErrorName(self, error: cudaError_t) -> tuple[cudaError_t, bytes]:
        error = self._enum("error", error, cudaError_t)
        return OK, error.name.encode()

    def _enum(self, argument: str, value: Any, kind: type[enum.IntEnum]) -> Any:
        if self.int_enums and isinstance(value, int) and not isinstance(value, kind):
            return kind(value)
        _typed(argument, value, kind)
        return value

    # -- memory --------------------------------------------------------------------------------

    def cudaMalloc(self, size: int) -> tuple[cudaError_t, int]:
        if (failed := self._failure("cudaMalloc")) is not None:
            return failed, 0
        if size < 0:
            raise OverflowError("can't convert negative value to size_t")
        self.malloc_calls += 1
        if size == 0:
            return OK, 0
        address = next(self._addresses)
        self._device[address] = _Allocation(self.current_device, bytearray(size))
        return OK, address

    def cudaFree(self, devPtr: int) -> tuple[cudaError_t]:
        if (failed := self._failure("cudaFree")) is not None:
            return _err(failed)
        self.free_calls += 1
        if int(devPtr) == 0:
            return _err(OK)
        if int(devPtr) in self._opened:  # an IPC mapping closes with cudaIpcCloseMemHandle
            return _err(cudaError_t.cudaErrorInvalidValue)
        allocation = self._device.pop(int(devPtr), None)
        if allocation is None:
            return _err(cudaError_t.cudaErrorInvalidValue)
        self._forget_export(int(devPtr), allocation.memory)
        return _err(OK)

    def cudaMallocHost(self, size: int) -> tuple[cudaError_t, int]:
        return self._host_alloc("cudaMallocHost", size)

    def cudaHostAlloc(self, size: int, flags: int) -> tuple[cudaError_t, int]:
        if not isinstance(flags, int):
            raise TypeError(f"an integer is required, got {type(flags).__name__}")
        return self._host_alloc("cudaHostAlloc", size)

    def _host_alloc(self, name: str, size: int) -> tuple[cudaError_t, int]:
        if (failed := self._failure(name)) is not None:
            return failed, 0
        if size < 0:
            raise OverflowError("can't convert negative value to size_t")
        self.host_alloc_calls += 1
        buffer = ctypes.create_string_buffer(max(size, 1))
        address = ctypes.addressof(buffer)
        self._pinned[address] = buffer
        return OK, address

    def cudaFreeHost(self, ptr: int) -> tuple[cudaError_t]:
        if (failed := self._failure("cudaFreeHost")) is not None:
            return _err(failed)
        if self._pinned.pop(int(ptr), None) is None:
            return _err(cudaError_t.cudaErrorInvalidValue)
        return _err(OK)

    def cudaMemcpy(
        self, dst: int, src: int, count: int, kind: cudaMemcpyKind
    ) -> tuple[cudaError_t]:
        kind = self._enum("kind", kind, cudaMemcpyKind)
        if (failed := self._failure("cudaMemcpy")) is not None:
            return _err(failed)
        self.sync_copies += 1
        for stream in [self._default_stream, *self._streams.values()]:
            self._drain(stream)  # the legacy default stream waits for all others
        copy = self._plan_copy(int(dst), int(src), count, kind)
        if isinstance(copy, cudaError_t):
            return _err(copy)
        copy()
        return _err(OK)

    def cudaMemcpyAsync(
        self, dst: int, src: int, count: int, kind: cudaMemcpyKind, stream: Any
    ) -> tuple[cudaError_t]:
        kind = self._enum("kind", kind, cudaMemcpyKind)
        if (failed := self._failure("cudaMemcpyAsync")) is not None:
            return _err(failed)
        queue = self._stream(stream)
        if queue is None:
            return _err(cudaError_t.cudaErrorInvalidResourceHandle)
        copy = self._plan_copy(int(dst), int(src), count, kind)
        if isinstance(copy, cudaError_t):
            return _err(copy)
        queue.pending.append(copy)
        return _err(OK)

    def _plan_copy(
        self, dst: int, src: int, count: int, kind: cudaMemcpyKind
    ) -> Callable[[], None] | cudaError_t:
        if count < 0:
            raise OverflowError("can't convert negative value to size_t")
        dst_on_device = kind in (
            cudaMemcpyKind.cudaMemcpyHostToDevice,
            cudaMemcpyKind.cudaMemcpyDeviceToDevice,
        )
        src_on_device = kind in (
            cudaMemcpyKind.cudaMemcpyDeviceToHost,
            cudaMemcpyKind.cudaMemcpyDeviceToDevice,
        )
        if kind in (cudaMemcpyKind.cudaMemcpyHostToHost, cudaMemcpyKind.cudaMemcpyDefault):
            return cudaError_t.cudaErrorInvalidMemcpyDirection  # the fake supports explicit kinds
        target = self._device_view(dst, count) if dst_on_device else self._host_view(dst, count)
        source = self._device_view(src, count) if src_on_device else self._host_view(src, count)
        if target is None or source is None:
            return cudaError_t.cudaErrorInvalidValue

        def run() -> None:
            target[:] = bytes(source)

        return run

    def _device_view(self, address: int, count: int) -> memoryview | None:
        for base, allocation in self._device.items():
            if base <= address < base + len(allocation.memory):
                offset = address - base
                if offset + count > len(allocation.memory):
                    return None  # past the end of the allocation
                return memoryview(allocation.memory)[offset : offset + count]
        return None

    def _host_view(self, address: int, count: int) -> memoryview | None:
        if _DEVICE_BASE <= address < _DEVICE_BASE + _DEVICE_SPAN:
            return None  # a device pointer where a host pointer belongs
        pinned = any(
            base <= address and address + count <= base + ctypes.sizeof(buffer)
            for base, buffer in self._pinned.items()
        )
        if not pinned:
            self.pageable_copies += 1
        return memoryview((ctypes.c_char * count).from_address(address)).cast("B")

    # -- streams -------------------------------------------------------------------------------

    def cudaStreamCreate(self) -> tuple[cudaError_t, cudaStream_t]:
        return self._create_stream("cudaStreamCreate")

    def cudaStreamCreateWithFlags(self, flags: int) -> tuple[cudaError_t, cudaStream_t]:
        if not isinstance(flags, int):
            raise TypeError(f"an integer is required, got {type(flags).__name__}")
        return self._create_stream("cudaStreamCreateWithFlags")

    def _create_stream(self, name: str) -> tuple[cudaError_t, cudaStream_t]:
        if (failed := self._failure(name)) is not None:
            return failed, cudaStream_t(0)
        handle = next(self._handles)
        self._streams[handle] = _Stream(self.current_device)
        self.streams_created += 1
        return OK, cudaStream_t(handle)

    def cudaStreamSynchronize(self, stream: Any) -> tuple[cudaError_t]:
        if (failed := self._failure("cudaStreamSynchronize")) is not None:
            return _err(failed)
        queue = self._stream(stream)
        if queue is None:
            return _err(cudaError_t.cudaErrorInvalidResourceHandle)
        self._drain(queue)
        return _err(OK)

    def cudaStreamDestroy(self, stream: Any) -> tuple[cudaError_t]:
        if (failed := self._failure("cudaStreamDestroy")) is not None:
            return _err(failed)
        queue = self._streams.pop(_handle(stream), None)
        if queue is None:
            return _err(cudaError_t.cudaErrorInvalidResourceHandle)
        self._drain(queue)
        return _err(OK)

    def _stream(self, stream: Any) -> _Stream | None:
        handle = _handle(stream)
        if handle == 0:
            # The legacy default stream works, as on a GPU, but serialises every instance's
            # work: counted so tests can assert the code under test never uses it.
            self.default_stream_uses += 1
            return self._default_stream
        return self._streams.get(handle)

    def _drain(self, queue: _Stream) -> None:
        pending, queue.pending = queue.pending, []
        for work in pending:
            work()

    def enqueue(self, stream: Any, work: Callable[[], None]) -> bool:
        """Queue `work` on a stream (what a kernel launch does); for the fake TensorRT."""
        queue = self._stream(stream)
        if queue is None:
            return False
        queue.pending.append(work)
        return True

    def device_memory(self, address: int, count: int) -> memoryview | None:
        """A view of fake device memory, for the fake TensorRT's kernels."""
        return self._device_view(address, count)


def get_cuda_native_handle(obj: cudaStream_t) -> int:
    """`cuda.bindings.utils.get_cuda_native_handle`: the address behind a CUDA object."""
    if not isinstance(obj, cudaStream_t):
        raise TypeError(f"unsupported type {type(obj).__name__}")
    return obj._value


def _handle(stream: Any) -> int:
    if stream is None:
        return 0
    if isinstance(stream, cudaStream_t):
        return stream._value
    if isinstance(stream, int):
        return stream
    raise TypeError(f"Argument 'stream' is not instance of type (expected <class 'int'>, or "
                    f"cudaStream_t), got {type(stream).__name__}")  # fmt: skip


def _typed(argument: str, value: Any, kind: type) -> None:
    if not isinstance(value, kind):
        raise TypeError(
            f"Argument '{argument}' has incorrect type (expected {kind.__name__}, "
            f"got {type(value).__name__})"
        )
