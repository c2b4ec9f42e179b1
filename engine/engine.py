"""The engine facade: the only thing front-ends talk to.

infer: resolve model -> validate -> (admission) -> (result cache) -> batcher -> backend. A
request the data plane decoded comes resolved and validated: its front-end ran the model
version's input check on the shapes it declared (`InferRequest.checked`), and while that
version serves, the engine neither resolves nor validates the inputs again."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from batching.errors import BatchingError, DeadlinePassed, QueueFull
from engine.accepted import Accepted, Clock, first_axis, priority_level, request_clock
from engine.auth import ANONYMOUS_TENANT, Authenticator
from engine.cache import CachedResult, ResultCache, build_cache, cache_requested
from engine.cache.inference import CachedInference
from engine.errors import EngineError, from_batching
from engine.generation.service import GenerationService
from engine.limits import Limiter, build_limiter
from engine.limits.limiter import Admission
from engine.metrics import Metrics
from engine.model import LoadedModel, ModelCheck
from engine.on_demand import OnDemandLoader
from engine.queries import ModelQueries
from engine.regions import SystemRegions
from engine.registry import ModelRegistry
from engine.repository import Repository
from engine.settings import EngineSettings
from engine.tracing import build_tracing
from engine.types import InferRequest, InferResponse

log = logging.getLogger("sluice.engine")

NEVER_RAN = (QueueFull, DeadlinePassed)
"""What the batcher refuses before running a request: its admission charge is refunded."""


class Engine(ModelQueries):
    """Loads models from the repository and answers inference requests."""

    def __init__(self, settings: EngineSettings) -> None:
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
        self.regions = SystemRegions(settings.shared_memory)
        self.authenticator.on_reload.append(self.regions.keep_keys)
        self.limiter: Limiter = build_limiter(settings.rate_limit)
        self.generation = GenerationService(self)  # over the registry's generative models
        self._cached: CachedInference | None = None  # the result-cache path, from start()

    # -- lifecycle -------------------------------------------------------------------------------

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
        self.regions.close()
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
        # Draining is the data plane's to refuse, before it decodes the request: one it let in
        # is answered (Batcher.drain serves requests still arriving).
        clock = request_clock(request.arrived)
        model = self._checked_model(request)
        on_demand = self.registry.on_demand
        if on_demand is not None:
            return await self._infer_on_demand(request, clock, model, on_demand)
        if model is None:
            model = self.registry.resolve(request.model_name, request.model_version)
        return await self._serve(model, request, clock)

    def _checked_model(self, request: InferRequest) -> LoadedModel | None:
        """The version that the front-end's input check resolved and checked the request
        against, while it still serves: the request is not resolved again (after a reload or
        an unload meanwhile, it is)."""
        checked = request.checked
        check = None if checked is None else checked.check
        if type(check) is not ModelCheck:
            return None
        model = check.model
        if model is None or model.name != request.model_name or not self.registry.serves(model):
            return None
        return model

    async def _infer_on_demand(
        self,
        request: InferRequest,
        clock: Clock,
        model: LoadedModel | None,
        on_demand: OnDemandLoader,
    ) -> InferResponse:
        registry, name, version = self.registry, request.model_name, request.model_version
        if model is not None or registry.has(name):
            model = model or registry.resolve(name, version)
            with on_demand.held(model.name):  # never evicted while this request holds it
                return await self._serve(model, request, clock)
        # Not resident. The tenant is admitted first: a request its tenant may not send now
        # never loads a model (nor evicts one). A model loaded before checks the request now.
        last = None
        if registry.known(name):
            last = registry.describe(name, version)
        else:
            on_demand.exists(name)  # an unknown name is refused before any charge
        rows = first_axis(request) if last is None else last.rows(request)
        tenant = request.tenant or ANONYMOUS_TENANT
        wait_s = request.timeout_s or self.settings.model_memory.load_wait_s
        with await self.limiter.admit(tenant, name, rows) as admission:
            if last is not None and self._may_hit(last, request):
                # Its results cached: a hit answers without loading it; only a miss loads it
                # (once for the requests that miss together).
                with on_demand.held(name):
                    load = functools.partial(registry.acquire, name, version, wait_s)
                    return await self._serve(last, request, clock, admission, load, rows)
            try:
                model = await registry.acquire(name, version, wait_s)
            except EngineError:  # never ran: the charge goes back
                await admission.refund(admission.charged)
                raise
            with on_demand.held(model.name):
                return await self._serve(model, request, clock, admission)

    def _may_hit(self, model: LoadedModel, request: InferRequest) -> bool:
        """Whether the result cache may answer the request."""
        return (
            self._cached is not None
            and model.config.cache.enabled
            and cache_requested(request.parameters)
        )

    async def _serve(
        self,
        model: LoadedModel,
        request: InferRequest,
        clock: Clock,
        admitted: Admission | None = None,
        load: Callable[[], Awaitable[LoadedModel]] | None = None,
        rows: int | None = None,
    ) -> InferResponse:
        """Answer the request with `model`. With `admitted`, the tenant was admitted before the
        model was loaded (on_demand); with `load` too, `model` is an evicted version's last load
        that counted the request's `rows`, and `load` gives the version to run when the answer
        is not in the result cache."""
        try:
            accepted = self._accept(model, request, clock, load, rows)
        except EngineError:
            if admitted is not None:  # charged before its model could check it: refunded
                await admitted.refund(admitted.charged)
            raise
        if admitted is not None:
            return await self._charged(accepted, admitted)
        admit = self.limiter.admit(accepted.tenant, model.name, accepted.rows)
        if self.tracing is not None:
            admit = self.tracing.stage("admission", admit)
        with await admit as admission:  # released on the way out (a coroutine pair less)
            return await self._charged(accepted, admission)

    def _accept(
        self,
        model: LoadedModel,
        request: InferRequest,
        clock: Clock,
        load: Callable[[], Awaitable[LoadedModel]] | None,
        rows: int | None,
    ) -> Accepted:
        """Everything that can refuse the request, checked before admission charges for it."""
        tenant = request.tenant or ANONYMOUS_TENANT
        rows = model.rows(request) if rows is None else rows
        own = self.limiter.limits_for(tenant).priority
        priority = priority_level(model, request.priority, tenant, own, self.authenticator.open)
        use_cache = self._may_hit(model, request)
        return Accepted(model, request, tenant, rows, priority, clock, use_cache, load)

    async def _charged(self, accepted: Accepted, admission: Admission) -> InferResponse:
        """The answer; a request the queue refused unrun gets its admission's charge back."""
        try:
            return await self._admitted(accepted, admission)
        except EngineError as exc:
            if isinstance(exc.__cause__, NEVER_RAN):  # refused by the queue: nothing used
                await admission.refund(admission.charged)
            raise

    async def _admitted(self, accepted: Accepted, admission: Admission) -> InferResponse:
        """The answer from the result cache or the model, counted in the model's statistics."""
        model, request = accepted.model, accepted.request
        timeout_s = request.timeout_s or model.config.dynamic_batching.default_timeout_s
        deadline = accepted.clock.arrived + timeout_s if timeout_s else None
        parameters: dict[str, Any] = {}  # the answer's: a pipeline's, and whether it hit
        compute = functools.partial(self._compute, accepted, admission, parameters)
        try:
            if accepted.use_cache:
                assert self._cached is not None
                rows, priority = accepted.rows, accepted.priority
                result, hit = await self._cached.result(
                    model, request, rows, compute, deadline, priority, self.tracing
                )
                parameters["cache_hit"] = hit
            else:
                result = await compute(deadline, None)
        except EngineError:
            model.stats.request_done(time.monotonic() - accepted.clock.received, ok=False)
            raise
        model.stats.request_done(time.monotonic() - accepted.clock.received, ok=True)
        # Positional: keywords cost twice as much (the field order is InferResponse's).
        outputs, datatypes = dict(result.outputs), dict(result.datatypes)
        return InferResponse(model.name, model.version, outputs, datatypes, request.id, parameters)

    async def _compute(
        self,
        accepted: Accepted,
        admission: Admission,
        parameters: dict[str, Any],
        deadline: float | None,
        on_run: Callable[[], None] | None,
    ) -> CachedResult:
        """Run the request in its model's batcher (loading an evicted version first): the
        result cache's `Compute`, which gives the deadline it keeps in the queue and what to
        call when its batch starts; the answer's `parameters` are added to."""
        model, request = accepted.model, accepted.request
        try:
            runner = model if accepted.load is None else await accepted.load()
        except EngineError:  # never ran: the admission's charge goes back
            await admission.refund(admission.charged)
            raise
        # The admission's slots are held while the batcher holds the request: a caller who
        # leaves while it runs does not free a place for another run of the tenant's.
        submit = runner.batcher.submit(
            request.inputs,
            accepted.rows,
            accepted.priority,
            accepted.tenant,
            deadline,
            accepted.clock.arrived,
            on_run,
            admission.hold(),
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
        specs = model.backend.outputs
        names = request.outputs or [spec.name for spec in specs]
        types = {spec.name: spec.datatype for spec in specs if spec.name in names}
        return CachedResult({name: outputs[name] for name in names}, types)

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
