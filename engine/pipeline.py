"""Pipelines: a repository model whose config.yaml lists `pipeline:` steps instead of a model file.

Each step names a repository model and maps tensor names (as Triton's ensemble_scheduling does).
A pipeline request runs the steps in dependency order, each through its model's own batcher, so
under load every stage batches with the other requests at that stage. The step's model is
resolved at each request: a step reloaded under a running pipeline serves new requests on the
new version while requests already queued there finish on the old one. Errors keep their kind
(400 stays 400) and name the pipeline and the step; statistics are the step models' own.

The pipeline itself is a LoadedModel with an unbatched Batcher (one request per run, up to
`max_concurrency` at once) whose run function is `PipelineRunner`; it has no backend of its own
beyond a description of its inputs and outputs."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from batching.batcher import Batcher
from batching.errors import BatchingError
from batching.policy import BatchPolicy
from engine.backends.tokenizer import TOKEN_OUTPUTS, TRUNCATED
from engine.errors import (
    BackendError,
    EngineError,
    InvalidInput,
    ModelNotFound,
    ModelNotReady,
    from_batching,
)
from engine.model import LoadedModel, fingerprint
from engine.model_config import ModelConfig, effective_batching
from engine.settings import BatchingDefaults
from engine.stats import ModelStats
from engine.step_config import PipelineOptions, PipelineStep
from engine.types import TensorSpec

log = logging.getLogger("sluice.pipeline")

Resolve = Callable[[str, str | None], LoadedModel]

TRUNCATED_ROWS = "truncated_rows"
"""Response parameter: rows a tokenizer step cut to its max_length (present when any was)."""

TOKENS = "tokens"
"""Response parameter: the tokens the pipeline's first encoding tokenizer step gave the model,
special tokens included, after truncation (present when such a step ran); the usage that
/v1/embeddings reports."""


class PipelineRequest(dict[str, np.ndarray]):
    """A pipeline request's inputs, carrying what its steps' batchers need (the pipeline's
    Batcher hands an unbatched request's own inputs object to the run function)."""

    priority: int = 1
    tenant: str = ""
    deadline: float | None = None


class PipelineAnswer(dict[str, np.ndarray]):
    """The pipeline's outputs and the response parameters they come with."""

    parameters: dict[str, Any]


@dataclass(slots=True)
class PipelineDescription:
    """What metadata, validation and Triton's config see as the pipeline's "backend"."""

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    platform: str = "ensemble"
    provider: str = "pipeline"

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        raise BackendError("a pipeline runs through its steps' batchers, not as one backend")

    def close(self) -> None:
        pass


class PipelineBatcher(Batcher):
    """An unbatched Batcher that lets each request's priority, tenant and deadline reach the
    steps' batchers."""

    async def submit(
        self,
        inputs: dict[str, np.ndarray],
        rows: int,
        priority: int = 1,
        tenant: str = "",
        deadline: float | None = None,
        arrived: float | None = None,
        on_run: Callable[[], None] | None = None,
        on_leave: Callable[[], None] | None = None,
    ) -> dict[str, np.ndarray]:
        request = PipelineRequest(inputs)
        request.priority, request.tenant, request.deadline = priority, tenant, deadline
        return await super().submit(
            request, rows, priority, tenant, deadline, arrived, on_run, on_leave
        )


def _label(name: str, index: int, step: PipelineStep) -> str:
    return f"pipeline '{name}' step {index + 1} ('{step.model}')"


def _in_step(exc: EngineError, where: str) -> EngineError:
    """`exc` of the same kind (so 400 stays 400), its message prefixed with the step."""
    renamed = type(exc).__new__(type(exc))
    renamed.__dict__.update(exc.__dict__)
    renamed.message = f"{where}: {exc.message}"
    renamed.args = (renamed.message,)
    return renamed


class PipelineRunner:
    """Runs one pipeline request through its steps (the pipeline Batcher's run function)."""

    def __init__(self, name: str, version: str, options: PipelineOptions, resolve: Resolve) -> None:
        self._name, self._version, self._options, self._resolve = name, version, options, resolve
        self._order = options.order()
        self._outputs = options.output_names

    async def __call__(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        priority = getattr(inputs, "priority", 1)
        tenant = getattr(inputs, "tenant", "")
        deadline = getattr(inputs, "deadline", None)
        tensors = dict(inputs)
        truncated = 0
        tokens: int | None = None
        for index in self._order:
            step = self._options.steps[index]
            where = _label(self._name, index, step)
            started = time.monotonic()
            try:
                model = self._resolve(step.model, step.version)
            except (ModelNotFound, ModelNotReady) as exc:  # the operator's doing, not the client's
                raise ModelNotReady(self._name, self._version, f"{where}: {exc.message}") from exc
            try:
                feed = {given: tensors[tensor] for given, tensor in step.inputs.items()}
                rows = _rows(feed) if model.max_batch_size else 1
                level = min(priority, model.config.dynamic_batching.priority_levels)
                try:
                    outputs = await model.batcher.submit(feed, rows, level, tenant, deadline)
                except BatchingError as exc:
                    raise from_batching(exc) from exc
                finish = getattr(model.backend, "finish_request", None)
                if finish is not None:
                    outputs = finish(outputs)
            except EngineError as exc:
                model.stats.request_done(time.monotonic() - started, ok=False)
                raise _in_step(exc, where) from exc
            model.stats.request_done(time.monotonic() - started, ok=True)
            if model.backend.platform == "tokenizer" and TRUNCATED in outputs:
                cut = np.flatnonzero(outputs[TRUNCATED])
                if cut.size and not step.truncation:
                    text = next(iter(step.inputs.values()))
                    raise InvalidInput(
                        f"{where}: input '{text}' row {int(cut[0])} is longer than the "
                        f"{model.config.tokenizer.max_length} tokens model '{step.model}' takes, "
                        "and this step does not truncate (truncation: false)"
                    )
                truncated += int(cut.size)
                if tokens is None:  # the first text's tokens; a later step's are derived
                    tokens = int(np.count_nonzero(outputs[TOKEN_OUTPUTS[1]]))
            for produced, tensor in step.outputs.items():
                tensors[tensor] = outputs[produced]
        answer = PipelineAnswer({name: tensors[name] for name in self._outputs})
        answer.parameters = {TRUNCATED_ROWS: truncated} if truncated else {}
        if tokens is not None:
            answer.parameters[TOKENS] = tokens
        return answer


def _rows(feed: dict[str, np.ndarray]) -> int:
    first = next(iter(feed.values()))
    return int(first.shape[0]) if first.ndim else 1


def describe(
    name: str, options: PipelineOptions, resolve: Resolve
) -> tuple[PipelineDescription, int]:
    """The pipeline's inputs and outputs (named as the pipeline names them, typed as its steps
    type them) and its max_batch_size (the smallest of its steps'), checking that every step's
    model is loaded, is no pipeline, and that the tensor mapping fits each step's model."""
    producers: dict[str, TensorSpec] = {}
    consumers: dict[str, tuple[TensorSpec, str]] = {}
    limits = []
    for index, step in enumerate(options.steps):
        where = _label(name, index, step)
        try:
            model = resolve(step.model, step.version)
        except EngineError as exc:
            raise ValueError(f"{where}: {exc.message}") from exc
        if model.config.pipeline is not None:
            raise ValueError(f"{where}: model '{step.model}' is a pipeline; steps run models")
        limits.append(model.max_batch_size)
        model_inputs = {spec.name: spec for spec in model.inputs()}
        model_outputs = {spec.name: spec for spec in model.backend.outputs}
        unknown = [n for n in step.inputs if n not in model_inputs]
        missing = [n for n in model_inputs if n not in step.inputs]
        if unknown or missing:
            raise ValueError(
                f"{where}: inputs maps {sorted(step.inputs)}; model '{step.model}' takes "
                f"{sorted(model_inputs)}"
            )
        unknown = [n for n in step.outputs if n not in model_outputs]
        if unknown:
            raise ValueError(
                f"{where}: outputs maps '{unknown[0]}'; model '{step.model}' has outputs "
                f"{sorted(model_outputs)}"
            )
        for given, tensor in step.inputs.items():
            spec = model_inputs[given]
            seen = consumers.get(tensor)
            if seen is not None and seen[0].datatype != spec.datatype:
                raise ValueError(
                    f"{where}: pipeline tensor '{tensor}' is read as {spec.datatype} here and "
                    f"as {seen[0].datatype} by {seen[1]}"
                )
            consumers.setdefault(tensor, (spec, where))
        for produced, tensor in step.outputs.items():
            producers[tensor] = model_outputs[produced]
    for tensor, (spec, where) in consumers.items():
        made = producers.get(tensor)
        if made is not None and made.datatype != spec.datatype:
            raise ValueError(
                f"{where}: pipeline tensor '{tensor}' is {made.datatype} but is read as "
                f"{spec.datatype}"
            )
    inputs = tuple(_renamed(consumers[t][0], t) for t in options.inputs)
    outputs = tuple(_renamed(producers[t], t) for t in options.output_names)
    return PipelineDescription(inputs, outputs), 0 if 0 in limits else min(limits)


def _renamed(spec: TensorSpec, name: str) -> TensorSpec:
    return TensorSpec(name, spec.datatype, spec.shape, spec.dim_names)


async def load_pipeline(
    name: str,
    version: int,
    path: Path,
    config: ModelConfig,
    defaults: BatchingDefaults,
    tenant_share: Callable[[str], float] | None,
    resolve: Resolve,
) -> LoadedModel:
    """A pipeline as a LoadedModel whose steps are resolved through `resolve` (the registry)."""
    options = config.pipeline
    assert options is not None  # backend pipeline comes with its section
    label = f"model '{name}' version {version}"
    description, max_batch = describe(name, options, resolve)
    content_fingerprint = await asyncio.to_thread(fingerprint, path, config)
    _, queue_rows = effective_batching(config, defaults)
    policy = BatchPolicy(
        max_batch_size=0,  # every step batches; the pipeline runs each request on its own
        max_queue_size=max(queue_rows, options.max_concurrency),
        priority_levels=config.dynamic_batching.priority_levels,
        instances=options.max_concurrency,
    )
    stats = ModelStats()
    runner = PipelineRunner(name, str(version), options, resolve)
    batcher = PipelineBatcher(runner, policy, stats, tenant_share, label)
    executor = ThreadPoolExecutor(1, thread_name_prefix=f"pipeline-{name}")  # never used
    log.info(
        "loaded %s: pipeline of %s",
        label,
        " -> ".join(f"'{s.model}'" for s in options.steps),
        extra={"model": name, "version": str(version), "steps": len(options.steps)},
    )
    return LoadedModel(
        name,
        str(version),
        config,
        description,
        max_batch,
        content_fingerprint,
        stats,
        batcher,
        executor,
    )
