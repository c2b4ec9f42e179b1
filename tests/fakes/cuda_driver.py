"""A fake `cuda.bindings.driver`, only what sluice calls of it, over a FakeCudaRuntime's memory
(the driver and the runtime share one address space, as on a GPU):

- `cuMemGetAddressRange(dptr) -> (CUresult, CUdeviceptr base, int size)`: the allocation (or
  opened IPC mapping) that holds `dptr`; `CUDA_ERROR_NOT_FOUND` for an address in none;
  `int(base)` is the address, as with cuda-python's `CUdeviceptr`;
- `cuGetErrorName` / `cuGetErrorString(CUresult) -> (CUresult, bytes)`."""

from __future__ import annotations

import enum
from typing import Any

from tests.fakes.cuda_runtime import FakeCudaRuntime


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_NOT_FOUND = 500


class CUdeviceptr:
    """A device address; `int()` gives it."""

    def __init__(self, value: int = 0) -> None:
        self._value = int(value)

    def __int__(self) -> int:
        return self._value


_TEXT = {
    CUresult.CUDA_SUCCESS: b"no error",
    CUresult.CUDA_ERROR_INVALID_VALUE: b"invalid argument",
    CUresult.CUDA_ERROR_NOT_FOUND: b"named symbol not found",
}


_Result = CUresult
_Pointer = CUdeviceptr


class FakeCudaDriver:
    """An instance stands in for the `cuda.bindings.driver` module."""

    CUresult = CUresult
    CUdeviceptr = CUdeviceptr

    def __init__(self, runtime: FakeCudaRuntime) -> None:
        self.__name__ = "cuda.bindings.driver"
        self.runtime = runtime

    def cuMemGetAddressRange(self, dptr: Any) -> tuple[_Result, _Pointer, int]:
        address = int(dptr)
        for base, allocation in self.runtime._device.items():
            if base <= address < base + len(allocation.memory):
                return CUresult.CUDA_SUCCESS, CUdeviceptr(base), len(allocation.memory)
        return CUresult.CUDA_ERROR_NOT_FOUND, CUdeviceptr(0), 0

    def cuGetErrorName(self, error: _Result) -> tuple[_Result, bytes]:
        return CUresult.CUDA_SUCCESS, CUresult(error).name.encode()

    def cuGetErrorString(self, error: _Result) -> tuple[_Result, bytes]:
        return CUresult.CUDA_SUCCESS, _TEXT[CUresult(error)]
