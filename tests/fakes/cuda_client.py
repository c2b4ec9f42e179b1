"""A client process's CUDA, on its own fake runtime: device allocations and the raw IPC handles
it registers with the server (whose runtime is another FakeCudaRuntime, in this process or in a
`sluice serve` child: the two share the memory through /dev/shm, tests/fakes/cuda_ipc.py)."""

from __future__ import annotations

import base64

from tests.fakes.cuda_runtime import FakeCudaRuntime


class IpcClient:
    """Allocations made by a test, freed by `free()` (which unlinks their shared files)."""

    def __init__(self) -> None:
        self.rt = FakeCudaRuntime()
        self.pointers: list[int] = []

    def allocate(self, data: bytes) -> tuple[int, bytes]:
        """(device pointer, raw 64-byte handle) of a new allocation holding `data`."""
        err, ptr = self.rt.cudaMalloc(len(data))
        assert err == 0, err
        self.pointers.append(ptr)
        self.put(ptr, data)
        err, handle = self.rt.cudaIpcGetMemHandle(ptr)
        assert err == 0, err
        return ptr, handle.reserved

    @staticmethod
    def b64(handle: bytes) -> str:
        """The handle as an HTTP register body carries it (tritonclient's get_raw_handle)."""
        return base64.b64encode(handle).decode()

    def put(self, ptr: int, data: bytes) -> None:
        view = self.rt.device_memory(ptr, len(data))
        assert view is not None
        view[:] = data

    def get(self, ptr: int, size: int) -> bytes:
        view = self.rt.device_memory(ptr, size)
        assert view is not None
        return bytes(view)

    def free(self) -> None:
        for ptr in self.pointers:
            self.rt.cudaFree(ptr)
        self.pointers.clear()
