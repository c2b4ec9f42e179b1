"""TensorRT backend for `model.plan` engines (TensorRT 10 Python API, cuda-python runtime).

Each instance owns, on its GPU: an execution context per optimization profile it may use (all
of them unless `tensorrt.profile` names one), a non-blocking CUDA stream, one block of
activation memory (the contexts are USER_MANAGED and share it), and a device buffer plus a
pinned host buffer per tensor, shared by its contexts and sized at load for the largest shapes
of its profiles (grown only if an engine reports a larger one). A batch is: choose the
profile whose ranges hold its shapes (a shape none holds is bad input naming each profile's
range), set input shapes, async copies in, one `execute_async_v3`, async copies out, one stream
sync. No allocation per batch.

Before deserializing, the engine's `conversion.json` (written by `sluice convert`) is checked
against this machine's TensorRT version and GPU compute capability, so a plan built elsewhere
fails with what differs and how to rebuild, instead of TensorRT's bare None.

Needs an NVIDIA GPU, `tensorrt` and `cuda-python` (both in the `gpu` extra); everything is
imported lazily so CPU-only installs never touch them. Tested here against fakes that hold the
real contracts (tests/fakes); `scripts/gpu-check.sh` runs the real thing."""

from __future__ import annotations

import importlib
import json
import logging
import queue
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from engine.backends.cuda import Cuda, DeviceBuffer, PinnedBuffer, Stream, load_runtime
from engine.backends.tensorrt_profiles import Limits, Profiles, Shape
from engine.errors import BackendError
from engine.model_config import InstanceGroup, TensorRTOptions
from engine.types import TensorSpec

log = logging.getLogger("sluice.backend.tensorrt")

_NP_TO_V2 = {"float32": "FP32", "float16": "FP16", "int32": "INT32", "int64": "INT64",
             "int8": "INT8", "uint8": "UINT8", "bool": "BOOL"}  # fmt: skip
INSTALL = "pip install 'sluice[gpu]' --extra-index-url https://pypi.nvidia.com"
REBUILD = "sluice convert SOURCE --target tensorrt --repository REPO"


def import_gpu_modules(label: str) -> tuple[Any, Cuda]:
    """(tensorrt, checked cuda runtime), or a BackendError naming every missing piece."""
    missing: list[str] = []
    trt: Any = None
    cuda: Cuda | None = None
    try:
        trt = importlib.import_module("tensorrt")
    except ImportError:
        missing.append("the 'tensorrt' package")
    try:
        cuda = Cuda(load_runtime())
    except ImportError:
        missing.append("the 'cuda-python' package (cuda.bindings.runtime)")
    if cuda is not None and cuda.device_count() == 0:
        missing.append(f"a CUDA GPU ({cuda.no_device})")
    if missing:
        raise BackendError(
            f"{label} needs TensorRT, but this machine lacks {' and '.join(missing)}; on a "
            f"machine with an NVIDIA GPU run {INSTALL}, or serve the ONNX model"
        )
    assert cuda is not None
    return trt, cuda


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


class _Instance:
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
            limits[profile] = {s.name: _limits(engine, s, profile) for s in self.inputs}
        self.stream.synchronize()  # the profile switches are done before any shape is set
        self.profiles = Profiles(limits)
        contexts = list(self.contexts.values())
        for spec in (*self.inputs, *self.outputs):
            dtype = np.dtype(_numpy_type(spec.datatype))
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


class TensorRTBackend:
    """A serialized TensorRT engine, one execution context per instance (each run takes a free
    instance, so concurrent batches never share a context, stream or buffer)."""

    platform = "tensorrt_plan"
    provider = "TensorrtExecutionProvider"

    def __init__(
        self,
        path: Path,
        options: TensorRTOptions,
        label: str,
        groups: Sequence[InstanceGroup] = (),
    ) -> None:
        trt, self._cuda = import_gpu_modules(label)
        self._instances: list[_Instance] = []
        self._runtimes: list[Any] = []
        self._engines: list[Any] = []
        self._free: queue.SimpleQueue[_Instance] = queue.SimpleQueue()
        devices = [d for group in groups for d in group.devices] or [0]
        try:
            self._load(trt, path, options, label, devices)
        except BaseException:
            self.close()
            raise

    def _load(
        self, trt: Any, path: Path, options: TensorRTOptions, label: str, devices: list[int]
    ) -> None:
        plan = path.read_bytes()
        record = built_for(path.parent / "conversion.json")
        # Runtimes and engines are kept for the backend's life: a context must not outlive
        # its engine, nor (in some TensorRT releases) an engine its runtime.
        runtimes: dict[int, Any] = {}
        for device in dict.fromkeys(devices):
            self._cuda.call("cudaSetDevice", device)
            gpu, capability = self._cuda.properties(device)
            here = f"TensorRT {trt.__version__} and {gpu} (compute capability {capability})"
            if record and (record[0] != trt.__version__ or record[2] != capability):
                raise BackendError(
                    f"{path} was built with TensorRT {record[0]} for {record[1]} (compute "
                    f"capability {record[2]}); this machine has {here}: TensorRT engines run "
                    f"only where they were built, so rebuild it here with `{REBUILD}`"
                )
            runtimes[device] = trt.Runtime(trt.Logger(trt.Logger.WARNING))
            self._runtimes.append(runtimes[device])

        def deserialize(device: int) -> Any:
            self._cuda.call("cudaSetDevice", device)
            engine = runtimes[device].deserialize_cuda_engine(plan)
            if engine is None:
                gpu, capability = self._cuda.properties(device)
                raise BackendError(
                    f"TensorRT {trt.__version__} cannot deserialize {path} on {gpu} (compute "
                    f"capability {capability}): it was built by another TensorRT version or for "
                    f"another GPU, or the file is damaged; rebuild it here with `{REBUILD}`"
                )
            self._engines.append(engine)
            return engine

        engines = {device: deserialize(device) for device in runtimes}
        first = engines[devices[0]]
        self.inputs, self.outputs = describe(trt, first)
        profiles = first.num_optimization_profiles
        if options.profile is not None and options.profile >= profiles:
            raise BackendError(
                f"tensorrt.profile is optimization profile {options.profile}; the engine has "
                f"profiles 0 to {profiles - 1}"
            )
        # device_memory_size_v2 since TensorRT 10.1; the old name is deprecated.
        needed = getattr(first, "device_memory_size_v2", None)
        needed = int(first.device_memory_size if needed is None else needed)
        if options.workspace_bytes is not None and needed > options.workspace_bytes:
            raise BackendError(
                f"{path} needs {needed} bytes of activation memory per instance; "
                f"tensorrt.workspace_bytes allows {options.workspace_bytes}"
            )
        # Every instance may use every profile unless one is configured (Triton's default);
        # a fixed profile per instance would refuse the batches its profile does not hold.
        usable = [options.profile] if options.profile is not None else list(range(profiles))
        # TensorRT: "If the engine supports dynamic shapes, each execution context in concurrent
        # use must use a separate optimization profile." Instances run concurrently and may
        # use the same profiles, so with dynamic shapes each instance after a device's first
        # deserializes its own engine (its weights are on the GPU once more), as Triton does.
        dynamic = any(-1 in spec.shape for spec in (*self.inputs, *self.outputs))
        for index, device in enumerate(devices):
            instance = _Instance(self._cuda, device, usable, (self.inputs, self.outputs))
            self._instances.append(instance)
            first_here = device not in devices[:index]
            engine = engines[device] if first_here or not dynamic else deserialize(device)
            instance.start(engine, trt.ExecutionContextAllocationStrategy.USER_MANAGED, needed)
            self._free.put(instance)
        # Runs that reach every instance once (they are handed out in turn): for warm-up.
        self.instance_slots = len(self._instances)
        log.info("%s: %d TensorRT instance(s) on GPU %s", label, len(devices), sorted(set(devices)))

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        instance = self._free.get()  # never waits long: the batcher runs at most one per instance
        try:
            return instance.run(inputs)
        finally:
            self._free.put(instance)

    def close(self) -> None:
        instances, self._instances = self._instances, []
        for instance in instances:
            try:
                instance.close()
            except BackendError:
                log.exception("closing a TensorRT instance failed")
        # Contexts (closed above) before engines before runtimes, as TensorRT requires.
        self._engines.clear()
        self._runtimes.clear()


def describe(trt: Any, engine: Any) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """(inputs, outputs) of an engine, in its I/O tensor order."""
    inputs: list[TensorSpec] = []
    outputs: list[TensorSpec] = []
    for index in range(engine.num_io_tensors):
        name = engine.get_tensor_name(index)
        trt_type = engine.get_tensor_dtype(name)
        try:
            dtype = np.dtype(trt.nptype(trt_type))
        except TypeError:  # bf16, fp8, int4: no numpy type
            dtype = None
        if dtype is None or dtype.name not in _NP_TO_V2:
            raise BackendError(f"tensor '{name}' has type {trt_type}, which sluice cannot serve")
        if engine.is_shape_inference_io(name):
            raise BackendError(
                f"input '{name}' is a shape tensor (read on the host); this backend serves "
                "engines whose inputs are all device tensors"
            )
        spec = TensorSpec(name, _NP_TO_V2[dtype.name], tuple(engine.get_tensor_shape(name)))
        is_input = engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT
        (inputs if is_input else outputs).append(spec)
    return tuple(inputs), tuple(outputs)


def built_for(record_path: Path) -> tuple[str, str, str] | None:
    """(TensorRT version, GPU name, compute capability) that `sluice convert` recorded in
    conversion.json, or None when there is no readable record (the file is untrusted)."""
    try:
        data = json.loads(record_path.read_text())
        built = data["tensorrt"]
        fields = (built["version"], built["gpu"], built["compute_capability"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("ignoring %s: no readable TensorRT build record (%s)", record_path, exc)
        return None
    if not all(isinstance(field, str) for field in fields):
        log.warning("ignoring %s: its TensorRT build record is not text", record_path)
        return None
    return fields


def _limits(engine: Any, spec: TensorSpec, profile: int) -> Limits:
    """An input's (min, opt, max) shapes under a profile. A static input's are its shape: an
    engine built without profiles has no profile shapes to report for it."""
    if -1 not in spec.shape:
        return spec.shape, spec.shape, spec.shape
    low, opt, high = (
        tuple(int(size) for size in shape)
        for shape in engine.get_tensor_profile_shape(spec.name, profile)
    )
    return low, opt, high


def _numpy_type(datatype: str) -> str:
    return next(np_name for np_name, v2 in _NP_TO_V2.items() if v2 == datatype)


def _nbytes(shape: Sequence[int], dtype: np.dtype[Any]) -> int:
    return int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
