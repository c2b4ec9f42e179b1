"""What the data plane records of every request it lets in, tensor or generative: the request's
root span (continuing the caller's W3C trace context) when it arrives, and once, whatever became
of it, its metrics (`sluice_requests_total`, the latency histogram), its debug log line and the
end of its span.

    ledger = Ledger(engine)
    span = ledger.begin("POST /v2/models/{name}/infer", "http", "demo", headers)
    ...
    ledger.count(call, "1", 200, seconds, span)     # call: its protocol, model and access
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Protocol

from engine.facade import EngineFacade
from engine.tracing import RequestSpan

Metadata = Sequence[tuple[str, str | bytes]]
"""gRPC invocation metadata: (key, value) pairs, a key possibly more than once."""

Headers = Mapping[str, str] | Metadata
"""HTTP headers, or gRPC invocation metadata."""

CLIENT_GONE = 499
"""The status counted for a request whose caller went away (or was cancelled) before its answer:
nobody is left to answer, and it was withdrawn, not computed."""

LOGS = {"http": logging.getLogger("sluice.http"), "grpc": logging.getLogger("sluice.grpc")}
"""The request loggers, by protocol."""


class Entry(Protocol):
    """What a request's count and log line name (an InferCall is one, a GenerationCall too)."""

    @property
    def protocol(self) -> str:
        """ "http" or "grpc": the metrics label, span attribute and logger."""
        ...

    @property
    def model(self) -> str:
        """The model named on the wire (metrics label, span attribute, authorization)."""
        ...

    @property
    def access(self) -> str:
        """What the access log line names: the HTTP path, or `gRPC ModelInfer <model>`."""
        ...


class Ledger:
    """The spans, counts and request log lines of one engine's front-ends."""

    __slots__ = ("engine",)

    def __init__(self, engine: EngineFacade) -> None:
        self.engine = engine

    def begin(
        self, span_name: str, protocol: str, model: str, headers: Headers
    ) -> RequestSpan | None:
        """The request's root span (None when tracing is off), current in this context."""
        tracing = self.engine.tracing
        if tracing is None:
            return None
        carrier = (
            headers
            if isinstance(headers, Mapping)
            else {key: value for key, value in headers if isinstance(value, str)}
        )
        return tracing.begin(span_name, protocol, model, carrier)

    def count(
        self, entry: Entry, served: str, status: int, elapsed: float, span: RequestSpan | None
    ) -> None:
        """The request's metrics, debug log line and span end: called once per request."""
        engine = self.engine
        label = engine.label_for(entry.model)
        engine.metrics.request(label, served, entry.protocol, status, elapsed)
        log = LOGS[entry.protocol]
        if log.isEnabledFor(logging.DEBUG):
            duration_ms = round(elapsed * 1e3, 3)
            fields = {"model": entry.model, "status": status, "duration_ms": duration_ms}
            log.debug("%s -> %d in %.3f ms", entry.access, status, duration_ms, extra=fields)
        if span is not None and engine.tracing is not None:
            engine.tracing.end(span, status)
