"""TensorRT backend for `model.plan` engines (TensorRT 10 Python API, cuda-python runtime).

Each instance owns, on its GPU: an execution context on one optimization profile, a
non-blocking CUDA stream, and a device buffer plus a pinned host buffer per tensor, sized at
load for the profile's largest shapes (grown only if an engine reports a larger one). A batch
is: set input shapes (a shape outside the profile is bad input), async copies in, one
`execute_async_v3`, async copies out, one stream sync. No allocation per batch.

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
from engine.errors import BackendError, InvalidInput
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
        missing.append("a CUDA GPU")
    if missing:
        raise BackendError(
            f"{label} needs TensorRT, but this machine lacks {' and '.join(missing)}; on a "
            f"machine with an NVIDIA GPU run {INSTALL}, or serve the ONNX model"
        )
    assert cuda is not None
    return trt, cuda


class _Tensor:
    """One tensor's device and pinned host buffers, grown only when a larger size is needed."""

    def __init__(self, cuda: Cuda, context: Any, name: str, dtype: np.dtype[Any]) -> None:
        self.cuda, self.context, self.name, self.dtype = cuda, context, name, dtype
        self.device: DeviceBuffer | None = None
        self.host: PinnedBuffer | None = None

    def reserve(self, nbytes: int) -> None:
        if self.device is not None and self.device.nbytes >= nbytes:
            return
        self.close()
        self.device = DeviceBuffer(self.cuda, nbytes)
        self.host = PinnedBuffer(self.cuda, nbytes)
        if not self.context.set_tensor_address(self.name, self.device.ptr):
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
    """An execution context with its stream and buffers on one GPU."""

    def __init__(self, cuda: Cuda, device: int, profile: int, specs: Any) -> None:
        self.cuda, self.device, self.profile = cuda, device, profile
        self.inputs, self.outputs = specs
        self.tensors: dict[str, _Tensor] = {}
        self.stream: Stream | None = None
        self.context: Any = None

    def start(self, engine: Any) -> None:
        """Create the context, stream and buffers (`close` frees whatever a failure left)."""
        cuda, device, profile = self.cuda, self.device, self.profile
        cuda.call("cudaSetDevice", device)
        self.context = engine.create_execution_context()
        if self.context is None:
            raise BackendError(f"create_execution_context() on GPU {device} returned None")
        self.stream = Stream(cuda)
        if not self.context.set_optimization_profile_async(profile, int(self.stream)):
            raise BackendError(f"set_optimization_profile_async({profile}) returned False")
        self.stream.synchronize()
        self.limits = {
            s.name: engine.get_tensor_profile_shape(s.name, profile) for s in self.inputs
        }
        for spec in (*self.inputs, *self.outputs):
            dtype = np.dtype(_numpy_type(spec.datatype))
            self.tensors[spec.name] = _Tensor(cuda, self.context, spec.name, dtype)
        for spec in self.inputs:
            largest = tuple(self.limits[spec.name][2])
            self._set_shape(spec.name, largest)
            self.tensors[spec.name].reserve(_nbytes(largest, self.tensors[spec.name].dtype))
        for spec in self.outputs:
            shape = tuple(self.context.get_tensor_shape(spec.name))
            if any(size < 0 for size in shape):
                raise BackendError(
                    f"output '{spec.name}' has data-dependent shape {list(shape)}; this backend "
                    "needs output shapes that follow from the input shapes"
                )
            self.tensors[spec.name].reserve(_nbytes(shape, self.tensors[spec.name].dtype))

    def _set_shape(self, name: str, shape: tuple[int, ...]) -> None:
        if not self.context.set_input_shape(name, shape):
            low, _, high = self.limits[name]
            raise InvalidInput(
                f"input '{name}' has shape {list(shape)}; the TensorRT engine's optimization "
                f"profile {self.profile} allows {list(low)} to {list(high)}"
            )

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        assert self.stream is not None
        self.cuda.call("cudaSetDevice", self.device)  # worker threads are not tied to a GPU
        arrays = {}
        for spec in self.inputs:
            tensor = self.tensors[spec.name]
            arrays[spec.name] = np.ascontiguousarray(inputs[spec.name], dtype=tensor.dtype)
            self._set_shape(spec.name, arrays[spec.name].shape)
        shapes = {s.name: tuple(self.context.get_tensor_shape(s.name)) for s in self.outputs}
        for name, shape in shapes.items():
            self.tensors[name].reserve(_nbytes(shape, self.tensors[name].dtype))
        for name, array in arrays.items():
            tensor = self.tensors[name]
            tensor.reserve(array.nbytes)
            assert tensor.host is not None
            assert tensor.device is not None
            tensor.host.bytes[: array.nbytes] = array.reshape(-1).view(np.uint8)
            self.stream.copy_in(tensor.device, tensor.host, array.nbytes)
        if not self.context.execute_async_v3(int(self.stream)):
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
        if self.stream is not None:
            steps.append(self.stream.close)
        failures = []
        for step in steps:
            try:
                step()
            except BackendError as exc:
                failures.append(exc)
        self.stream, self.context, self.tensors = None, None, {}
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
        self._engines: dict[int, Any] = {}
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
        engines: dict[int, Any] = self._engines
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
            runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
            self._runtimes.append(runtime)
            engine = runtime.deserialize_cuda_engine(plan)
            if engine is None:
                raise BackendError(
                    f"TensorRT {trt.__version__} cannot deserialize {path} on {gpu} (compute "
                    f"capability {capability}): it was built by another TensorRT version or for "
                    f"another GPU, or the file is damaged; rebuild it here with `{REBUILD}`"
                )
            engines[device] = engine
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
                f"{path} needs {needed} bytes of device memory per execution context; "
                f"tensorrt.workspace_bytes allows {options.workspace_bytes}"
            )
        for index, device in enumerate(devices):
            on_device = devices[:index].count(device)
            profile = options.profile if options.profile is not None else on_device % profiles
            instance = _Instance(self._cuda, device, profile, (self.inputs, self.outputs))
            self._instances.append(instance)
            instance.start(engines[device])
            self._free.put(instance)
        # Runs that reach every context once (they are handed out in turn): for warm-up.
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


def _numpy_type(datatype: str) -> str:
    return next(np_name for np_name, v2 in _NP_TO_V2.items() if v2 == datatype)


def _nbytes(shape: Sequence[int], dtype: np.dtype[Any]) -> int:
    return int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
