"""A model's `config.yaml`: backend, batching, instances, backend options, cache and warm-up.

Inputs and outputs come from the model file; a model folder with no config.yaml gets one derived
from the model (batching on when the first axis of every input is dynamic), as Triton's
auto-complete does."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from engine.settings import BatchingDefaults, SettingsError, describe, read_yaml


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


class VersionPolicy(Section):
    latest: int | None = Field(None, gt=0)
    """Serve the N highest numbered versions."""
    all: bool = False
    """Serve every version."""
    specific: list[int] | None = None
    """Serve exactly these versions."""

    @model_validator(mode="after")
    def _one_policy(self) -> VersionPolicy:
        chosen = [self.latest is not None, self.all, self.specific is not None]
        if sum(chosen) > 1:
            raise ValueError("set only one of latest, all, specific")
        if not any(chosen):
            self.latest = 1
        return self

    def select(self, versions: list[int]) -> list[int]:
        """The versions this policy serves, highest first."""
        ordered = sorted(versions, reverse=True)
        if self.all:
            return ordered
        if self.specific is not None:
            return [v for v in ordered if v in self.specific]
        return ordered[: self.latest]


PositiveAxis = Annotated[int, Field(gt=0)]


class PadSpec(Section):
    axis: int = Field(gt=0)
    """The variable-length axis (not the batch axis)."""
    value: float = 0
    """The value that pads it (must be harmless to the model, e.g. a pad token id)."""
    outputs: dict[str, PositiveAxis | list[PositiveAxis]] | None = None
    """Outputs with axes that follow the padded one, as {output: axis or [axes]}; those axes are
    cut back to each request's length. Unset: every output axis with the padded input axis's
    symbolic dim name in the model (e.g. `seq`). Other outputs are split on the batch axis only."""


class DynamicBatching(Section):
    enabled: bool = True
    """Merge concurrent requests into batches (only for models with max_batch_size > 0)."""
    max_queue_delay_s: float | None = Field(None, ge=0, le=10)
    """How long a batch waits for more requests after its first; default from server settings."""
    preferred_batch_sizes: list[int] = Field(default_factory=list)
    """Row counts at which a batch is sent at once without waiting for the delay."""
    max_queue_size: int | None = Field(None, gt=0)
    """Rows the queue holds before new requests are rejected with 503."""
    priority_levels: int = Field(1, ge=1, le=16)
    """Number of priority levels (0 is lowest); higher levels are served first."""
    default_priority: int = Field(0, ge=0)
    """Priority level of requests that do not set one."""
    default_timeout_s: float | None = Field(None, gt=0)
    """Deadline of requests that do not set `timeout`; unset means none."""
    pad: dict[str, PadSpec] = Field(default_factory=dict)
    """Inputs that may be padded along an axis so requests of different lengths share a batch."""
    pad_bucket_ratio: float = Field(1.5, ge=1)
    """A padded batch only merges requests whose lengths are within this ratio of each other."""
    dispatch_when_idle: bool = True
    """Send at once when no batch of this model is running instead of waiting for the delay."""

    @model_validator(mode="after")
    def _priorities(self) -> DynamicBatching:
        if self.default_priority >= self.priority_levels:
            raise ValueError(
                f"default_priority {self.default_priority} is not below "
                f"priority_levels {self.priority_levels}"
            )
        return self


class OnnxRuntimeOptions(Section):
    intra_op_threads: int = Field(1, ge=0)
    """Threads inside one operator (0 lets ONNX Runtime choose)."""
    inter_op_threads: int = Field(1, ge=0)
    """Threads across operators (0 lets ONNX Runtime choose)."""
    graph_optimization_level: Literal["disable", "basic", "extended", "all"] = "all"
    """ONNX Runtime graph optimizations applied at load."""
    execution_providers: list[str] = Field(default_factory=lambda: ["CPUExecutionProvider"])
    """Providers in order of preference; unavailable ones are skipped, CPU is the fallback."""


class Warmup(Section):
    enabled: bool = True
    """Run the model on zeros at load so the first request is not slow."""
    batch_sizes: list[int] = Field(default_factory=lambda: [1])
    """Batch sizes to warm up (clipped to max_batch_size)."""


class ModelCache(Section):
    enabled: bool = False
    """Answer repeated requests from the result cache."""
    ttl_s: float = Field(300.0, gt=0)
    """How long a cached result lives."""


class ModelConfig(Section):
    backend: Literal["onnxruntime", "tensorrt"] = "onnxruntime"
    """Runtime that executes the model (`model.onnx` or `model.plan`)."""
    max_batch_size: int | None = Field(None, ge=0)
    """Largest batch in rows; 0 runs the model unbatched. Default: derived from the model."""
    version_policy: VersionPolicy = Field(default_factory=VersionPolicy)
    """Which versions are served."""
    instances: int = Field(1, ge=1, le=64)
    """Batches that run at once, concurrently on one shared session (threads in the pool)."""
    dynamic_batching: DynamicBatching = Field(default_factory=DynamicBatching)
    """Dynamic batcher options."""
    onnxruntime: OnnxRuntimeOptions = Field(default_factory=OnnxRuntimeOptions)
    """ONNX Runtime session options."""
    tensorrt: dict[str, Any] = Field(default_factory=dict)
    """TensorRT options (GPU only)."""
    warmup: Warmup = Field(default_factory=Warmup)
    """Warm-up at load."""
    cache: ModelCache = Field(default_factory=ModelCache)
    """Result cache for this model."""


def load_model_config(model_dir: Path) -> ModelConfig:
    """The model's config.yaml, or the defaults when there is none (auto-complete fills gaps)."""
    path = model_dir / "config.yaml"
    if not path.exists():
        return ModelConfig()
    try:
        return ModelConfig(**read_yaml(path))
    except ValidationError as exc:
        raise SettingsError(describe(exc, ModelConfig, source=str(path))) from exc


def effective_batching(config: ModelConfig, defaults: BatchingDefaults) -> tuple[float, int]:
    """(max_queue_delay_s, max_queue_size) with server defaults filled in."""
    batching = config.dynamic_batching
    delay = batching.max_queue_delay_s
    size = batching.max_queue_size
    return (
        defaults.max_queue_delay_s if delay is None else delay,
        defaults.max_queue_size if size is None else size,
    )
