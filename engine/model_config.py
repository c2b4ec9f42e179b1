"""A model's `config.yaml`: backend, batching, instances, backend options, cache and warm-up.

Inputs and outputs come from the model file; a model folder with no config.yaml gets one derived
from the model (batching on when the first axis of every input is dynamic), as Triton's
auto-complete does.

This module is the root (`ModelConfig` and its checks across sections), how a config is loaded
and parsed, and its batching values with the server's defaults filled in; the sections live in
`engine.model_config_sections`."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from engine.generation.config import GenerativeOptions
from engine.model_config_sections import (
    GPU_PROVIDERS,
    MAX_INT32,
    DynamicBatching,
    Embeddings,
    ExecutionProvider,
    InstanceGroup,
    ModelCache,
    OnnxRuntimeOptions,
    PadSpec,
    Section,
    TensorRTOptions,
    VersionPolicy,
    Warmup,
)
from engine.settings import BatchingDefaults, SettingsError, describe, read_yaml
from engine.step_config import PipelineOptions, PythonOptions, TokenizerOptions

# The root's own names, and the sections its schema is made of (engine.model_config_sections).
__all__ = [
    "GPU_PROVIDERS",
    "DynamicBatching",
    "Embeddings",
    "ExecutionProvider",
    "InstanceGroup",
    "ModelCache",
    "ModelConfig",
    "OnnxRuntimeOptions",
    "PadSpec",
    "TensorRTOptions",
    "VersionPolicy",
    "Warmup",
    "effective_batching",
    "load_model_config",
    "parse_model_config",
]


class ModelConfig(Section):
    backend: Literal["onnxruntime", "tensorrt", "tokenizer", "python", "pipeline"] = "onnxruntime"
    """Runtime that executes the model: `model.onnx`, `model.plan`, `tokenizer.json`, `model.py`
    (needs allow_python_models), or the `pipeline` steps (implied by a `pipeline:` section)."""
    max_batch_size: int | None = Field(None, ge=0, le=MAX_INT32)
    """Largest batch in rows; 0 runs the model unbatched. Default: derived from the model."""
    version_policy: VersionPolicy = Field(default_factory=VersionPolicy)
    """Which versions are served."""
    instances: int | list[InstanceGroup] = 1
    """Batches that run at once: a count (CPU instances sharing one session; GPU 0 for
    TensorRT), or instance groups such as [{count: 2, kind: gpu, gpus: [0, 1]}]."""
    dynamic_batching: DynamicBatching = Field(default_factory=DynamicBatching)
    """Dynamic batcher options."""
    onnxruntime: OnnxRuntimeOptions = Field(default_factory=OnnxRuntimeOptions)
    """ONNX Runtime session options."""
    tensorrt: TensorRTOptions = Field(default_factory=TensorRTOptions)
    """TensorRT options (GPU only)."""
    warmup: Warmup = Field(default_factory=Warmup)
    """Warm-up at load."""
    cache: ModelCache = Field(default_factory=ModelCache)
    """Result cache for this model."""
    tokenizer: TokenizerOptions = Field(default_factory=TokenizerOptions)
    """Tokenizer options (backend tokenizer)."""
    python: PythonOptions | None = None
    """The Python step's class, inputs and outputs (backend python)."""
    pipeline: PipelineOptions | None = None
    """Steps run in place of a model file (backend pipeline)."""
    embeddings: Embeddings = Field(default_factory=Embeddings)
    """How /v1/embeddings serves a text-in embedding model (a pipeline with one BYTES input and
    one FP32 [-1, D] output)."""
    generative: GenerativeOptions | None = None
    """A decoder with a key/value cache, run by the generation scheduler (`sluice convert` of
    a causal LM folder writes it); served by /v1/completions and /v1/chat/completions."""

    @model_validator(mode="before")
    @classmethod
    def _pipeline_backend(cls, data: Any) -> Any:
        # A `pipeline:` section is the model: no backend key is needed beside it.
        if isinstance(data, dict) and data.get("pipeline") is not None:
            return {"backend": "pipeline", **data}
        return data

    @model_validator(mode="after")
    def _step_sections(self) -> ModelConfig:
        for backend, section in (("python", self.python), ("pipeline", self.pipeline)):
            if (self.backend == backend) != (section is not None):
                raise ValueError(
                    f"backend {backend} and a `{backend}:` section go together; got backend "
                    f"{self.backend}{' with' if section is not None else ' without'} one"
                )
        if self.pipeline is not None and self.cache.enabled:
            raise ValueError(
                "cache.enabled is true on a pipeline: its cache key would not change when a "
                "step's model is reloaded; enable the cache on its steps instead"
            )
        return self

    @field_validator("instances")
    @classmethod
    def _instance_count(cls, value: int | list[InstanceGroup]) -> int | list[InstanceGroup]:
        total = value if isinstance(value, int) else sum(group.size for group in value)
        if isinstance(value, list) and not value:
            raise ValueError("instances lists no instance group")
        if not 1 <= total <= 64:
            raise ValueError(f"instances must add up to 1 to 64, not {total}")
        return value

    @model_validator(mode="after")
    def _instance_kinds(self) -> ModelConfig:
        kinds = {group.kind for group in self.instance_groups}
        if self.backend == "tensorrt" and "cpu" in kinds:
            raise ValueError("backend tensorrt runs on GPUs only; use instance groups of kind gpu")
        if self.backend == "onnxruntime" and "gpu" in kinds and not self.onnxruntime.uses_gpu:
            raise ValueError(
                "instances of kind gpu need a GPU provider (one of "
                f"{', '.join(GPU_PROVIDERS)}) in onnxruntime.execution_providers; it lists "
                f"{', '.join(self.onnxruntime.provider_names)}"
            )
        pinned = [
            p.name
            for p in self.onnxruntime.providers
            if p.name in GPU_PROVIDERS and "device_id" in p.options
        ]
        if "gpu" in kinds and pinned:
            raise ValueError(
                f"{pinned[0]} sets device_id, but instances of kind gpu choose their GPUs "
                "(instances: [{kind: gpu, gpus: [...]}]); drop device_id"
            )
        return self

    @property
    def instance_groups(self) -> list[InstanceGroup]:
        """`instances` as groups: a bare count is one cpu group (one gpu group on GPU 0 for
        TensorRT)."""
        if isinstance(self.instances, list):
            return self.instances
        kind = "gpu" if self.backend == "tensorrt" else "cpu"
        return [InstanceGroup(count=self.instances, kind=kind)]

    @property
    def instance_count(self) -> int:
        """Batches that may run at once, over every group."""
        return sum(group.size for group in self.instance_groups)


def load_model_config(model_dir: Path) -> ModelConfig:
    """The model's config.yaml, or the defaults when there is none (auto-complete fills gaps)."""
    path = model_dir / "config.yaml"
    if not path.exists():
        return ModelConfig()
    return parse_model_config(read_yaml(path), source=str(path))


def parse_model_config(data: Any, source: str) -> ModelConfig:
    """A model config from the mapping a config.yaml (or a load request's JSON) holds;
    SettingsError names `source` and every bad key."""
    if not isinstance(data, dict):
        raise SettingsError(
            f"invalid configuration in {source}: expected a mapping of keys, got "
            f"{type(data).__name__}"
        )
    try:
        return ModelConfig(**data)
    except ValidationError as exc:
        raise SettingsError(describe(exc, ModelConfig, source=source)) from exc


def effective_batching(
    config: ModelConfig, defaults: BatchingDefaults
) -> tuple[float | Literal["auto"], int]:
    """(max_queue_delay_s, max_queue_size) with server defaults filled in."""
    batching = config.dynamic_batching
    delay = batching.max_queue_delay_s
    size = batching.max_queue_size
    return (
        defaults.max_queue_delay_s if delay is None else delay,
        defaults.max_queue_size if size is None else size,
    )
