"""One loaded model version: its backend, batcher, statistics and effective config."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from batching.assembly import Padding
from batching.batcher import Batcher
from batching.policy import BatchPolicy
from engine import datatypes
from engine.backends.base import CPU_PROVIDER, Backend
from engine.generation.genai import GenaiGenerator, is_genai_folder
from engine.generation.generator import Generator, TextGenerator
from engine.model_config import ModelConfig, PadSpec, effective_batching
from engine.settings import BatchingDefaults
from engine.stats import ModelStats
from engine.types import InferRequest, TensorSpec
from engine.validate import check_inputs, check_outputs

log = logging.getLogger("sluice.model")


def open_backend(config: ModelConfig, path: Path, label: str) -> Backend:
    """Load the model file with the configured runtime (blocking: call from a thread)."""
    if config.backend == "tokenizer":
        from engine.backends.tokenizer import TokenizerBackend

        return TokenizerBackend(path, config.tokenizer, label)
    if config.backend == "python":
        from engine.backends.python_model import PythonBackend

        assert config.python is not None  # the config's validator pairs them
        return PythonBackend(path, config.python, label)
    if config.backend == "tensorrt":
        from engine.backends.tensorrt import TensorRTBackend

        return TensorRTBackend(path, config.tensorrt, label, config.instance_groups)
    from engine.backends.onnxruntime import OnnxBackend

    return OnnxBackend(path, config.onnxruntime, label, config.instance_groups)


def batch_size_limit(config: ModelConfig, inputs: tuple[TensorSpec, ...], default: int) -> int:
    """Auto-complete: batched when every input's first axis is dynamic, unless the config says."""
    dynamic_first = bool(inputs) and all(s.shape and s.shape[0] == -1 for s in inputs)
    if config.max_batch_size is None:
        return default if dynamic_first else 0
    if config.max_batch_size > 0 and not dynamic_first:
        fixed = [s.name for s in inputs if not s.shape or s.shape[0] != -1]
        raise ValueError(
            f"max_batch_size is {config.max_batch_size} but inputs {', '.join(fixed)} have no "
            "dynamic first axis; set max_batch_size: 0 or export the model with a batch axis"
        )
    return config.max_batch_size


def padding_plan(
    pad: Mapping[str, PadSpec],
    inputs: tuple[TensorSpec, ...],
    outputs: tuple[TensorSpec, ...],
) -> dict[str, Padding]:
    """The batcher's padding of each padded input, with the output axes that follow its padded
    axis: as the config lists them, or else every output axis that carries the input axis's
    symbolic dim name in the model. A name or axis the model does not have is a ValueError."""
    known_inputs = {spec.name: spec for spec in inputs}
    known_outputs = {spec.name: spec for spec in outputs}
    plan = {}
    for name, spec in pad.items():
        model_input = known_inputs.get(name)
        if model_input is None:
            raise ValueError(
                f"dynamic_batching.pad names input '{name}'; the model's inputs are "
                f"{', '.join(known_inputs)}"
            )
        if spec.axis >= len(model_input.shape):
            raise ValueError(
                f"dynamic_batching.pad.{name}.axis is {spec.axis}; input '{name}' has shape "
                f"{list(model_input.shape)} (axes 1 to {len(model_input.shape) - 1} can be padded)"
            )
        if spec.outputs is None:
            follows = _named_like(model_input, spec.axis, outputs)
        else:
            follows = {}
            for output, axes in spec.outputs.items():
                model_output = known_outputs.get(output)
                if model_output is None:
                    raise ValueError(
                        f"dynamic_batching.pad.{name}.outputs names output '{output}'; the "
                        f"model's outputs are {', '.join(known_outputs)}"
                    )
                follows[output] = (axes,) if isinstance(axes, int) else tuple(axes)
                rank = len(model_output.shape)
                if any(axis >= rank for axis in follows[output]):
                    raise ValueError(
                        f"dynamic_batching.pad.{name}.outputs.{output} is {axes}; output "
                        f"'{output}' has shape {list(model_output.shape)} (axes 1 to {rank - 1} "
                        "can follow the padded axis)"
                    )
        plan[name] = Padding(spec.axis, spec.value, follows)
    return plan


def _named_like(
    model_input: TensorSpec, axis: int, outputs: tuple[TensorSpec, ...]
) -> dict[str, tuple[int, ...]]:
    """Every non-batch output axis with the padded input axis's symbolic name (none if unnamed)."""
    dim = model_input.dim_names[axis] if axis < len(model_input.dim_names) else None
    if dim is None:
        return {}
    follows = {}
    for output in outputs:
        axes = tuple(i for i, name in enumerate(output.dim_names) if i > 0 and name == dim)
        if axes:
            follows[output.name] = axes
    return follows


def fingerprint(path: Path, config: ModelConfig) -> str:
    """Content hash of the version folder (the model file and any external weights beside it)
    and the config: the same on every replica serving the same files, so a shared cache is
    shared, and new whenever either changes, so stale entries die."""
    digest = hashlib.blake2b(config.model_dump_json().encode(), digest_size=12)
    for file in sorted(p for p in path.parent.rglob("*") if p.is_file()):
        digest.update(str(file.relative_to(path.parent)).encode() + b"\0")
        with file.open("rb") as handle:
            while chunk := handle.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()


def warm_up(backend: Backend, sizes: list[int], max_batch_size: int) -> None:
    """Run zeros through the model so the first real request pays no first-run cost. A backend
    with a session or TensorRT context per instance hands runs to its instances in turn, so
    each size runs once per instance (`instance_slots`): an ONNX Runtime TensorRT provider
    builds its engine on a session's first run, which must not be a client's."""
    batches = sorted({min(s, max_batch_size) for s in sizes}) if max_batch_size else [0]
    for batch in batches:
        feed = {}
        for spec in backend.inputs:
            shape = [1 if d == -1 else d for d in spec.shape]
            if batch:
                shape[0] = batch
            dtype = datatypes.numpy_dtype(spec.datatype)
            feed[spec.name] = (
                np.full(shape, b"", dtype=object)
                if spec.datatype == "BYTES"
                else np.zeros(shape, dtype)
            )
        for _ in range(getattr(backend, "instance_slots", 1)):
            backend.run(feed)


class BatchRunner:
    """Runs batches in the model's thread pool, or right on the event loop when the model has
    one instance and its batches take under INLINE_BELOW_S: a thread hand-off costs more than
    such a run (it dominated a 15 µs MLP batch; for batches of 16-64 rows of the benchmark MLP it
    cost 1-11 µs of CPU per request more than running them inline), and a run that short holds
    the loop no longer than parsing a few requests does.

    A run is timed by its thread's CPU time, on the loop and in the pool. The wall clock would
    also count, in the pool, the wait for the GIL while the loop thread holds it (on a busy loop,
    milliseconds for a 15 µs run, which then never came back to the loop), and on the loop, the
    turns other processes take on a shared core (one turn of 10 ms sends a 40 µs model into the
    pool for a dozen runs, each hand-off dearer than the run). So inline is only for backends that
    compute in the calling thread (`inline`: ONNX Runtime on the CPU, whose intra-op threads
    spin while the caller computes its share), whose CPU time is the time they hold the loop.
    (The CPU clock is a system call, dearer than the wall clock: the pool's hop dwarfs it.)"""

    INLINE_BELOW_S = 0.001
    """A bound with room: the benchmark MLP's 64-row batches cost ~130 µs of CPU alone and ~200 µs
    in a loaded engine process, where a bound of 200 µs sent one batch in nine to the pool."""

    def __init__(self, backend: Backend, executor: ThreadPoolExecutor, inline: bool) -> None:
        self._backend = backend
        self._executor = executor
        self._inline = inline
        self._typical_s: float | None = None  # moving average of run time
        self.last_run = (0.0, 0.0)
        """time.monotonic() start and end of the latest batch run (for tracing's spans)."""

    async def __call__(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        started = time.monotonic()
        try:
            inline = self._typical_s is not None and self._typical_s < self.INLINE_BELOW_S
            if self._inline and inline:
                outputs, seconds = self._timed(inputs)
            else:
                loop = asyncio.get_running_loop()
                outputs, seconds = await loop.run_in_executor(self._executor, self._timed, inputs)
        finally:
            self.last_run = (started, time.monotonic())  # a failed run is a run too (its span)
        typical = self._typical_s
        self._typical_s = seconds if typical is None else 0.9 * typical + 0.1 * seconds
        return outputs

    def _timed(self, inputs: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], float]:
        started = time.thread_time()
        outputs = self._backend.run(inputs)
        return outputs, time.thread_time() - started


@dataclass(eq=False)
class LoadedModel:
    name: str
    version: str
    config: ModelConfig
    backend: Backend
    max_batch_size: int
    content_fingerprint: str
    """A hash of the version folder's files and the config (`fingerprint`): the cache keys'
    scope, new whenever either changes."""
    stats: ModelStats
    batcher: Batcher
    executor: ThreadPoolExecutor
    runner: BatchRunner | None = None
    generator: TextGenerator | None = None
    """The generation scheduler and text of a generative model (config `generative:`, or an
    onnxruntime-genai model builder's output)."""

    @functools.cached_property
    def label(self) -> str:
        return f"model '{self.name}' version {self.version}"

    @functools.cached_property
    def input_check(self) -> ModelCheck:
        """The check front-ends run on the shapes and datatypes a request declares, before
        decoding any tensor data: `rows` takes its answer instead of checking them again."""
        return ModelCheck(self)

    def rows(self, request: InferRequest) -> int:
        """The request's rows (1 if unbatched), checked against this version: its inputs, unless
        its front-end ran this version's `input_check` on them (the decoded arrays have the
        shapes and datatypes they declared), then the outputs it asks for; else InvalidInput."""
        checked = request.checked
        if checked is not None and checked.check is self.input_check and type(checked.rows) is int:
            rows = checked.rows
        else:
            shapes = {name: array.shape for name, array in request.inputs.items()}
            rows = self.input_check(shapes, request.datatypes)
        if request.outputs is not None:
            check_outputs(request.outputs, self.backend.outputs, self.label)
        return rows

    def inputs(self) -> tuple[TensorSpec, ...]:
        return self.backend.inputs

    def last_run(self) -> tuple[float, float]:
        """Monotonic start and end of this version's latest batch run ((0, 0) before any)."""
        return (0.0, 0.0) if self.runner is None else self.runner.last_run

    async def close(self) -> None:
        if self.generator is not None:
            await self.generator.close()
        await self.batcher.close()
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.backend.close()


class ModelCheck:
    """One version's InputCheck (`check_inputs` against its inputs), which knows its version
    (weakly: the version keeps its check, and a cycle would outlive an unload until the
    collector ran): the engine serves a request its front-end checked with the version that
    checked it."""

    __slots__ = ("_model", "inputs", "label", "max_batch_size")

    def __init__(self, model: LoadedModel) -> None:
        self._model = weakref.ref(model)
        self.inputs = model.backend.inputs
        self.max_batch_size = model.max_batch_size
        self.label = model.label

    @property
    def model(self) -> LoadedModel | None:
        """The version, or None once it is gone."""
        return self._model()

    def __call__(self, shapes: Mapping[str, Sequence[int]], datatypes: Mapping[str, str]) -> int:
        return check_inputs(shapes, datatypes, self.inputs, self.max_batch_size, self.label)


async def load_model(
    name: str,
    version: int,
    path: Path,
    config: ModelConfig,
    defaults: BatchingDefaults,
    tenant_share: Callable[[str], float] | None = None,
    stats: ModelStats | None = None,
) -> LoadedModel:
    """Open, auto-complete, warm up and start batching one model version. `stats` carries on
    the counters of an earlier load of the same version (reloaded after an eviction)."""
    label = f"model '{name}' version {version}"
    started = time.monotonic()
    stats = stats if stats is not None else ModelStats()
    genai: GenaiGenerator | None = None
    if is_genai_folder(path.parent):  # onnxruntime-genai's model builder wrote this version
        genai = await asyncio.to_thread(
            GenaiGenerator, path.parent, config.generative, label, stats.generation
        )
        backend: Backend = genai.backend
    else:
        backend = await asyncio.to_thread(open_backend, config, path, label)
    try:
        content_fingerprint = await asyncio.to_thread(fingerprint, path, config)
        max_batch = batch_size_limit(config, backend.inputs, defaults.max_batch_size)
        padding = padding_plan(config.dynamic_batching.pad, backend.inputs, backend.outputs)
        for padded, pad in padding.items():  # which outputs are cut is not visible elsewhere
            cut = ", ".join(f"{out} axes {list(axes)}" for out, axes in pad.outputs.items())
            cut = cut or "no output (all split on the batch axis only)"
            log.info("%s pads input '%s' on axis %d; cut back: %s", label, padded, pad.axis, cut)
        warmed = time.monotonic()
        if config.warmup.enabled:
            await asyncio.to_thread(warm_up, backend, config.warmup.batch_sizes, max_batch)
        warm_up_s = time.monotonic() - warmed
    except BaseException:
        backend.close()
        raise
    delay, queue_rows = effective_batching(config, defaults)
    batching = config.dynamic_batching
    policy = BatchPolicy(
        max_batch_size=max_batch if batching.enabled else 0,
        max_queue_delay_s=delay,
        preferred_batch_sizes=tuple(s for s in batching.preferred_batch_sizes if s <= max_batch),
        max_queue_size=max(queue_rows, max_batch),
        priority_levels=batching.priority_levels,
        instances=config.instance_count,
        padding=padding,
        pad_bucket_ratio=batching.pad_bucket_ratio,
        dispatch_when_idle=batching.dispatch_when_idle,
        latency_target_s=batching.latency_target_s,
    )
    executor = ThreadPoolExecutor(
        config.instance_count, thread_name_prefix=f"infer-{name}-{version}"
    )
    # Only a run that computes in the calling thread may go inline: its CPU time is its cost.
    # Python steps may block however fast they were so far, a GPU run waits on the device and
    # a tokenizer spreads a batch over its own threads: they always run in the pool.
    inline = config.instance_count == 1 and backend.provider == CPU_PROVIDER
    runner = BatchRunner(backend, executor, inline=inline)
    batcher = Batcher(runner, policy, stats, tenant_share, label)
    load_s = time.monotonic() - started
    log.info(
        "loaded %s on %s in %.3f s (warm-up %.3f s, max_batch_size %d)",
        label,
        backend.provider,
        load_s,
        warm_up_s,
        max_batch,
        extra={
            "model": name,
            "version": str(version),
            "provider": backend.provider,
            "load_s": round(load_s, 4),
            "warm_up_s": round(warm_up_s, 4),
            "max_batch_size": max_batch,
            "instances": config.instance_count,
        },
    )
    generator: TextGenerator | None = genai
    if genai is None and config.generative is not None:
        try:
            generator = Generator(
                backend, config.generative, path.parent, executor, label, stats.generation
            )
        except BaseException:
            executor.shutdown(wait=False)
            backend.close()
            raise
    return LoadedModel(
        name,
        str(version),
        config,
        backend,
        max_batch,
        content_fingerprint,
        stats,
        batcher,
        executor,
        runner,
        generator,
    )
