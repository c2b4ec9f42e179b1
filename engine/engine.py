"""The engine facade: the only thing front-ends talk to.

infer: resolve model -> validate -> (admission) -> (result cache) -> batcher -> backend."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable, Collection, Mapping
from pathlib import Path
from typing import Any

from batching.errors import BatchingError, DeadlinePassed, QueueFull
from engine.auth import ANONYMOUS_TENANT, Authenticator
from engine.cache import CachedResult, ResultCache, build_cache, cache_requested
from engine.cached import CachedInference
from engine.errors import (
    EngineError,
    Forbidden,
    InvalidInput,
    ShuttingDown,
    from_batching,
)
from engine.limits import Limiter, build_limiter
from engine.limits.limiter import Admission
from engine.metrics import Metrics
from engine.model import LoadedModel
from engine.registry import ModelRegistry
from engine.repository import Repository
from engine.settings import Settings
from engine.tracing import build_tracing
from engine.triton_config import triton_config
from engine.types import InferRequest, InferResponse, ModelMetadata
from engine.validate import (
    InputCheck,
    check_load_parameters,
    check_request,
    check_unload_parameters,
    unchecked,
)

log = logging.getLogger("sluice.engine")

VERSION = "0.1.0"
MAX_FRONT_END_S = 3600.0
"""A request's `arrived` older than this (or later than the engine took it) is not believed."""
EXTENSIONS = [
    "binary_tensor_data", "model_configuration", "model_repository",
    "model_repository(unload_dependents)", "statistics", "schedule_policy",
]  # fmt: skip

NEVER_RAN = (QueueFull, DeadlinePassed)
"""What the batcher refuses before running a request: its admission charge is refunded."""


class Engine:
    """Loads models from the repository and answers inference requests."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._tempdir: Path | None = None
        self._registry: ModelRegistry | None = None
        self._started = False
        self._draining = False
        self._in_flight = 0
        self._idle = asyncio.Event()  # set while no request is inside infer()
        self._idle.set()
        self.metrics = Metrics(self._snapshot)
        self.tracing = build_tracing(settings.tracing)  # None: off
        self.cache: ResultCache | None = None
        self.authenticator = Authenticator(settings.auth)
        self.limiter: Limiter = build_limiter(settings.rate_limit)
        self._cached: CachedInference | None = None  # the result-cache path, from start()

    # -- lifecycle -------------------------------------------------------------------------------

    @property
    def registry(self) -> ModelRegistry:
        if self._registry is None:
            raise RuntimeError("engine not started")
        return self._registry

    async def start(self) -> None:
        """Scan the repository and load what the model control mode says."""
        root = self.settings.model_repository
        if root is None:
            from engine.demo import write_demo_repository  # builds it with onnx: only here

            self._tempdir = Path(tempfile.mkdtemp(prefix="sluice-demo-"))
            root = write_demo_repository(self._tempdir)
        self.cache = build_cache(self.settings.cache)
        self._cached = CachedInference(self.cache, self.settings.cache)
        self._registry = ModelRegistry(
            self.settings,
            Repository(root),
            lambda tenant: self.limiter.limits_for(tenant).max_queue_share,
        )
        await self._registry.start()
        self._started = True

    @property
    def live(self) -> bool:
        return True

    @property
    def ready(self) -> bool:
        """Started and not draining; with `strict_readiness`, also every model asked for serves
        (see ModelRegistry.serving_all)."""
        if not self._started or self._draining:
            return False
        return self.registry.serving_all() if self.settings.strict_readiness else True

    async def ready_now(self) -> bool:
        """`ready`: the engine is in this process, so it is current."""
        return self.ready

    @property
    def draining(self) -> bool:
        return self._draining

    def stop_accepting(self) -> None:
        """The first step of a drain: readiness turns 503 and new requests are refused
        (ShuttingDown); requests already accepted carry on."""
        self._draining = True
        if self._registry is not None:
            self._registry.stop_polling()

    async def drain(self) -> None:
        """Stop taking requests and finish every queued and running one, bounded by
        `drain_timeout_s`; whatever is still left then is answered ShuttingDown by close()."""
        self.stop_accepting()
        models = self.registry.all()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.settings.drain_timeout_s):
                await asyncio.gather(
                    *(m.batcher.drain() for m in models),
                    *(m.generator.drain() for m in models if m.generator is not None),
                )
                # Requests accepted before the drain may still be in admission or the cache
                # lookup: they reach a batcher that sends at once, and are answered.
                await self._idle.wait()
        # Whatever is still queued or running after the timeout is answered 503 now.
        await asyncio.gather(*(m.batcher.close() for m in models))

    async def close(self) -> None:
        self._draining = True
        if self._registry is not None:
            await self._registry.close()
        if self.cache is not None:
            await self.cache.close()
        await self.limiter.aclose()
        if self.tracing is not None:
            await asyncio.to_thread(self.tracing.close)  # flushes spans: network, off the loop
        if self._tempdir is not None:
            shutil.rmtree(self._tempdir, ignore_errors=True)

    # -- inference -------------------------------------------------------------------------------

    async def infer(self, request: InferRequest) -> InferResponse:
        """Answer one request, or raise an EngineError saying why not."""
        self._in_flight += 1
        self._idle.clear()
        try:
            return await self._infer(request)
        finally:
            self._in_flight -= 1
            if not self._in_flight:
                self._idle.set()

    async def _infer(self, request: InferRequest) -> InferResponse:
        started = time.monotonic()
        if self._draining:
            raise ShuttingDown()
        on_demand = self.registry.on_demand
        if on_demand is None:
            model = self.registry.resolve(request.model_name, request.model_version)
            return await self._serve(model, request, started)
        registry, name, version = self.registry, request.model_name, request.model_version
        wait_s = request.timeout_s or self.settings.model_memory.load_wait_s
        if not registry.has(name) and registry.known(name) and self._may_hit(name, request):
            # Evicted, its results cached: checked against its last load, and a cache hit
            # answers without loading it; only a miss loads it (once for the requests that miss
            # together).
            last = registry.describe(name, version)
            with on_demand.held(last.name):
                return await self._serve(
                    last, request, started, lambda: registry.acquire(name, version, wait_s)
                )
        model = await registry.acquire(name, version, wait_s)
        with on_demand.held(model.name):  # never evicted while this request holds it
            return await self._serve(model, request, started)

    def _may_hit(self, name: str, request: InferRequest) -> bool:
        """Whether the result cache may answer a request of the model `name` (loaded before)."""
        config = self.registry.describe(name, request.model_version).config
        return (
            self._cached is not None
            and config.cache.enabled
            and cache_requested(request.parameters)
        )

    async def _serve(
        self,
        model: LoadedModel,
        request: InferRequest,
        started: float,
        load: Callable[[], Awaitable[LoadedModel]] | None = None,
    ) -> InferResponse:
        """Answer the request with `model`; with `load`, `model` is an evicted version's last
        load, and `load` gives the version to run when the answer is not in the result cache."""
        rows = check_request(
            request, model.backend.inputs, model.backend.outputs, model.max_batch_size, model.label
        )
        tenant = request.tenant or ANONYMOUS_TENANT
        # Everything that can refuse a request is checked before admission charges for it.
        priority = self._priority(
            model, request.priority, tenant, self.limiter.limits_for(tenant).priority
        )
        use_cache = (
            self._cached is not None
            and model.config.cache.enabled
            and cache_requested(request.parameters)
        )
        admit = self.limiter.admit(tenant, model.name, rows)
        if self.tracing is not None:
            admit = self.tracing.stage("admission", admit)
        with await admit as admission:  # released on the way out (a coroutine pair less)
            try:
                return await self._admitted(
                    model, request, rows, priority, started, use_cache, admission, load
                )
            except EngineError as exc:
                if isinstance(exc.__cause__, NEVER_RAN):  # refused by the queue: nothing used
                    await admission.refund(admission.charged)
                raise

    def _priority(
        self, model: LoadedModel, asked: int | None, tenant: str, tenant_priority: int
    ) -> int:
        """The request's batching level, numbered as in Triton (1 is the highest): as asked, or
        else the tenant's own level, or else the model's default_priority_level; 0 asks for the
        default. A tenant level past the model's lowest is its lowest. With API keys configured,
        no tenant may ask for a higher level (a smaller number) than its own."""
        batching = model.config.dynamic_batching
        lowest = batching.priority_levels
        own = min(tenant_priority, lowest) if tenant_priority else batching.default_level
        if not asked:
            return own
        if asked > lowest:
            raise InvalidInput(
                f"priority {asked} is out of range for {model.label}: its priority levels are "
                f"1 (highest) to {lowest} (lowest), and 0 or none means its default level "
                f"{batching.default_level}"
            )
        if not self.authenticator.open and asked < own:
            raise Forbidden(
                f"tenant '{tenant}' may use priority levels {own} to {lowest} of {model.label} "
                f"(1 is the highest); asked for {asked}"
            )
        return asked

    async def _admitted(
        self,
        model: LoadedModel,
        request: InferRequest,
        rows: int,
        priority: int,
        started: float,
        use_cache: bool,
        admission: Admission,
        load: Callable[[], Awaitable[LoadedModel]] | None = None,
    ) -> InferResponse:
        batching = model.config.dynamic_batching
        timeout_s = request.timeout_s or batching.default_timeout_s
        arrived = request.arrived
        if arrived is None or not started - MAX_FRONT_END_S <= arrived <= started:
            arrived = started  # none given, or not a time the front-end can have taken it
        deadline = arrived + timeout_s if timeout_s else None
        names = request.outputs or [spec.name for spec in model.backend.outputs]
        types = {s.name: s.datatype for s in model.backend.outputs if s.name in names}
        parameters: dict[str, Any] = {}

        async def compute(
            deadline: float | None = deadline, on_run: Callable[[], None] | None = None
        ) -> CachedResult:
            tenant = request.tenant or ANONYMOUS_TENANT
            try:
                runner = model if load is None else await load()
            except EngineError:  # never ran: the admission's charge goes back
                await admission.refund(admission.charged)
                raise
            # The admission's slots are held while the batcher holds the request: a caller who
            # leaves while it runs does not free a place for another run of the tenant's.
            submit = runner.batcher.submit(
                request.inputs, rows, priority, tenant, deadline, arrived, on_run, admission.hold()
            )
            if self.tracing is not None:
                submit = self.tracing.batched(submit, runner.last_run)
            try:
                outputs = await submit
            except BatchingError as exc:
                raise from_batching(exc) from exc
            finish = getattr(runner.backend, "finish_request", None)  # e.g. a tokenizer's
            if finish is not None:  # padding cut back to this request's own rows
                outputs = finish(outputs)
            # A pipeline's answer says e.g. how many rows were truncated (not kept in the cache).
            parameters.update(getattr(outputs, "parameters", None) or {})
            return CachedResult({name: outputs[name] for name in names}, types)

        try:
            if use_cache:
                assert self._cached is not None
                result, hit = await self._cached.result(
                    model, request, rows, compute, deadline, priority, self.tracing
                )
                parameters["cache_hit"] = hit
            else:
                result = await compute()
        except EngineError:
            model.stats.request_done(time.monotonic() - started, ok=False)
            raise
        model.stats.request_done(time.monotonic() - started, ok=True)
        return InferResponse(
            model_name=model.name,
            model_version=model.version,
            outputs=dict(result.outputs),
            datatypes=dict(result.datatypes),
            id=request.id,
            parameters=parameters,
        )

    # -- metadata --------------------------------------------------------------------------------
    # Metadata, config, statistics and the index are coroutines as the facade has them (a
    # worker awaits the engine process for each); here each answers at once.

    def server_metadata(self) -> dict[str, Any]:
        return {"name": "sluice", "version": VERSION, "extensions": EXTENSIONS}

    async def model_metadata(self, name: str, version: str | None = None) -> ModelMetadata:
        registry = self.registry
        if registry.on_demand is not None and not registry.known(name):
            return await registry.on_demand.metadata(name, version)  # from the file, not loaded
        model = registry.describe(name, version)
        return ModelMetadata(
            name=model.name,
            versions=tuple(sorted((m.version for m in registry.versions(name)), key=int)),
            platform=model.backend.platform,
            inputs=model.backend.inputs,
            outputs=model.backend.outputs,
        )

    def cached_input_check(self, name: str, version: str | None = None) -> InputCheck | None:
        """`input_check`'s answer, never None: the models are in this process."""
        model = self.checked_model(name, version)
        return unchecked if model is None else model.input_check

    async def input_check(self, name: str, version: str | None = None) -> InputCheck:
        model = self.checked_model(name, version)
        return unchecked if model is None else model.input_check

    def checked_model(self, name: str, version: str | None = None) -> LoadedModel | None:
        """The version whose inputs a request is checked against before it is decoded: the
        loaded one, or in `on_demand` mode the one last loaded (the request's inference loads
        it again). None for a model never loaded in `on_demand` mode: only inference loads,
        bounded by the request's own timeout, which is not decoded yet; the engine checks the
        decoded request once the model is loaded."""
        registry = self.registry
        if registry.on_demand is not None and not registry.known(name):
            return None
        return registry.describe(name, version)

    async def model_ready(self, name: str, version: str | None = None) -> bool:
        return self._serves(name, version)

    def _serves(self, name: str, version: str | None) -> bool:
        if self._draining:
            return False
        on_demand = self.registry.on_demand
        if on_demand is not None and not self.registry.has(name):
            return on_demand.loadable(name, version)  # ready: a request would load it
        try:
            model = self.registry.resolve(name, version)
        except EngineError:
            return False
        # A pipeline serves only while every one of its steps does.
        pipeline = model.config.pipeline
        return pipeline is None or all(
            self._serves(step.model, step.version) for step in pipeline.steps
        )

    async def model_config(self, name: str, version: str | None = None) -> dict[str, Any]:
        """Triton's model config; parameters `sluice_config` (the config as JSON) and
        `sluice_config_source` (`load` when a load request's config replaced config.yaml, else
        `repository`)."""
        config = triton_config(self.registry.describe(name, version))
        source = "load" if self.registry.config_loaded(name) else "repository"
        config["parameters"]["sluice_config_source"] = {"string_value": source}
        return config

    async def statistics(
        self, name: str | None = None, version: str | None = None
    ) -> dict[str, Any]:
        registry = self.registry
        if name is None:
            models = registry.all(known=True)
        elif version is None:
            models = registry.versions(name)
        else:
            models = [registry.describe(name, version)]
        return {
            "model_stats": [
                # `resident_bytes`: a sluice field (gRPC's message has none; 0 once evicted).
                {**m.stats.triton(m.name, m.version), **registry.memory_of(m.name, m.version)}
                for m in models
            ]
        }

    async def usage(self, tenant: str) -> dict[str, Any]:
        """The tenant's quotas, buckets and slots now, for `GET /v2/tenants/self/usage`."""
        return await self.limiter.usage(tenant)

    def label_for(self, name: str) -> str:
        """`name` if such a model is loaded, else a fixed label (clients cannot grow metrics)."""
        return name if self._registry is not None and self._registry.known(name) else "_unknown"

    async def repository_index(self, ready_only: bool = False) -> list[dict[str, str]]:
        return self.registry.index(ready_only)

    async def load_model(
        self, name: str, parameters: Mapping[str, Any] | Collection[str] = ()
    ) -> None:
        """Load (or reload) a model by API: only in `explicit` and `poll` modes. Triton's
        `config` parameter (a JSON model config) replaces the folder's config.yaml until the next
        load without one; file overrides are refused: model files come from the repository."""
        await self.registry.load(name, check_load_parameters(parameters))

    async def unload_model(self, name: str, parameters: Collection[str] = ()) -> None:
        check_unload_parameters(parameters)
        await self.registry.unload(name)

    # -- internals -------------------------------------------------------------------------------

    def _snapshot(self) -> dict[str, Any]:
        registry = self._registry
        return {
            "models": registry.all() if registry else [],
            "index": registry.index() if registry else [],
            "in_flight": self._in_flight,
            "cache": self.cache.stats if self.cache is not None else None,
            "limiter": self.limiter.counters,
            "memory": registry.memory() if registry else None,
        }
