"""A model's `config.yaml`: backend, batching, instances, backend options, cache and warm-up.

Inputs and outputs come from the model file; a model folder with no config.yaml gets one derived
from the model (batching on when the first axis of every input is dynamic), as Triton's
auto-complete does."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from engine.generation.config import GenerativeOptions
from engine.settings import BatchingDefaults, SettingsError, describe, read_yaml
from engine.step_config import PipelineOptions, PythonOptions, TokenizerOptions

MAX_INT32 = 2**31 - 1
"""Triton's model configuration holds batch sizes as int32 (its gRPC ModelConfig cannot carry
more)."""


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
    max_queue_delay_s: float | Literal["auto"] | None = None
    """How long a batch waits for more requests after its first; default from server settings.
    `auto`: wait only while every queued request can still meet its deadline (its timeout,
    else `latency_target_s`) after the batch's compute, predicted from the model's recent
    batches; a request that can no longer meet it is answered 504 without being run."""
    latency_target_s: float | None = Field(None, gt=0, le=60)
    """With `max_queue_delay_s: auto`: the deadline, from arrival, of requests that set no
    timeout (the latency the batcher plans for and sheds past)."""
    preferred_batch_sizes: list[Annotated[int, Field(le=MAX_INT32)]] = Field(default_factory=list)
    """Row counts at which a batch is sent at once without waiting for the delay."""
    max_queue_size: int | None = Field(None, gt=0)
    """Rows the queue holds before new requests are rejected with 503."""
    priority_levels: int = Field(1, ge=1, le=16)
    """Number of priority levels, numbered as in Triton: 1 is the highest and is served first,
    `priority_levels` the lowest."""
    default_priority_level: int | None = None
    """Level of requests that set no priority (or 0); default: the lowest level."""
    default_timeout_s: float | None = Field(None, gt=0)
    """Deadline of requests that do not set `timeout`; unset means none."""
    pad: dict[str, PadSpec] = Field(default_factory=dict)
    """Inputs that may be padded along an axis so requests of different lengths share a batch."""
    pad_bucket_ratio: float = Field(1.5, ge=1)
    """A padded batch only merges requests whose lengths are within this ratio of each other."""
    dispatch_when_idle: bool = True
    """Send at once when no batch of this model is running instead of waiting for the delay;
    once callers have been arriving together (one at a time from a front-end, as over gRPC), an
    idle batch waits within its delay for as many as the last one gathered (with `auto`, 2 ms
    at most)."""

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        # The old key counted the other way (0 lowest); silently renaming it would invert it.
        if isinstance(data, dict) and "default_priority" in data:
            raise ValueError(
                "default_priority was replaced by default_priority_level, numbered as in Triton: "
                "1 is the highest level, priority_levels the lowest"
            )
        return data

    @field_validator("max_queue_delay_s", mode="before")
    @classmethod
    def _delay_or_auto(cls, value: Any) -> Any:
        # Checked here, so a bad value gets one message instead of one per member of the union.
        if value is None or value == "auto":
            return value
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 10:
            raise ValueError("max_queue_delay_s must be seconds (0 to 10) or auto")
        return value

    @model_validator(mode="after")
    def _latency_target(self) -> DynamicBatching:
        delay = "unset" if self.max_queue_delay_s is None else self.max_queue_delay_s
        if self.latency_target_s is not None and delay != "auto":
            raise ValueError(
                f"latency_target_s {self.latency_target_s} is the deadline max_queue_delay_s: "
                f"auto plans for; max_queue_delay_s is {delay}: set it to auto "
                "or drop latency_target_s"
            )
        return self

    @model_validator(mode="after")
    def _priorities(self) -> DynamicBatching:
        level = self.default_priority_level
        if level is not None and not 1 <= level <= self.priority_levels:
            raise ValueError(
                f"default_priority_level {level} is not a priority level: levels are 1 (highest) "
                f"to {self.priority_levels} (lowest)"
            )
        return self

    @property
    def default_level(self) -> int:
        """The level of requests that set no priority."""
        return self.default_priority_level or self.priority_levels


GPU_PROVIDERS = ("TensorrtExecutionProvider", "CUDAExecutionProvider")
"""ONNX Runtime providers that run on an NVIDIA GPU (and take a `device_id` option)."""

ProviderOption = str | int | float | bool


class ExecutionProvider(Section):
    name: str
    """An ONNX Runtime execution provider, e.g. `CUDAExecutionProvider`."""
    options: dict[str, ProviderOption] = Field(default_factory=dict)
    """Provider options as ONNX Runtime names them (`device_id`, `trt_fp16_enable`,
    `trt_engine_cache_enable`, `trt_engine_cache_path`, ...); ONNX Runtime checks the names."""


class OnnxRuntimeOptions(Section):
    intra_op_threads: int = Field(1, ge=0)
    """Threads inside one operator (0 lets ONNX Runtime choose)."""
    inter_op_threads: int = Field(1, ge=0)
    """Threads across operators (0 lets ONNX Runtime choose)."""
    graph_optimization_level: Literal["disable", "basic", "extended", "all"] = "all"
    """ONNX Runtime graph optimizations applied at load."""
    execution_providers: list[str | ExecutionProvider] = Field(
        default_factory=lambda: list[str | ExecutionProvider](["CPUExecutionProvider"])
    )
    """Providers in order of preference, each a name or {name, options}; unavailable ones are
    skipped and CPU is the fallback."""
    require_providers: bool = False
    """Fail the load unless the first listed provider is the one that runs (ONNX Runtime
    otherwise falls back to CPU without an error)."""

    @model_validator(mode="after")
    def _known_providers(self) -> OnnxRuntimeOptions:
        import onnxruntime as ort

        known = ort.get_all_providers()
        unknown = [name for name in self.provider_names if name not in known]
        if unknown:
            raise ValueError(
                f"unknown execution provider '{unknown[0]}'; ONNX Runtime knows {', '.join(known)}"
            )
        if len(set(self.provider_names)) != len(self.provider_names):
            raise ValueError(f"execution_providers lists a provider twice: {self.provider_names}")
        return self

    @property
    def providers(self) -> list[ExecutionProvider]:
        """Every listed provider as {name, options}, in order."""
        return [
            ExecutionProvider(name=p) if isinstance(p, str) else p for p in self.execution_providers
        ]

    @property
    def provider_names(self) -> list[str]:
        """The listed providers' names, in order."""
        return [provider.name for provider in self.providers]

    @property
    def uses_gpu(self) -> bool:
        """Whether any listed provider runs on a GPU."""
        return any(name in GPU_PROVIDERS for name in self.provider_names)


class TensorRTOptions(Section):
    profile: int | None = Field(None, ge=0)
    """Optimization profile every instance uses; unset: each instance has an execution context
    per profile and runs each batch on the one whose ranges hold its shapes (nearest its opt
    shapes), as Triton does."""
    workspace_bytes: int | None = Field(None, gt=0)
    """Device memory one instance may take for activations (its contexts, one per profile,
    share one block); a load whose engine needs more fails, naming both sizes."""


class InstanceGroup(Section):
    count: int = Field(1, ge=1, le=64)
    """Instances in this group (per listed GPU for kind gpu, as in Triton)."""
    kind: Literal["cpu", "gpu"] = "cpu"
    """Where the instances run: cpu instances share one session; each gpu instance has its own
    session or TensorRT execution context on its device."""
    gpus: list[Annotated[int, Field(ge=0)]] | None = None
    """CUDA device ordinals for kind gpu (default [0])."""

    @model_validator(mode="after")
    def _devices(self) -> InstanceGroup:
        if self.gpus is not None:
            if self.kind != "gpu":
                raise ValueError(
                    f"gpus {self.gpus} is set on an instance group of kind {self.kind}; only "
                    "kind gpu takes gpus"
                )
            if not self.gpus or len(set(self.gpus)) != len(self.gpus):
                raise ValueError(f"gpus {self.gpus} must list distinct device ordinals")
        return self

    @property
    def devices(self) -> list[int]:
        """The device of each instance in this group (empty for kind cpu)."""
        if self.kind == "cpu":
            return []
        return [gpu for gpu in (self.gpus or [0]) for _ in range(self.count)]

    @property
    def size(self) -> int:
        """Instances in this group in all."""
        return len(self.devices) if self.kind == "gpu" else self.count


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
