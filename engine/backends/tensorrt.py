"""TensorRT backend for `model.plan` engines (TensorRT 10 Python API, cuda-python runtime): the
engine deserialized on each GPU it serves from, one instance per configured slot (its stream,
contexts and buffers: engine/backends/tensorrt_instance.py), and each batch run on a free one.

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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

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
