"""The result-cache path of an inference: a request answered from the result cache, or computed
once for every identical request in flight and stored.

Apart from the engine facade (`engine.engine`), which decides whether a request uses the cache
and hands this path the computation of its answer: the keying, the lookup, the coalescing of
identical requests and the deadline a caller of a shared computation keeps are all here, with
the state only they use (the coalescer and the computations already running).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from engine.auth import ANONYMOUS_TENANT
from engine.cache import (
    CachedResult,
    Coalescer,
    Expected,
    ResultCache,
    cache_key_async,
    copy_result,
)
from engine.errors import DeadlineExceeded
from engine.model import LoadedModel
from engine.settings import CacheSettings
from engine.tracing import Tracing
from engine.types import InferRequest

Compute = Callable[[float | None, Callable[[], None] | None], Awaitable[CachedResult]]
"""Computes a request's answer: with the deadline it keeps in the queue (None: none), and what to
call when its batch starts running."""


class CachedInference:
    """Answers requests through one result cache (`Engine.cache`)."""

    def __init__(self, cache: ResultCache, settings: CacheSettings) -> None:
        self.cache = cache
        self.settings = settings
        self._coalescer: Coalescer[_Computed] = Coalescer(clone=_copy_computed)
        self._running_flights: dict[bytes, _Run] = {}  # started once its batch runs

    async def result(
        self,
        model: LoadedModel,
        request: InferRequest,
        rows: int,
        compute: Compute,
        deadline: float | None,
        priority: int,
        tracing: Tracing | None,
    ) -> tuple[CachedResult, bool]:
        """The cached result, or one computed once for every identical request in flight. The
        shared computation has no deadline of its own: each caller's timeout counts while it is
        queued (it is withdrawn when the last caller leaves); once it runs, a caller waits for
        it, as for a request without the cache."""
        key, hit, missed = await self._lookup(model, request, rows, tracing)
        if hit is not None:
            return hit, True

        # Callers join a computation queued at their own priority level: one queued at a lower
        # level would make a higher-priority caller wait behind that level's backlog.
        flight = key + b"|%d" % priority
        led = False

        async def compute_and_store() -> _Computed:
            nonlocal led
            led = True  # only the caller that starts the flight runs this
            # Registered by the computation itself: one cancelled before it ran leaves nothing.
            run = self._running_flights[flight] = _Run()
            try:
                result = await compute(None, run.start)
            finally:
                if self._running_flights.get(flight) is run:
                    del self._running_flights[flight]
            stored = time.monotonic()
            await self.cache.put(key, result, model.config.cache.ttl_s)
            model.stats.cache_miss.add(time.monotonic() - stored, count=0)
            return result, run.started_at if run.started_at is not None else stored

        result, started_at = await self._shared(model, flight, compute_and_store, deadline)
        if not led:
            # Queued as long as the computation it joined still waited for its batch: counted
            # in `queue` like every other success (Triton's success == queue; the batcher
            # counted the computation's own request when it ran).
            model.stats.request_dequeued(max(0.0, started_at - missed))
        return result, False

    async def _lookup(
        self, model: LoadedModel, request: InferRequest, rows: int, tracing: Tracing | None
    ) -> tuple[bytes, CachedResult | None, float]:
        """The request's key, its cached result (None: a miss) and when the lookup ended; the
        lookup counted in the model's statistics (a hit served, or a miss)."""
        parameters = request.parameters
        if not self.settings.shared_across_tenants:  # one tenant's entries are its own
            parameters = {**parameters, "sluice.tenant": request.tenant or ANONYMOUS_TENANT}
        key = await cache_key_async(
            self.settings.namespace,
            model.name,
            model.version,
            model.content_fingerprint,
            request.inputs,
            request.datatypes,
            request.outputs,
            parameters,
        )
        # Redis is untrusted: an entry is served only if it is what this model computes here.
        expected = Expected.for_outputs(
            model.backend.outputs, request.outputs or None, rows if model.max_batch_size else None
        )
        looked_up = time.monotonic()
        lookup = self.cache.get(key, expected)
        hit = await (lookup if tracing is None else tracing.stage("cache", lookup))
        missed = time.monotonic()
        if hit is not None:
            model.stats.cache_hit_served(missed - looked_up)
        else:
            # Every lookup that missed is a miss, a caller that joins a computation in flight
            # too; the one that computes adds the insert's time, as Triton counts a miss.
            model.stats.cache_miss.add(missed - looked_up)
        return key, hit, missed

    async def _shared(
        self,
        model: LoadedModel,
        flight: bytes,
        compute_and_store: Callable[[], Awaitable[_Computed]],
        deadline: float | None,
    ) -> _Computed:
        """The flight's result, within the caller's deadline while the flight is queued."""
        if deadline is None:
            return await self._coalescer.run(flight, compute_and_store)
        joined = asyncio.ensure_future(self._coalescer.run(flight, compute_and_store))
        try:
            try:
                async with asyncio.timeout(deadline - time.monotonic()):
                    return await asyncio.shield(joined)
            except TimeoutError:
                pass
            # Out of the handler, as in Batcher.submit: a CancelledError raised in it would carry
            # the TimeoutError, and through its traceback this task, in a cycle with the inputs.
            run = self._running_flights.get(flight)
            if run is not None and run.started_at is not None:
                return await joined
            raise DeadlineExceeded(
                f"request to {model.label} waited past its timeout in the queue; it was not run"
            )
        except BaseException:
            joined.cancel()  # this caller leaves the flight (withdrawn when the last one does)
            raise


_Computed = tuple[CachedResult, float]
"""A flight's result and when its batch started running (time.monotonic())."""


def _copy_computed(computed: _Computed) -> _Computed:
    return copy_result(computed[0]), computed[1]


class _Run:
    """When a flight's batch started running (None: still queued)."""

    __slots__ = ("started_at",)

    def __init__(self) -> None:
        self.started_at: float | None = None

    def start(self) -> None:
        self.started_at = time.monotonic()
