"""TensorRT engine builds (`--target tensorrt`), import-guarded: without a CUDA GPU, the
`tensorrt` package and cuda-python every entry point raises MissingDependency naming what is
absent.

fp16 engines are built from the fp32 ONNX model with TensorRT's FP16 flag. int8 engines use
explicit quantization: the ONNX model is first quantized to symmetric QDQ with the calibration
data (TensorRT's recommended path since its implicit calibrators were deprecated), then built
with the INT8 flag. One optimization profile covers batch 1 to max_batch_size, tuned for the
largest preferred batch size; other dynamic axes range from 1 to their example size.

An engine runs only on the TensorRT version and GPU architecture that built it, so each build
records both (with precision, profiles and workspace) for `conversion.json`, where the server
checks them before loading. Builds are cached by (ONNX hash, TensorRT version, compute
capability, precision, profiles, workspace) under `$SLUICE_TENSORRT_CACHE` (default
`~/.cache/sluice/tensorrt`), so converting the same model again on the same machine reuses
the engine. Validation runs the engine through the serving backend's own code."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from converters.errors import ConversionError, MissingDependency
from converters.spec import InputSpec
from engine.backends.cuda import Cuda, load_runtime

WORKSPACE_BYTES = 1 << 30
INSTALL = "pip install 'sluice[gpu]' --extra-index-url https://pypi.nvidia.com"


def missing_requirements() -> list[str]:
    """What this machine lacks for TensorRT builds; empty when everything is there."""
    missing = []
    if importlib.util.find_spec("tensorrt") is None:
        missing.append(f"the tensorrt package is not installed ({INSTALL})")
    try:
        cuda = Cuda(load_runtime())
    except ImportError:
        missing.append(f"the cuda-python package is not installed ({INSTALL})")
    else:
        if cuda.device_count() == 0:
            missing.append("no CUDA GPU: the CUDA runtime reports no devices")
    return missing


def require_tensorrt() -> None:
    """Raise MissingDependency unless a TensorRT build can run here."""
    missing = missing_requirements()
    if missing:
        raise MissingDependency("--target tensorrt", missing)


def cache_dir() -> Path:
    """Where built engines are kept: $SLUICE_TENSORRT_CACHE, else ~/.cache/sluice/tensorrt."""
    configured = os.environ.get("SLUICE_TENSORRT_CACHE")
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "sluice" / "tensorrt"


@dataclass
class Build:
    """A serialized engine and what it was built for (`conversion.json`'s `tensorrt`)."""

    plan: bytes
    record: dict[str, Any]


def profile_shapes(
    spec: InputSpec, max_batch_size: int, preferred: list[int]
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(min, opt, max) shapes of one input for the optimization profile."""
    fitting = [size for size in preferred if 0 < size <= max_batch_size]
    opt_batch = max(fitting) if fitting else max_batch_size
    low, opt, high = [], [], []
    for index, axis in enumerate(spec.axes):
        if index == 0 and spec.batched and max_batch_size > 0:
            sizes = (1, opt_batch, max_batch_size)
        elif axis.dynamic:
            sizes = (1, axis.size, axis.size)
        else:
            sizes = (axis.size, axis.size, axis.size)
        low.append(sizes[0])
        opt.append(sizes[1])
        high.append(sizes[2])
    return tuple(low), tuple(opt), tuple(high)


def build_engine(
    onnx_model: bytes,
    specs: list[InputSpec],
    max_batch_size: int,
    preferred: list[int],
    precision: str,
    workspace_bytes: int = WORKSPACE_BYTES,
    cache: Path | None = None,
) -> Build:
    """A serialized TensorRT engine (`model.plan`) for this GPU and TensorRT version, from the
    cache when the same model was built here with the same settings."""
    require_tensorrt()
    import tensorrt as trt

    cuda = Cuda(load_runtime())
    gpu, capability = cuda.properties(int(cuda.call("cudaGetDevice")))
    shapes = {spec.name: profile_shapes(spec, max_batch_size, preferred) for spec in specs}
    record: dict[str, Any] = {
        "version": trt.__version__,
        "gpu": gpu,
        "compute_capability": capability,
        "precision": precision,
        "profiles": [
            {name: {"min": list(low), "opt": list(opt), "max": list(high)}
             for name, (low, opt, high) in shapes.items()}
        ],
        "workspace_bytes": workspace_bytes,
    }  # fmt: skip
    key = hashlib.sha256(onnx_model).hexdigest()
    identity = {k: record[k] for k in record if k != "gpu"}  # the architecture, not the name
    key = hashlib.sha256((key + json.dumps(identity, sort_keys=True)).encode()).hexdigest()[:32]
    record["cache_key"] = key
    folder = cache if cache is not None else cache_dir()
    cached = folder / f"{key}.plan"
    if cached.is_file():
        return Build(cached.read_bytes(), {**record, "cached": True})
    plan = _build(trt, onnx_model, shapes, precision, workspace_bytes)
    _store(cached, plan)
    return Build(plan, {**record, "cached": False})


def _build(
    trt: Any,
    onnx_model: bytes,
    shapes: Mapping[str, tuple[tuple[int, ...], ...]],
    precision: str,
    workspace_bytes: int,
) -> bytes:
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(onnx_model):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise ConversionError(f"TensorRT cannot parse the ONNX model: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_bytes)
    if precision in ("fp16", "int8"):
        config.set_flag(trt.BuilderFlag.FP16)
    if precision == "int8":
        config.set_flag(trt.BuilderFlag.INT8)
    profile = builder.create_optimization_profile()
    for name, (low, opt, high) in shapes.items():
        profile.set_shape(name, low, opt, high)
    config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise ConversionError("TensorRT could not build an engine; its log above says why")
    return bytes(plan)


def _store(path: Path, plan: bytes) -> None:
    # Written beside its final name and renamed, so a crash never leaves half an engine that
    # a later conversion would take for a finished one. A cache that cannot be written is
    # no reason to fail the conversion.
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, delete=False, suffix=".tmp") as out:
            out.write(plan)
        os.replace(out.name, path)
    except OSError:
        pass


class TensorRTRunner:
    """Runs a serialized engine through the serving backend (its buffers, stream and shape
    checks), so validation exercises the code that will serve the engine."""

    def __init__(self, plan: bytes) -> None:
        require_tensorrt()
        from engine.backends.tensorrt import TensorRTBackend
        from engine.errors import EngineError
        from engine.model_config import TensorRTOptions

        with tempfile.TemporaryDirectory(prefix="sluice-trt-") as folder:
            path = Path(folder) / "model.plan"
            path.write_bytes(plan)
            try:
                self.backend = TensorRTBackend(path, TensorRTOptions(), "the built engine")
            except EngineError as exc:
                raise ConversionError(f"TensorRT cannot load the engine it built: {exc}") from exc
        self._errors = EngineError
        self.output_names = [spec.name for spec in self.backend.outputs]

    def run(self, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        try:
            outputs = self.backend.run(dict(feeds))
        except self._errors as exc:
            raise ConversionError(f"the TensorRT engine failed: {exc}") from exc
        return [outputs[name] for name in self.output_names]
