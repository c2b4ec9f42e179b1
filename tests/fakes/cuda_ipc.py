"""CUDA IPC for the fake runtime (tests/fakes/cuda_runtime.py), holding cuda-python's contract:

- `cudaIpcGetMemHandle(devPtr) -> (err, cudaIpcMemHandle_t)`; the handle is
  `CUDA_IPC_HANDLE_SIZE` (64) bytes, readable through `getPtr()` (the address of its storage:
  what cuda-bindings 13 leaves, and what tritonclient's `get_raw_handle` reads) and, as in
  cuda-python 12, through its `reserved` field;
- `cudaIpcOpenMemHandle(handle, flags) -> (err, devPtr)`: `handle` must be a
  `cudaIpcMemHandle_t` (TypeError otherwise, as the real binding raises), `flags` an int
  (`cudaIpcMemLazyEnablePeerAccess`); the memory is mapped into the *current* device's address
  space; a handle that no process exported answers `cudaErrorInvalidValue`;
- `cudaIpcCloseMemHandle(devPtr) -> (err,)`: only a pointer that `cudaIpcOpenMemHandle` gave,
  once (`cudaErrorInvalidValue` otherwise);
- the opened mapping spans exactly the exported allocation: a copy past its end is an error
  (`cudaErrorInvalidValue`), as a copy past any allocation is in the fake.

So that two processes (a test and the `sluice serve` it started) share the memory, as real IPC
does, an exported allocation moves into a file of /dev/shm (`sluice-fake-cuda-*`, unlinked when
the exporter frees it) that it and every importer map: copies on either side are real and seen
by the other. The handle's bytes name that file."""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import struct
import tempfile
import uuid
from pathlib import Path
from typing import Any

CUDA_IPC_HANDLE_SIZE = 64
_MAGIC = b"FAKEIPC1"
_LAYOUT = struct.Struct("<8sIQ44s")  # magic, device, size, file name: 64 bytes
_FOLDER = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())


class cudaIpcMemHandle_t:
    """An IPC handle: 64 bytes of storage at `getPtr()`; `reserved` as in cuda-python 12."""

    def __init__(self) -> None:
        self._storage = ctypes.create_string_buffer(CUDA_IPC_HANDLE_SIZE)

    def getPtr(self) -> int:
        return ctypes.addressof(self._storage)

    @property
    def reserved(self) -> bytes:
        return self._storage.raw

    @reserved.setter
    def reserved(self, value: bytes) -> None:
        if len(value) != CUDA_IPC_HANDLE_SIZE:
            raise ValueError(f"reserved length must be 64, is {len(value)}")
        ctypes.memmove(self._storage, bytes(value), CUDA_IPC_HANDLE_SIZE)


_Handle = cudaIpcMemHandle_t


class IpcMixin:
    """The IPC calls of FakeCudaRuntime (it provides `_failure`, `_device`, `_addresses`,
    `current_device`, `devices` and the error enum)."""

    cudaIpcMemHandle_t = cudaIpcMemHandle_t
    CUDA_IPC_HANDLE_SIZE = CUDA_IPC_HANDLE_SIZE
    cudaIpcMemLazyEnablePeerAccess = 1

    _exported: dict[int, Path]
    _opened: set[int]
    _failure: Any
    _device: dict[int, Any]
    _addresses: Any
    devices: list[Any]
    current_device: int

    def cudaIpcGetMemHandle(self, devPtr: int) -> tuple[Any, _Handle]:
        errors = type(self).cudaError_t  # type: ignore[attr-defined]
        handle = cudaIpcMemHandle_t()
        if (failed := self._failure("cudaIpcGetMemHandle")) is not None:
            return failed, handle
        allocation = self._device.get(int(devPtr))
        if allocation is None:  # not the start of a live allocation
            return errors.cudaErrorInvalidValue, handle
        path = self._exported.get(int(devPtr))
        if path is None:
            path = _FOLDER / f"sluice-fake-cuda-{uuid.uuid4().hex[:16]}"
            size = len(allocation.memory)
            path.write_bytes(bytes(allocation.memory))
            allocation.memory = _map(path, size)
            self._exported[int(devPtr)] = path
        raw = _LAYOUT.pack(_MAGIC, allocation.device, len(allocation.memory), path.name.encode())
        handle.reserved = raw
        return errors.cudaSuccess, handle

    def cudaIpcOpenMemHandle(self, handle: Any, flags: int) -> tuple[Any, int]:
        errors = type(self).cudaError_t  # type: ignore[attr-defined]
        if not isinstance(handle, cudaIpcMemHandle_t):
            raise TypeError(
                "Argument 'handle' is not instance of type (expected <class "
                f"'cuda.bindings.runtime.cudaIpcMemHandle_t'>, got {type(handle).__name__})"
            )
        if not isinstance(flags, int):
            raise TypeError(f"an integer is required, got {type(flags).__name__}")
        if (failed := self._failure("cudaIpcOpenMemHandle")) is not None:
            return failed, 0
        magic, device, size, name = _LAYOUT.unpack(handle.reserved)
        path = _FOLDER / name.rstrip(b"\0").decode(errors="replace")
        if magic != _MAGIC or device >= len(self.devices) or not path.is_file():
            return errors.cudaErrorInvalidValue, 0
        from tests.fakes.cuda_runtime import _Allocation

        address = next(self._addresses)
        self._device[address] = _Allocation(self.current_device, _map(path, size))
        self._opened.add(address)
        return errors.cudaSuccess, address

    def cudaIpcCloseMemHandle(self, devPtr: int) -> tuple[Any]:
        errors = type(self).cudaError_t  # type: ignore[attr-defined]
        if (failed := self._failure("cudaIpcCloseMemHandle")) is not None:
            return (failed,)
        if int(devPtr) not in self._opened:
            return (errors.cudaErrorInvalidValue,)
        self._opened.discard(int(devPtr))
        _unmap(self._device.pop(int(devPtr)).memory)
        return (errors.cudaSuccess,)

    @property
    def open_ipc_mappings(self) -> int:
        """Pointers cudaIpcOpenMemHandle gave that are not closed yet."""
        return len(self._opened)

    def _forget_export(self, devPtr: int, memory: Any) -> None:
        """cudaFree of an exported allocation: its file's name goes (importers keep mapping it)."""
        path = self._exported.pop(devPtr, None)
        if path is not None:
            path.unlink(missing_ok=True)
            _unmap(memory)


def _map(path: Path, size: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def _unmap(memory: Any) -> None:
    if isinstance(memory, mmap.mmap):
        with contextlib.suppress(BufferError):  # a view is alive: it closes when collected
            memory.close()
