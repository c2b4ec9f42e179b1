"""The sections of a model's `config.yaml`, one per concern (version policy, dynamic batching,
ONNX Runtime and TensorRT options, instance groups, warm-up, result cache), and `Section`, the
base that forbids unknown keys and reads each field's docstring.

Apart from the root (`engine.model_config`: `ModelConfig`, its checks across sections and how a
config is loaded) so that each concern's schema reads on its own; the root composes these
sections and is where importers find them."""

from __future__ import annotations

import logging
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_INT32 = 2**31 - 1
"""Triton's model configuration holds batch sizes as int32 (its gRPC ModelConfig cannot carry
more)."""


class Section(BaseModel):
    """A part of a model's config.yaml (every section of it derives from this one): unknown keys
    are refused, and each field's docstring is its description in the generated reference."""

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
    """Fail the load unless the first listed provider was created and runs at least one of the
    model's nodes (ONNX Runtime otherwise falls back without an error, to CPU when a provider
    cannot start, to the next provider for nodes it does not take)."""

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
    activation_memory_bytes: int | None = Field(None, gt=0)
    """Device memory one instance may take for activations at serve time (its contexts, one per
    profile, share one block); a load whose engine needs more fails, naming both sizes. Not the
    builder's workspace: that is `sluice convert --builder-workspace`, recorded as
    `builder_workspace_bytes` in conversion.json. The old name `workspace_bytes` is still taken
    for this, with a logged deprecation warning."""

    @model_validator(mode="before")
    @classmethod
    def _renamed_workspace(cls, data: Any) -> Any:
        # `workspace_bytes` read as the builder's workspace (conversion.json's key of that name
        # was), so it was renamed; old configs keep working, with a warning, until it goes.
        if not isinstance(data, dict) or "workspace_bytes" not in data:
            return data
        data = dict(data)
        value = data.pop("workspace_bytes")
        if "activation_memory_bytes" in data:
            raise ValueError(
                "workspace_bytes is the deprecated name of activation_memory_bytes: give only "
                "activation_memory_bytes"
            )
        logging.getLogger("sluice.model_config").warning(
            "tensorrt.workspace_bytes is deprecated: it limits activation memory at serve time, "
            "so it is now tensorrt.activation_memory_bytes (the build's workspace is "
            "`sluice convert --builder-workspace`); rename it in config.yaml"
        )
        data["activation_memory_bytes"] = value
        return data


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


class Embeddings(Section):
    matryoshka: bool = False
    """The model was trained so that the leading dimensions of its embedding are an embedding
    on their own (Matryoshka representation learning): /v1/embeddings accepts `dimensions` and
    answers the first that many (re-normalized to unit length where the model's own rows are
    unit length). False: `dimensions` other than the full width is a 400."""
