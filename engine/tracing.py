"""Optional OpenTelemetry tracing: a span per request with a child span per stage (admission,
cache, queue, execute, encode), exported over OTLP/HTTP when `tracing.otlp_endpoint` is set.

When it is not set, `build_tracing` returns None and nothing imports OpenTelemetry; each stage
then costs one `tracing is None` check. Spans go through this engine's own TracerProvider, never
the process-global one, so libraries that trace through the global API (FastAPI does) stay
silent. Stage times are taken on time.monotonic() and converted once to the epoch clock.

    tracing = build_tracing(settings.tracing)          # None: off
    span = tracing.begin("ModelInfer", "grpc", "demo", carrier=metadata)
    try:
        admission = await tracing.stage("admission", limiter.admit(tenant, model, rows))
        ...
        tracing.record("encode", encode_started, time.monotonic())
    finally:
        tracing.end(span, status=200)
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, TypeVar

from engine.settings import SettingsError, TracingSettings

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span

T = TypeVar("T")

request_id: ContextVar[str | None] = ContextVar("sluice_request_id", default=None)
"""The id of the request being handled (front-ends set it; logs and spans read it)."""

REQUEST_ID = "sluice.request_id"
"""Span attribute carrying the request id."""

MAX_TRACEPARENT = 55
"""Length of a version-00 W3C traceparent ("00-<32 hex>-<16 hex>-<2 hex>")."""


class RequestSpan:
    """A request's root span, current in the request's context until `Tracing.end` (or
    `Tracing.detach`, for a request answered by another task: a stream)."""

    __slots__ = ("span", "token")

    def __init__(self, span: Span, token: object) -> None:
        self.span = span
        self.token = token


class Tracing:
    """Spans of one engine. `exporter` replaces OTLP (tests pass the SDK's in-memory one)."""

    def __init__(self, settings: TracingSettings, exporter: SpanExporter | None = None) -> None:
        from opentelemetry import context, trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        sampler = ParentBased(TraceIdRatioBased(settings.sample_ratio))
        resource = Resource.create({"service.name": settings.service_name})
        self._provider = TracerProvider(sampler=sampler, resource=resource)
        if exporter is None:
            # Batched: the exporter's network calls run in the processor's thread, never here.
            self._provider.add_span_processor(BatchSpanProcessor(_otlp_exporter(settings)))
        else:
            self._provider.add_span_processor(SimpleSpanProcessor(exporter))
        self._tracer = self._provider.get_tracer("sluice")
        self._propagator = TraceContextTextMapPropagator()
        self._context = context
        self._trace = trace
        self._epoch_offset_ns = time.time_ns() - time.monotonic_ns()

    def begin(
        self, name: str, protocol: str, model: str, carrier: Mapping[str, str] | None = None
    ) -> RequestSpan:
        """Open the request's root span and make it current; `carrier` holds the caller's
        headers or metadata, whose W3C `traceparent` (if any) becomes the parent."""
        parent = self._propagator.extract(carrier) if carrier else None
        attributes = {"sluice.protocol": protocol, "sluice.model": model}
        rid = request_id.get()
        if rid is not None:
            attributes[REQUEST_ID] = rid
        span = self._tracer.start_span(
            name, context=parent, kind=self._trace.SpanKind.SERVER, attributes=attributes
        )
        current = self._trace.set_span_in_context(span, parent)
        return RequestSpan(span, self._context.attach(current))

    def end(self, request: RequestSpan, status: int) -> None:
        """Close the root span with the request's HTTP-equivalent status (>= 500 is an error)."""
        request.span.set_attribute("sluice.status", status)
        if status >= 500:
            request.span.set_status(self._trace.StatusCode.ERROR)
        request.span.end()
        self.detach(request)

    def detach(self, request: RequestSpan) -> None:
        """Make the span no longer current here (in the context that began it), leaving it
        open: its request is answered by another task (a stream), which ends it."""
        if request.token is not None:
            self._context.detach(request.token)  # type: ignore[arg-type]
            request.token = None

    def traceparent(self) -> str | None:
        """The current span as a W3C `traceparent`, for another process to continue its trace
        (a worker sends it with each request to the engine process)."""
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier)
        return carrier.get("traceparent")

    def adopt(self, traceparent: object) -> None:
        """Make the span named by `traceparent` (from `traceparent()`, untrusted) the current
        parent for the rest of the calling task, whose own context it is: the engine process's
        stage spans then join the worker's request trace. Anything that is not a valid W3C
        traceparent string leaves the context as it is."""
        if isinstance(traceparent, str) and len(traceparent) <= MAX_TRACEPARENT:
            parent = self._propagator.extract({"traceparent": traceparent})
            if self._trace.get_current_span(parent).get_span_context().is_valid:
                self._context.attach(parent)

    async def stage(self, name: str, work: Awaitable[T]) -> T:
        """Await `work` inside a child span of the current one (an exception marks it failed)."""
        with self._tracer.start_as_current_span(name, attributes=self._attributes()):
            return await work

    def record(
        self, name: str, started: float, ended: float, error: BaseException | None = None
    ) -> None:
        """A finished stage measured on time.monotonic(), as a child of the current span; with
        `error`, failed and recording it."""
        span = self._tracer.start_span(
            name, start_time=self._epoch_ns(started), attributes=self._attributes()
        )
        if error is not None:
            span.record_exception(error)
            span.set_status(self._trace.Status(self._trace.StatusCode.ERROR, str(error)))
        span.end(end_time=self._epoch_ns(ended))

    async def batched(self, work: Awaitable[T], last_run: Callable[[], tuple[float, float]]) -> T:
        """Await a batcher submission and record its `queue` and `execute` spans.

        `last_run` gives the monotonic start and end of the model's latest batch run. A request
        resumes right after its batch settles it (asyncio runs callbacks in order), so when that
        run lies inside this submission it is the one that computed this request; otherwise
        (rejected, expired, cancelled) the whole submission is queue time."""
        submitted = time.monotonic()
        failure: BaseException | None = None
        try:
            return await work
        except BaseException as exc:
            failure = exc
            raise
        finally:
            returned = time.monotonic()
            started, ended = last_run()
            if submitted <= started <= ended <= returned:
                self.record("queue", submitted, started)
                # A failed batch's error carries what the backend raised.
                cause = getattr(failure, "cause", failure)
                self.record("execute", started, ended, cause)
            else:
                self.record("queue", submitted, returned)
            del failure  # the frame keeps no error (and its traceback's frames) alive

    def close(self) -> None:
        """Export what is buffered (bounded by the export timeout) and stop."""
        self._provider.shutdown()

    def _attributes(self) -> dict[str, Any]:
        rid = request_id.get()
        return {} if rid is None else {REQUEST_ID: rid}

    def _epoch_ns(self, monotonic_s: float) -> int:
        return int(monotonic_s * 1e9) + self._epoch_offset_ns


def _otlp_exporter(settings: TracingSettings) -> SpanExporter:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=settings.otlp_endpoint, timeout=settings.export_timeout_s)


def build_tracing(settings: TracingSettings) -> Tracing | None:
    """The engine's tracing, or None when no OTLP endpoint is configured (tracing off).
    SettingsError when one is configured but the `tracing` extra is not installed."""
    if settings.otlp_endpoint is None:
        return None
    try:
        return Tracing(settings)
    except ImportError as exc:
        raise SettingsError(
            f"tracing.otlp_endpoint is set ({settings.otlp_endpoint}) but OpenTelemetry is not "
            f"installed ({exc}); install sluice's `tracing` extra: pip install 'sluice[tracing]'"
        ) from exc
