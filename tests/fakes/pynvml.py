"""A fake `pynvml` (nvidia-ml-py) with the real signatures: `nvmlInit()` first (every other
call raises NVMLError_Uninitialized before it), handles by index (an index past the count raises
NVMLError_InvalidArgument), `nvmlDeviceGetName` returns str (nvidia-ml-py >= 11.5),
utilization in percent, memory in bytes. Tests set `DEVICES` before importing code under test."""

from __future__ import annotations

from dataclasses import dataclass


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


class NVMLError_Uninitialized(NVMLError):
    def __init__(self) -> None:
        super().__init__(1)


class NVMLError_InvalidArgument(NVMLError):
    def __init__(self) -> None:
        super().__init__(2)


@dataclass
class c_nvmlUtilization_t:
    gpu: int
    memory: int


@dataclass
class c_nvmlMemory_t:
    total: int
    free: int
    used: int


@dataclass
class Device:
    name: str
    utilization_percent: int
    used_bytes: int
    total_bytes: int


DEVICES: list[Device] = []
_started = False


def nvmlInit() -> None:
    global _started
    _started = True


def nvmlShutdown() -> None:
    global _started
    _started = False


def _check() -> None:
    if not _started:
        raise NVMLError_Uninitialized()


def nvmlDeviceGetCount() -> int:
    _check()
    return len(DEVICES)


def nvmlDeviceGetHandleByIndex(index: int) -> Device:
    _check()
    if not 0 <= index < len(DEVICES):
        raise NVMLError_InvalidArgument()
    return DEVICES[index]


def nvmlDeviceGetName(handle: Device) -> str:
    _check()
    return handle.name


def nvmlDeviceGetUtilizationRates(handle: Device) -> c_nvmlUtilization_t:
    _check()
    return c_nvmlUtilization_t(handle.utilization_percent, 0)


def nvmlDeviceGetMemoryInfo(handle: Device) -> c_nvmlMemory_t:
    _check()
    return c_nvmlMemory_t(
        handle.total_bytes, handle.total_bytes - handle.used_bytes, handle.used_bytes
    )
