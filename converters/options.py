"""The options of one conversion, as the command line gives them."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from converters.measure import MEASURE_SECONDS
from converters.spec import InputSpec, PadRequest


@dataclass
class ConvertOptions:
    """Everything the `sluice convert` command line can say (see its --help)."""

    source: str
    repository: Path
    name: str | None = None
    inputs: list[InputSpec] = field(default_factory=list)
    output_names: list[str] = field(default_factory=list)
    weights: Path | None = None
    trust_pickle: bool = False
    precision: str = "fp32"
    target: str = "onnxruntime"
    tensorrt_builder_workspace_bytes: int | None = None
    """--target tensorrt: TensorRT's build workspace (None: converters.tensorrt's default)."""
    tensorrt_hardware_compatibility: str = "none"
    """--target tensorrt: TensorRT's hardware compatibility level (none: this GPU model only)."""
    tensorrt_engine_cache: Path | None = None
    """--target tensorrt: the engine cache folder (None: $SLUICE_TENSORRT_CACHE or the default)."""
    tensorrt_engine_cache_enabled: bool = True
    calibration: Path | None = None
    validation_data: Path | None = None
    samples: int = 32
    seed: int = 0
    atol: float | None = None
    rtol: float | None = None
    min_cosine: float | None = None
    max_norm_error: float | None = None
    opset: int | None = None
    exporter: str = "dynamo"
    simplify: bool = True
    optimization_level: str = "extended"
    fp16_block: list[str] = field(default_factory=list)
    keep_io_types: bool = True
    per_channel: bool = True
    max_batch_size: int | None = None
    preferred_batch_sizes: list[int] = field(default_factory=list)
    pads: list[PadRequest] = field(default_factory=list)
    version: int | None = None
    replace_config: bool = False
    measure_iterations: int = 50
    """Most timed runs per model and batch size (0: no measurement)."""
    measure_seconds: float = MEASURE_SECONDS
    """Time bound of each batch size's measurement (converters.measure)."""
    threads: int = 1
    force: bool = False
    dry_run: bool = False
