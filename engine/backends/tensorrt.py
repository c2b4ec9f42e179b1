"""TensorRT backend for `model.plan` engines (TensorRT 10 Python API, cuda-python runtime): the
engine deserialized on each GPU it serves from, one instance per configured slot (its stream,
contexts and buffers: engine/backends/tensorrt_instance.py), and each batch run on a free one.

Before deserializing, the engine's `conversion.json` (written by `sluice convert`) is checked
against this machine's TensorRT version and GPU: the same GPU model (NVIDIA ties a plan to the
exact model, not only its compute capability), or what the engine's hardware compatibility
level allows (the same compute capability; Ampere or newer). A plan built elsewhere fails with
what differs and how to rebuild, instead of TensorRT's bare None.

Needs an NVIDIA GPU, `tensorrt` and `cuda-python` (both in the `gpu` extra); everything is
imported lazily so CPU-only installs never touch them. Tested here against fakes that hold the
real contracts (tests/fakes); `scripts/gpu-check.sh` runs the real thing."""

from __future__ import annotations

import importlib
import json
import logging
import queue
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from engine.backends.cuda import Cuda, load_runtime
from engine.backends.tensorrt_instance import Instance
from engine.backends.tensorrt_specs import describe
from engine.errors import BackendError
from engine.model_config import InstanceGroup, TensorRTOptions

log = logging.getLogger("sluice.backend.tensorrt")
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


class TensorRTBackend:
    """A serialized TensorRT engine run by its instances, each with its own execution contexts
    (one per optimization profile), stream and buffers; each run takes a free instance, so
    concurrent batches never share a context, stream or buffer."""

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
        self._instances: list[Instance] = []
        self._runtimes: list[Any] = []
        self._engines: list[Any] = []
        self._free: queue.SimpleQueue[Instance] = queue.SimpleQueue()
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
            if record and not record.runs_on(trt.__version__, gpu, capability):
                raise BackendError(
                    f"{path} was built with TensorRT {record.version} for {record.gpu} (compute "
                    f"capability {record.compute_capability}); this machine has {here}: "
                    f"{record.portability()}, so rebuild it here with `{REBUILD}`"
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
        allowed = options.activation_memory_bytes
        if allowed is not None and needed > allowed:
            raise BackendError(
                f"{path} needs {needed} bytes of activation memory per instance; "
                f"tensorrt.activation_memory_bytes allows {allowed}"
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
            instance = Instance(self._cuda, device, usable, (self.inputs, self.outputs))
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


class BuildRecord(NamedTuple):
    """What `sluice convert` recorded an engine was built for (conversion.json's `tensorrt`)."""

    version: str
    gpu: str
    compute_capability: str
    hardware_compatibility: str = "none"
    """TensorRT's hardware compatibility level the engine was built with (older records: none)."""

    def runs_on(self, version: str, gpu: str, capability: str) -> bool:
        """Whether the engine runs with this TensorRT version on this GPU."""
        if version != self.version:
            return False
        if self.hardware_compatibility == "ampere_plus":
            return _major(capability) >= 8
        if self.hardware_compatibility == "same_compute_capability":
            return capability == self.compute_capability
        return (gpu, capability) == (self.gpu, self.compute_capability)

    def portability(self) -> str:
        """Where the engine runs, in words."""
        if self.hardware_compatibility == "ampere_plus":
            where = "Ampere or newer GPUs (hardware compatibility ampere_plus)"
        elif self.hardware_compatibility == "same_compute_capability":
            where = f"GPUs of compute capability {self.compute_capability} (hardware "
            where += "compatibility same_compute_capability)"
        else:
            where = f"the GPU model that built it, {self.gpu}"
        return f"this engine runs only with TensorRT {self.version} on {where}"


LEVELS = ("none", "same_compute_capability", "ampere_plus")


def built_for(record_path: Path) -> BuildRecord | None:
    """What `sluice convert` recorded in conversion.json that the engine was built for, or
    None when there is no readable record (the file is untrusted)."""
    try:
        data = json.loads(record_path.read_text())
        built = data["tensorrt"]
        fields = (built["version"], built["gpu"], built["compute_capability"])
        level = built.get("hardware_compatibility", "none")
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        log.warning("ignoring %s: no readable TensorRT build record (%s)", record_path, exc)
        return None
    if not all(isinstance(field, str) for field in fields):
        log.warning("ignoring %s: its TensorRT build record is not text", record_path)
        return None
    if level not in LEVELS:
        log.warning("ignoring %s: unknown hardware compatibility level %r", record_path, level)
        return None
    return BuildRecord(*fields, level)


def _major(capability: str) -> int:
    major, _, _ = capability.partition(".")
    return int(major) if major.isdigit() else 0
