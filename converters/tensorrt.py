"""TensorRT engine builds (`--target tensorrt`), import-guarded: without a CUDA GPU, the
`tensorrt` package and cuda-python every entry point raises MissingDependency naming what is
absent.

fp16 engines are built from the fp32 ONNX model with TensorRT's FP16 flag. int8 engines use
explicit quantization: the ONNX model is first quantized to symmetric QDQ with the calibration
data (TensorRT's recommended path since its implicit calibrators were deprecated), then built
with the INT8 flag. Batched models get one optimization profile per preferred batch size
bucket (preferred 4 and 16 with max_batch_size 32: batches 1-4, 5-16 and 17-32), each tuned for
its largest size, the size the batcher aims for; the server runs each batch on the profile that
holds it, as Triton does. Other dynamic axes range from 1 to their example size.

An engine runs only on the TensorRT version and the GPU model that built it (NVIDIA: plans are
specific to the exact GPU model, not only its compute capability), unless it is built with a
hardware compatibility level (`--hardware-compatibility`: `same_compute_capability` runs on any
GPU of that compute capability, `ampere_plus` on any Ampere or newer GPU, both at some cost in
speed). Each build records what it is for (TensorRT version, GPU, compute capability, level,
precision, profiles, builder workspace, engine cache) for `conversion.json`, where the server
checks it before loading. Builds are cached by the ONNX hash and that record, less what the
level makes irrelevant (the GPU name unless the level is `none`; the compute capability too
for `ampere_plus`), under `--engine-cache DIR`, else `$SLUICE_TENSORRT_CACHE`, else
`~/.cache/sluice/tensorrt`, so converting the same model again on the same kind of GPU reuses
the engine (`--no-engine-cache` builds and stores nothing). Validation runs the engine through
the serving backend's own code."""

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

BUILDER_WORKSPACE_BYTES = 1 << 30
HARDWARE_COMPATIBILITY = {
    "none": "NONE",
    "same_compute_capability": "SAME_COMPUTE_CAPABILITY",
    "ampere_plus": "AMPERE_PLUS",
}
"""`--hardware-compatibility` -> TensorRT's HardwareCompatibilityLevel member."""
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
            missing.append(f"no CUDA GPU ({cuda.no_device})")
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


Profile = dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]
"""One optimization profile: each input's (min, opt, max) shapes."""


def batch_buckets(max_batch_size: int, preferred: list[int]) -> list[tuple[int, int]]:
    """(first, last) batch size of each profile: one bucket ending at each preferred batch size
    up to max_batch_size, and a last one ending at max_batch_size."""
    edges = sorted({size for size in preferred if 0 < size < max_batch_size} | {max_batch_size})
    return [(low + 1, high) for low, high in zip([0, *edges], edges, strict=False)]


def optimization_profiles(
    specs: list[InputSpec], max_batch_size: int, preferred: list[int]
) -> list[Profile]:
    """The engine's optimization profiles. Batched models get one per preferred batch size
    bucket, each tuned (opt) for its largest size, which is the size the batcher aims for; other
    dynamic axes range from 1 to their example size in every profile."""
    buckets = batch_buckets(max_batch_size, preferred) if max_batch_size > 0 else [(0, 0)]
    profiles = []
    for first, last in buckets:
        profile: Profile = {}
        for spec in specs:
            low, opt, high = [], [], []
            for index, axis in enumerate(spec.axes):
                if index == 0 and spec.batched and max_batch_size > 0:
                    sizes = (first, last, last)
                elif axis.dynamic:
                    sizes = (1, axis.size, axis.size)
                else:
                    sizes = (axis.size, axis.size, axis.size)
                low.append(sizes[0])
                opt.append(sizes[1])
                high.append(sizes[2])
            profile[spec.name] = (tuple(low), tuple(opt), tuple(high))
        profiles.append(profile)
    return profiles


def build_engine(
    onnx_model: bytes,
    specs: list[InputSpec],
    max_batch_size: int,
    preferred: list[int],
    precision: str,
    builder_workspace_bytes: int = BUILDER_WORKSPACE_BYTES,
    cache: Path | None = None,
    use_cache: bool = True,
    hardware_compatibility: str = "none",
) -> Build:
    """A serialized TensorRT engine (`model.plan`) for this GPU model (or, with a hardware
    compatibility level, the GPUs it names) and TensorRT version, from the engine cache
    (`cache`, default `cache_dir()`; none when `use_cache` is False) when the same model was
    built for the same GPUs with the same settings."""
    require_tensorrt()
    import tensorrt as trt

    cuda = Cuda(load_runtime())
    gpu, capability = cuda.properties(int(cuda.call("cudaGetDevice")))
    profiles = optimization_profiles(specs, max_batch_size, preferred)
    record: dict[str, Any] = {
        "version": trt.__version__,
        "gpu": gpu,
        "compute_capability": capability,
        "hardware_compatibility": hardware_compatibility,
        "precision": precision,
        "profiles": [
            {
                name: {"min": list(low), "opt": list(opt), "max": list(high)}
                for name, (low, opt, high) in profile.items()
            }
            for profile in profiles
        ],
        "builder_workspace_bytes": builder_workspace_bytes,
    }
    record["cache_key"] = cache_key(onnx_model, record)
    folder = (cache if cache is not None else cache_dir()) if use_cache else None
    record["engine_cache"] = None if folder is None else str(folder)
    cached = None if folder is None else folder / f"{record['cache_key']}.plan"
    if cached is not None and cached.is_file():
        return Build(cached.read_bytes(), {**record, "cached": True})
    plan = _build(trt, onnx_model, profiles, record)
    if cached is not None:
        _store(cached, plan)
    return Build(plan, {**record, "cached": False})


def cache_key(onnx_model: bytes, record: dict[str, Any]) -> str:
    """The engine cache's key: the model's hash and every part of the build record the engine
    depends on. The GPU's name is part of it, as NVIDIA ties a plan to the GPU model, unless a
    hardware compatibility level was asked for; `ampere_plus` drops the compute capability too."""
    level = record["hardware_compatibility"]
    ignored = {"gpu"} if level != "none" else set()
    if level == "ampere_plus":
        ignored.add("compute_capability")
    identity = {k: v for k, v in record.items() if k not in ignored}
    text = hashlib.sha256(onnx_model).hexdigest() + json.dumps(identity, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _build(trt: Any, onnx_model: bytes, profiles: list[Profile], record: dict[str, Any]) -> bytes:
    precision = record["precision"]
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(onnx_model):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise ConversionError(f"TensorRT cannot parse the ONNX model: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, record["builder_workspace_bytes"])
    level = record["hardware_compatibility"]
    if level != "none":
        member = getattr(trt.HardwareCompatibilityLevel, HARDWARE_COMPATIBILITY[level], None)
        if member is None:
            raise ConversionError(
                f"--hardware-compatibility {level} needs a TensorRT that has it; "
                f"TensorRT {trt.__version__} does not"
            )
        config.hardware_compatibility_level = member
    if precision in ("fp16", "int8"):
        config.set_flag(trt.BuilderFlag.FP16)
    if precision == "int8":
        config.set_flag(trt.BuilderFlag.INT8)
    for index, shapes in enumerate(profiles):
        profile = builder.create_optimization_profile()
        for name, (low, opt, high) in shapes.items():
            profile.set_shape(name, low, opt, high)
        # -1 (not an exception) is how TensorRT refuses a profile.
        if config.add_optimization_profile(profile) < 0:
            shown = {name: [list(dims) for dims in limits] for name, limits in shapes.items()}
            raise ConversionError(f"TensorRT refused optimization profile {index} {shown}")
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
    checks), so validation exercises the code that will serve the engine. It holds device
    memory, pinned host memory and a stream until `close()` (the conversion closes it once it
    has validated and measured the engine)."""

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

    def close(self) -> None:
        """Free the backend's contexts, buffers and stream (a second call does nothing)."""
        self.backend.close()
