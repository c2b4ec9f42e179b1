"""One TensorRT instance on one GPU, and the run of a batch on it.

Each instance owns, on its GPU: an execution context per optimization profile it may use (all
of them unless `tensorrt.profile` names one), a non-blocking CUDA stream, one block of
activation memory (the contexts are USER_MANAGED and share it), and a device buffer plus a
pinned host buffer per tensor, shared by its contexts and sized at load for the largest shapes
of its profiles (grown only if an engine reports a larger one). A batch is: choose the
profile whose ranges hold its shapes (a shape none holds is bad input naming each profile's
range), set input shapes, async copies in, one `execute_async_v3`, async copies out, one stream
sync. No allocation per batch.

Imports neither TensorRT nor cuda-python: the backend (engine/backends/tensorrt.py) hands each
instance its deserialized engine and the checked CUDA runtime."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from engine.backends.cuda import Cuda, DeviceBuffer, PinnedBuffer, Stream
from engine.backends.tensorrt_profiles import Limits, Profiles, Shape
from engine.backends.tensorrt_specs import numpy_type, profile_limits
from engine.errors import BackendError


class _Tensor:
    """One tensor's device and pinned host buffers, grown only when a larger size is needed, and
    bound to every execution context of its instance."""

    def __init__(self, cuda: Cuda, contexts: list[Any], name: str, dtype: np.dtype[Any]) -> None:
        self.cuda, self.contexts, self.name, self.dtype = cuda, contexts, name, dtype
        self.device: DeviceBuffer | None = None
        self.host: PinnedBuffer | None = None

    def reserve(self, nbytes: int) -> None:
        if self.device is not None and self.device.nbytes >= nbytes:
            return
        self.close()
        self.device = DeviceBuffer(self.cuda, nbytes)
        self.host = PinnedBuffer(self.cuda, nbytes)
        for context in self.contexts:
            if not context.set_tensor_address(self.name, self.device.ptr):
                raise BackendError(f"set_tensor_address('{self.name}') returned False")

    def close(self) -> None:
        buffers, self.device, self.host = (self.device, self.host), None, None
        failure = None
        for buffer in buffers:
            try:
                if buffer is not None:
                    buffer.close()
            except BackendError as exc:  # free the other buffer all the same
                failure = failure or exc
        if failure is not None:
            raise failure


class Instance:
    """One instance on one GPU: a stream, a buffer pair per tensor, and an execution context per
    optimization profile it may use, each context pinned to its profile for good (switching a
    context's profile makes TensorRT update layer resources on its next run). Its contexts share
    the stream and buffers: an instance runs one batch at a time, as a Triton instance does."""

    def __init__(self, cuda: Cuda, device: int, usable: list[int], specs: Any) -> None:
        self.cuda, self.device, self.usable = cuda, device, usable
        self.inputs, self.outputs = specs
        self.tensors: dict[str, _Tensor] = {}
        self.stream: Stream | None = None
        self.contexts: dict[int, Any] = {}
        self.profiles = Profiles({})
        self.scratch: DeviceBuffer | None = None
        """The contexts' activation memory: one block, as they never run at the same time."""

    def start(self, engine: Any, user_managed: Any, scratch_bytes: int) -> None:
        """Create the stream, contexts and buffers (`close` frees whatever a failure left).
        `user_managed` is TensorRT's ExecutionContextAllocationStrategy.USER_MANAGED:
        otherwise each context would allocate `scratch_bytes` of its own."""
        cuda, device = self.cuda, self.device
        cuda.call("cudaSetDevice", device)
        self.stream = Stream(cuda)
        # 256-byte alignment is required; cudaMalloc aligns to at least that.
        self.scratch = DeviceBuffer(cuda, max(scratch_bytes, 256))
        limits: dict[int, dict[str, Limits]] = {}
        for profile in self.usable:
            context = engine.create_execution_context(user_managed)
            if context is None:
                raise BackendError(f"create_execution_context() on GPU {device} returned None")
            self.contexts[profile] = context
            if hasattr(context, "set_device_memory"):  # TensorRT >= 10.1
                context.set_device_memory(self.scratch.ptr, self.scratch.nbytes)
            else:
                context.device_memory = self.scratch.ptr
            try:  # the binding raises RuntimeError where the C++ call returns false
                switched = context.set_optimization_profile_async(profile, int(self.stream))
            except RuntimeError as exc:
                raise BackendError(
                    f"set_optimization_profile_async({profile}) on GPU {device} failed: {exc}"
                ) from exc
            if not switched:
                raise BackendError(f"set_optimization_profile_async({profile}) returned False")
            limits[profile] = {s.name: profile_limits(engine, s, profile) for s in self.inputs}
        self.stream.synchronize()  # the profile switches are done before any shape is set
        self.profiles = Profiles(limits)
        contexts = list(self.contexts.values())
        for spec in (*self.inputs, *self.outputs):
            dtype = np.dtype(numpy_type(spec.datatype))
            self.tensors[spec.name] = _Tensor(cuda, contexts, spec.name, dtype)
        # Sized once for the largest shapes of every profile, so no batch reallocates.
        needed = dict.fromkeys(self.tensors, 0)
        for profile, context in self.contexts.items():
            for spec in self.inputs:
                largest = self.profiles.largest(profile, spec.name)
                self._set_shape(context, profile, spec.name, largest)
                needed[spec.name] = max(needed[spec.name], self._nbytes(spec.name, largest))
            for spec in self.outputs:
                shape = tuple(context.get_tensor_shape(spec.name))
                if any(size < 0 for size in shape):
                    raise BackendError(
                        f"output '{spec.name}' has data-dependent shape {list(shape)}; this "
                        "backend needs output shapes that follow from the input shapes"
                    )
                needed[spec.name] = max(needed[spec.name], self._nbytes(spec.name, shape))
        for name, nbytes in needed.items():
            self.tensors[name].reserve(nbytes)

    def _nbytes(self, name: str, shape: Sequence[int]) -> int:
        return _nbytes(shape, self.tensors[name].dtype)

    def _set_shape(self, context: Any, profile: int, name: str, shape: Shape) -> None:
        if not context.set_input_shape(name, shape):
            raise BackendError(
                f"set_input_shape('{name}', {list(shape)}) returned False on optimization "
                f"profile {profile}, which allows that shape"
            )

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        assert self.stream is not None
        self.cuda.call("cudaSetDevice", self.device)  # worker threads are not tied to a GPU
        arrays = {}
        for spec in self.inputs:
            dtype = self.tensors[spec.name].dtype
            arrays[spec.name] = np.ascontiguousarray(inputs[spec.name], dtype=dtype)
        profile = self.profiles.choose({name: a.shape for name, a in arrays.items()})
        context = self.contexts[profile]
        for name, array in arrays.items():
            self._set_shape(context, profile, name, array.shape)
        shapes = {s.name: tuple(context.get_tensor_shape(s.name)) for s in self.outputs}
        for name, shape in shapes.items():
            self.tensors[name].reserve(_nbytes(shape, self.tensors[name].dtype))
        for name, array in arrays.items():
            tensor = self.tensors[name]
            tensor.reserve(array.nbytes)
            assert tensor.host is not None
            assert tensor.device is not None
            tensor.host.bytes[: array.nbytes] = array.reshape(-1).view(np.uint8)
            self.stream.copy_in(tensor.device, tensor.host, array.nbytes)
        if not context.execute_async_v3(int(self.stream)):
            raise BackendError("execute_async_v3 returned False (TensorRT's log says why)")
        for name, shape in shapes.items():
            tensor = self.tensors[name]
            assert tensor.host is not None
            assert tensor.device is not None
            self.stream.copy_out(tensor.host, tensor.device, _nbytes(shape, tensor.dtype))
        self.stream.synchronize()
        results = {}
        for name, shape in shapes.items():
            tensor = self.tensors[name]
            assert tensor.host is not None
            count = _nbytes(shape, tensor.dtype)
            # Copied out: the pinned buffer is reused by the next batch.
            results[name] = tensor.host.bytes[:count].view(tensor.dtype).reshape(shape).copy()
        return results

    def close(self) -> None:
        """Free everything, each step even when an earlier one failed (the first error is
        raised at the end)."""
        steps: list[Callable[[], object]] = [lambda: self.cuda.call("cudaSetDevice", self.device)]
        if self.stream is not None:
            steps.append(self.stream.synchronize)  # nothing in flight uses a freed buffer
        steps += [tensor.close for tensor in self.tensors.values()]
        if self.scratch is not None:
            steps.append(self.scratch.close)
        if self.stream is not None:
            steps.append(self.stream.close)
        failures = []
        for step in steps:
            try:
                step()
            except BackendError as exc:
                failures.append(exc)
        self.stream, self.contexts, self.tensors, self.scratch = None, {}, {}, None
        if failures:
            raise failures[0]


def _nbytes(shape: Sequence[int], dtype: np.dtype[Any]) -> int:
    return int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
