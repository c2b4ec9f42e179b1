"""A fake `tensorrt` module with TensorRT 10's Python signatures and refusals.

Same as the real module: `Runtime.deserialize_cuda_engine` returns None for a plan it cannot
load (not a plan, another TensorRT version, another compute capability); tensors are addressed
by name (`num_io_tensors`, `get_tensor_name`, `get_tensor_mode`, `get_tensor_dtype`,
`get_tensor_shape`, `get_tensor_profile_shape(name, profile) -> [min, opt, max]`);
`set_input_shape` returns False for a shape outside the active profile; `set_tensor_address`
takes an int; `execute_async_v3(stream_handle: int)` returns False while an input shape or a
tensor address is unset, and queues its work on the stream (the outputs are written only when
the stream runs). `set_optimization_profile_async(index, stream_handle)` raises RuntimeError for
an index the engine lacks (the binding's PY_ASSERT_RUNTIME_ERROR; it never returns False).

The "network" of a fake plan copies input tensors to output tensors (`copy_of`), with
`cudaMemcpyAsync(..., cudaMemcpyDeviceToDevice, stream)` through whichever
`cuda.bindings.runtime` is importable, so on a GPU machine with cuda-python this fake drives
real device buffers and streams. Build fake plans with `plan()`; the builder half
(`Builder`, `OnnxParser`) makes such plans from ONNX models for the converter's tests, with the
builder's refusals: `IOptimizationProfile.set_shape` raises RuntimeError for min > opt > max,
`IBuilderConfig.add_optimization_profile` answers -1 for a profile that is not valid, and
`build_serialized_network` answers None when a profile misses a dynamic input or contradicts a
fixed axis."""

from __future__ import annotations

import enum
import json
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

__version__ = "10.3.0"
MAGIC = "sluice-fake-tensorrt-plan"
refuse: set[str] = set()
"""Test control: the methods named here answer their failure value (False, None, -1) instead
of working, as TensorRT does when it logs an error."""
engines: list[ICudaEngine] = []
"""Every engine deserialized, so tests can see what its contexts ran."""
configs: list[IBuilderConfig] = []
"""Every builder config an engine was built with (pool limits, flags, profiles)."""
kernel: Kernel | None = None
"""Test control: when set, each `copy_of` output is computed by this call, e.g. a real cupy
kernel on the real stream, instead of a device-to-device copy (see `Kernel`)."""


class Kernel(Protocol):
    """Computes `output` from `source` on the stream (both device addresses of `shape` and
    `dtype`), as the engine would on the context's active optimization `profile`; False is a
    failed launch."""

    def __call__(
        self,
        *,
        output: int,
        source: int,
        shape: tuple[int, ...],
        dtype: type,
        profile: int,
        stream_handle: int,
    ) -> bool: ...


class DataType(enum.Enum):
    FLOAT = 0
    HALF = 1
    INT8 = 2
    INT32 = 3
    BOOL = 4
    UINT8 = 5
    INT64 = 8
    BF16 = 7


_NP = {
    DataType.FLOAT: np.float32, DataType.HALF: np.float16, DataType.INT8: np.int8,
    DataType.INT32: np.int32, DataType.BOOL: np.bool_, DataType.UINT8: np.uint8,
    DataType.INT64: np.int64,
}  # fmt: skip


def nptype(trt_type: DataType) -> type:
    """The numpy type of a TensorRT DataType (TypeError for anything else, as pybind11)."""
    if not isinstance(trt_type, DataType) or trt_type not in _NP:
        raise TypeError(
            f"Could not resolve TensorRT datatype to an equivalent numpy datatype. {trt_type}"
        )
    return _NP[trt_type]


class TensorIOMode(enum.Enum):
    NONE = 0
    INPUT = 1
    OUTPUT = 2


class Dims(tuple):  # type: ignore[type-arg]
    """TensorRT's Dims: a sequence of ints, -1 for a dynamic axis."""


class Logger:
    class Severity(enum.IntEnum):
        INTERNAL_ERROR = 0
        ERROR = 1
        WARNING = 2
        INFO = 3
        VERBOSE = 4

    INTERNAL_ERROR = Severity.INTERNAL_ERROR
    ERROR = Severity.ERROR
    WARNING = Severity.WARNING
    INFO = Severity.INFO
    VERBOSE = Severity.VERBOSE

    def __init__(self, min_severity: Logger.Severity = Severity.WARNING) -> None:
        self.min_severity = min_severity
        self.messages: list[str] = []

    def log(self, severity: Logger.Severity, msg: str) -> None:
        self.messages.append(msg)


def plan(
    tensors: Sequence[dict[str, Any]],
    profiles: Sequence[dict[str, Sequence[Sequence[int]]]],
    *,
    version: str | None = None,
    compute_capability: tuple[int, int] = (9, 0),
    device_memory_bytes: int = 1 << 20,
    hardware_compatibility: str = "NONE",
) -> bytes:
    """A fake serialized engine. `tensors`: {name, mode: input|output, dtype (DataType name),
    shape, copy_of (outputs)}; `profiles`: per profile, {input name: [min, opt, max]}."""
    return json.dumps(
        {
            "magic": MAGIC,
            "version": version or __version__,
            "compute_capability": list(compute_capability),
            "tensors": list(tensors),
            "profiles": list(profiles),
            "device_memory_bytes": device_memory_bytes,
            "hardware_compatibility": hardware_compatibility,
        }
    ).encode()


def _cudart() -> Any:
    import cuda.bindings.runtime as cudart

    return cudart


class Runtime:
    def __init__(self, logger: Logger) -> None:
        if not isinstance(logger, Logger):
            raise TypeError("Runtime(): incompatible constructor arguments")
        self.logger = logger

    def deserialize_cuda_engine(self, serialized_engine: bytes) -> ICudaEngine | None:
        try:
            data = json.loads(bytes(serialized_engine))
        except (ValueError, UnicodeDecodeError):
            self.logger.log(Logger.ERROR, "Error Code 1: Serialization (magic tag does not match)")
            return None
        if not isinstance(data, dict) or data.get("magic") != MAGIC:
            return None
        if data["version"] != __version__:
            self.logger.log(Logger.ERROR, "The engine plan file is not compatible with this "
                            "version of TensorRT")  # fmt: skip
            return None
        cudart = _cudart()
        _, device = cudart.cudaGetDevice()
        _, props = cudart.cudaGetDeviceProperties(device)
        # As TensorRT: the compute capability is checked (or, with a hardware compatibility
        # level, what the level allows); another GPU model of the same compute capability only
        # gets a warning ("Using an engine plan file across different models of devices is not
        # recommended and is likely to affect performance or even cause errors").
        level = data.get("hardware_compatibility", "NONE")
        if level == "AMPERE_PLUS":
            compatible = props.major >= 8
        else:
            compatible = list(data["compute_capability"]) == [props.major, props.minor]
        if not compatible:
            self.logger.log(Logger.ERROR, "The engine plan file is generated on an incompatible "
                            "device")  # fmt: skip
            return None
        engine = ICudaEngine(data)
        engines.append(engine)
        return engine


class ExecutionContextAllocationStrategy(enum.IntEnum):
    STATIC = 0
    ON_PROFILE_CHANGE = 1
    USER_MANAGED = 2


class ICudaEngine:
    def __init__(self, data: dict[str, Any]) -> None:
        self._tensors = {t["name"]: t for t in data["tensors"]}
        self._order = [t["name"] for t in data["tensors"]]
        self._profiles = data["profiles"]
        self.device_memory_size_v2 = int(data["device_memory_bytes"])
        self.contexts: list[IExecutionContext] = []
        self.busy: dict[int, IExecutionContext] = {}
        """Profile -> the context whose queued work uses it (tracked on the fake runtime)."""
        self.violations: list[str] = []
        """Concurrent uses of one profile by two contexts, which TensorRT leaves undefined."""

    @property
    def num_io_tensors(self) -> int:
        return len(self._order)

    @property
    def num_optimization_profiles(self) -> int:
        return len(self._profiles)

    @property
    def device_memory_size(self) -> int:
        return self.device_memory_size_v2

    def get_tensor_name(self, index: int) -> str:
        return self._order[index]

    def get_tensor_mode(self, name: str) -> TensorIOMode:
        tensor = self._tensors.get(name)
        if tensor is None:
            return TensorIOMode.NONE
        return TensorIOMode.INPUT if tensor["mode"] == "input" else TensorIOMode.OUTPUT

    def is_shape_inference_io(self, name: str) -> bool:
        return bool(self._tensors[name].get("shape_tensor", False))

    def get_tensor_dtype(self, name: str) -> DataType:
        return DataType[self._tensors[name]["dtype"]]

    def get_tensor_shape(self, name: str) -> Dims:
        return Dims(self._tensors[name]["shape"])

    def get_tensor_profile_shape(self, name: str, profile_index: int) -> list[Dims]:
        if self.get_tensor_mode(name) != TensorIOMode.INPUT:
            raise RuntimeError(f"{name} is not an input tensor")
        if not 0 <= profile_index < len(self._profiles):
            raise RuntimeError(f"profile index {profile_index} out of range")
        return [Dims(shape) for shape in self._profiles[profile_index][name]]

    def create_execution_context(
        self,
        strategy: ExecutionContextAllocationStrategy = ExecutionContextAllocationStrategy.STATIC,
    ) -> IExecutionContext | None:
        if not isinstance(strategy, ExecutionContextAllocationStrategy):
            raise TypeError("create_execution_context(): incompatible function arguments")
        if "create_execution_context" in refuse:
            return None
        context = IExecutionContext(self, strategy)
        self.contexts.append(context)
        return context


class IExecutionContext:
    """A USER_MANAGED context runs only once given device memory of at least the engine's
    `device_memory_size_v2` (`set_device_memory(memory, size)`, or the `device_memory` setter of
    TensorRT 10.0); on the fake runtime the memory must be a live device allocation."""

    def __init__(self, engine: ICudaEngine, strategy: ExecutionContextAllocationStrategy) -> None:
        self.engine = engine
        self.strategy = strategy
        self.active_optimization_profile = 0
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._addresses: dict[str, int] = {}
        self.executions: list[dict[str, tuple[int, ...]]] = []
        self.scratch: tuple[int, int] | None = None
        """(address, size) of the device memory a USER_MANAGED context was given."""

    def set_device_memory(self, memory: int, size: int) -> None:
        if not isinstance(memory, int) or not isinstance(size, int):
            raise TypeError("set_device_memory(): incompatible function arguments")
        self.scratch = (memory, size)  # void, as the C++ call: a bad size fails at enqueue

    def _has_memory(self, cudart: Any) -> bool:
        if self.strategy != ExecutionContextAllocationStrategy.USER_MANAGED:
            return True
        if self.scratch is None or self.scratch[1] < self.engine.device_memory_size_v2:
            return False
        view = getattr(cudart, "device_memory", None)  # the fake runtime can check the block
        return view is None or view(self.scratch[0], self.engine.device_memory_size_v2) is not None

    def set_optimization_profile_async(self, profile_index: int, stream_handle: int) -> bool:
        """True, or RuntimeError: the binding asserts on the C++ call's false (it never
        answers False)."""
        if not isinstance(stream_handle, int):
            raise TypeError("set_optimization_profile_async(): incompatible function arguments")
        valid = 0 <= profile_index < self.engine.num_optimization_profiles
        if not valid or "set_optimization_profile_async" in refuse:
            raise RuntimeError("Error in set optimization profile async.")
        self.active_optimization_profile = profile_index
        self._shapes.clear()
        return True

    def set_input_shape(self, name: str, shape: Sequence[int]) -> bool:
        if self.engine.get_tensor_mode(name) != TensorIOMode.INPUT:
            return False
        declared = self.engine.get_tensor_shape(name)
        shape = tuple(int(d) for d in shape)
        if len(shape) != len(declared):
            return False
        profile = self.engine._profiles[self.active_optimization_profile]
        if name not in profile and -1 not in declared:  # a static input of a profile-less engine
            low = high = declared
        else:
            low, _, high = self.engine.get_tensor_profile_shape(
                name, self.active_optimization_profile
            )
        for size, fixed, lo, hi in zip(shape, declared, low, high, strict=True):
            if (fixed != -1 and size != fixed) or not lo <= size <= hi:
                return False
        self._shapes[name] = shape
        return True

    def get_tensor_shape(self, name: str) -> Dims:
        tensor = self.engine._tensors[name]
        source = tensor.get("copy_of", name)
        if source in self._shapes:
            return Dims(self._shapes[source])
        return Dims(tensor["shape"])

    def infer_shapes(self) -> list[str]:
        return [
            name
            for name in self.engine._order
            if self.engine.get_tensor_mode(name) == TensorIOMode.INPUT and name not in self._shapes
        ]

    def set_tensor_address(self, name: str, memory: int) -> bool:
        if not isinstance(memory, int):
            raise TypeError("set_tensor_address(): incompatible function arguments")
        if name not in self.engine._tensors or "set_tensor_address" in refuse:
            return False
        self._addresses[name] = memory
        return True

    def get_tensor_address(self, name: str) -> int:
        return self._addresses.get(name, 0)

    def execute_async_v3(self, stream_handle: int) -> bool:
        if not isinstance(stream_handle, int):
            raise TypeError("execute_async_v3(): incompatible function arguments")
        if "execute_async_v3" in refuse:
            return False
        if self.infer_shapes() or set(self.engine._order) - set(self._addresses):
            return False  # TensorRT logs "not all shapes/addresses are specified"
        cudart = _cudart()
        if not self._has_memory(cudart):
            return False  # TensorRT logs that the context has no (or too little) device memory
        if not self._claim_profile(cudart, stream_handle):
            return False
        for name in self.engine._order:
            tensor = self.engine._tensors[name]
            if "copy_of" not in tensor:
                continue
            shape = self._shapes[tensor["copy_of"]]
            dtype = nptype(DataType[tensor["dtype"]])
            if kernel is not None:
                launched = kernel(
                    output=self._addresses[name],
                    source=self._addresses[tensor["copy_of"]],
                    shape=tuple(shape),
                    dtype=dtype,
                    profile=self.active_optimization_profile,
                    stream_handle=stream_handle,
                )
                if not launched:
                    return False
                continue
            count = int(np.prod(shape)) * np.dtype(dtype).itemsize
            (err,) = cudart.cudaMemcpyAsync(
                self._addresses[name],
                self._addresses[tensor["copy_of"]],
                count,
                cudart.cudaMemcpyKind.cudaMemcpyDeviceToDevice,
                stream_handle,
            )
            if err != cudart.cudaError_t.cudaSuccess:
                return False
        self.executions.append(dict(self._shapes))
        return True

    def _claim_profile(self, cudart: Any, stream_handle: int) -> bool:
        """TensorRT: "If the engine supports dynamic shapes, each execution context in concurrent
        use must use a separate optimization profile." On the fake runtime (which can queue a
        host callback) a context's claim lasts until its stream runs the work; a second
        context of the same engine on the same profile meanwhile is recorded and refused."""
        enqueue = getattr(cudart, "enqueue", None)
        dynamic = any(-1 in t["shape"] for t in self.engine._tensors.values())
        if enqueue is None or not dynamic:
            return True
        profile, busy = self.active_optimization_profile, self.engine.busy
        holder = busy.get(profile)
        if holder is not None and holder is not self:
            self.engine.violations.append(f"profile {profile} used by two contexts at once")
            return False
        busy[profile] = self

        def release() -> None:
            if busy.get(profile) is self:
                del busy[profile]

        return bool(enqueue(stream_handle, release))


# -- the builder half, for the converter -------------------------------------------------------


class MemoryPoolType(enum.Enum):
    WORKSPACE = 0


class HardwareCompatibilityLevel(enum.Enum):
    NONE = 0
    AMPERE_PLUS = 1
    SAME_COMPUTE_CAPABILITY = 2


class BuilderFlag(enum.Enum):
    FP16 = 0
    INT8 = 1


class IOptimizationProfile:
    """`set_shape` raises RuntimeError for shapes that are inconsistent among themselves (as the
    real binding's PY_ASSERT_RUNTIME_ERROR does); `bool(profile)` is its `isValid()`."""

    def __init__(self) -> None:
        self.shapes: dict[str, list[list[int]]] = {}

    def set_shape(self, input: str, min: Any, opt: Any, max: Any) -> None:
        low, best, high = (tuple(int(d) for d in dims) for dims in (min, opt, max))
        if not len(low) == len(best) == len(high):
            raise RuntimeError("Shape provided for opt is inconsistent with other shapes.")
        if not all(0 <= a <= b <= c for a, b, c in zip(low, best, high, strict=True)):
            raise RuntimeError("Shape provided for max is inconsistent with other shapes.")
        self.shapes[input] = [list(low), list(best), list(high)]

    def get_shape(self, input: str) -> list[Dims]:
        return [Dims(dims) for dims in self.shapes.get(input, [])]

    def __bool__(self) -> bool:
        return "add_optimization_profile" not in refuse


class IBuilderConfig:
    def __init__(self) -> None:
        self.pool_limits: dict[MemoryPoolType, int] = {}
        self.flags: set[BuilderFlag] = set()
        self.profiles: list[IOptimizationProfile] = []
        self.hardware_compatibility_level = HardwareCompatibilityLevel.NONE

    def set_memory_pool_limit(self, pool: MemoryPoolType, pool_size: int) -> None:
        if not isinstance(pool, MemoryPoolType) or not isinstance(pool_size, int):
            raise TypeError("set_memory_pool_limit(): incompatible function arguments")
        if pool_size < 0:
            return  # the real one does nothing and records INVALID_ARGUMENT
        self.pool_limits[pool] = pool_size

    def set_flag(self, flag: BuilderFlag) -> None:
        self.flags.add(flag)

    @property
    def num_optimization_profiles(self) -> int:
        return len(self.profiles)

    def add_optimization_profile(self, profile: IOptimizationProfile) -> int:
        """The new profile's index, or -1 for a profile that is not valid (`bool(profile)`)."""
        if not isinstance(profile, IOptimizationProfile):
            raise TypeError("add_optimization_profile(): incompatible function arguments")
        if not profile:
            return -1
        self.profiles.append(profile)
        return len(self.profiles) - 1


class INetworkDefinition:
    def __init__(self) -> None:
        self.tensors: list[dict[str, Any]] = []


_ONNX_TO_TRT = {1: "FLOAT", 10: "HALF", 3: "INT8", 6: "INT32", 9: "BOOL", 2: "UINT8", 7: "INT64"}


class OnnxParser:
    """Parses the model's inputs and outputs; the fake network copies input i to output i."""

    def __init__(self, network: INetworkDefinition, logger: Logger) -> None:
        self.network = network
        self.errors: list[str] = []

    @property
    def num_errors(self) -> int:
        return len(self.errors)

    def get_error(self, index: int) -> str:
        return self.errors[index]

    def parse(self, model: bytes) -> bool:
        import onnx

        try:
            graph = onnx.load_from_string(bytes(model)).graph
        except Exception as exc:  # the real parser reports, never raises
            self.errors.append(f"failed to parse: {exc}")
            return False
        inputs = [v for v in graph.input if v.name not in {i.name for i in graph.initializer}]
        for value in inputs:
            self.network.tensors.append(_tensor(value, "input"))
        for index, value in enumerate(graph.output):
            tensor = _tensor(value, "output")
            tensor["copy_of"] = inputs[min(index, len(inputs) - 1)].name
            tensor["dtype"] = self.network.tensors[min(index, len(inputs) - 1)]["dtype"]
            self.network.tensors.append(tensor)
        return True


def _tensor(value: Any, mode: str) -> dict[str, Any]:
    dims = [
        d.dim_value if d.HasField("dim_value") else -1 for d in value.type.tensor_type.shape.dim
    ]
    dtype = _ONNX_TO_TRT[value.type.tensor_type.elem_type]
    return {"name": value.name, "mode": mode, "dtype": dtype, "shape": dims}


class Builder:
    builds = 0

    def __init__(self, logger: Logger) -> None:
        self.logger = logger

    def create_network(self, flags: int = 0) -> INetworkDefinition:
        return INetworkDefinition()

    def create_builder_config(self) -> IBuilderConfig:
        return IBuilderConfig()

    def create_optimization_profile(self) -> IOptimizationProfile:
        return IOptimizationProfile()

    def build_serialized_network(
        self, network: INetworkDefinition, config: IBuilderConfig
    ) -> bytes | None:
        if not config.profiles:
            return None  # dynamic shapes need a profile
        for profile in config.profiles:  # each must cover every input, matching fixed axes
            for tensor in network.tensors:
                if tensor["mode"] != "input":
                    continue
                shapes = profile.shapes.get(tensor["name"])
                if shapes is None:
                    if -1 in tensor["shape"]:
                        return None  # "the profile has no shape for a dynamic input"
                    continue
                for dims in shapes:
                    if len(dims) != len(tensor["shape"]) or any(
                        fixed not in (-1, size)
                        for fixed, size in zip(tensor["shape"], dims, strict=True)
                    ):
                        return None  # the real builder logs the mismatch and returns None
        cudart = _cudart()
        _, device = cudart.cudaGetDevice()
        _, props = cudart.cudaGetDeviceProperties(device)
        level = config.hardware_compatibility_level
        if level == HardwareCompatibilityLevel.AMPERE_PLUS and props.major < 8:
            return None  # "only supported for engines built on NVIDIA Ampere and later GPUs"
        Builder.builds += 1
        configs.append(config)
        return plan(
            network.tensors,
            [p.shapes for p in config.profiles],
            compute_capability=(props.major, props.minor),
            hardware_compatibility=level.name,
        )
