"""Real CUDA kernels (cupy) for the gpu-marked tests: cupy arrays over device memory that
engine/backends/cuda.py owns, a kernel that holds a stream busy, and a kernel for the fake
TensorRT engine (tests/fakes/tensorrt.py's `kernel` hook) that computes each output on the
instance's real stream. cupy is imported by the caller (tests/fakes/install.py `real_cupy`), so
this module imports without it."""

from __future__ import annotations

from typing import Any

import numpy as np

SPIN = r"""
extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) {}
}
"""


def device_array(cupy: Any, pointer: int, shape: tuple[int, ...], dtype: Any) -> Any:
    """A cupy array over `pointer` (memory cupy does not own, on the current device)."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    memory = cupy.cuda.UnownedMemory(pointer, max(nbytes, 1), None)
    return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(memory, 0))


class Kernels:
    """Compiled once per test: `spin` (about a millisecond of one GPU thread's time, so work
    queued behind it on the same stream visibly waits) and `engine`, the fake engine's kernel."""

    def __init__(self, cupy: Any, cycles: int = 2_000_000) -> None:
        self.cupy = cupy
        self.cycles = np.int64(cycles)
        self._spin = cupy.RawKernel(SPIN, "spin")
        self._spin.compile()

    def spin(self, stream_handle: int) -> None:
        """Hold the stream busy (launched on it; returns at once)."""
        with self.cupy.cuda.ExternalStream(stream_handle):
            self._spin((1,), (1,), (self.cycles,))

    def engine(
        self,
        *,
        output: int,
        source: int,
        shape: tuple[int, ...],
        dtype: type,
        profile: int,
        stream_handle: int,
    ) -> bool:
        """`output = source * 2 + profile` on the stream, after a spin: a copy-out that did not
        wait for it would read the previous batch's values."""
        cupy = self.cupy
        self.spin(stream_handle)
        with cupy.cuda.ExternalStream(stream_handle):
            out = device_array(cupy, output, shape, dtype)
            cupy.multiply(device_array(cupy, source, shape, dtype), 2, out=out)
            cupy.add(out, profile, out=out)
        return True


def engine_expected(array: np.ndarray, profile: int) -> np.ndarray:
    """What `Kernels.engine` computes on the host."""
    result: np.ndarray = array * 2 + profile
    return result.astype(array.dtype)
