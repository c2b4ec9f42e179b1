"""The plane's record of a request (server/ledger.py): its count, its debug line, and its span
continuing the caller's trace context, ended with its status."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from engine.settings import TracingSettings
from engine.tracing import Tracing
from server.ledger import Ledger
from tests.unit.server.fake_engine import FakeEngine
from tests.unit.server.test_dataplane import counted

PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@dataclass
class Entry:
    protocol: str = "grpc"
    model: str = "double"
    access: str = "gRPC ModelInfer double"


def test_a_request_is_counted_and_logged_under_its_model_label(
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine = FakeEngine()
    ledger = Ledger(engine)  # type: ignore[arg-type]
    with caplog.at_level(logging.DEBUG, "sluice.grpc"):
        ledger.count(Entry(), "1", 200, 0.0125, None)
        ledger.count(Entry(model="made-up", access="gRPC ModelInfer made-up"), "", 404, 0.001, None)
    assert counted(engine) == {
        ("double", "1", "grpc", "200"): 1.0,
        ("_unknown", "", "grpc", "404"): 1.0,  # a name clients choose never becomes a label
    }
    assert [r.getMessage() for r in caplog.records] == [
        "gRPC ModelInfer double -> 200 in 12.500 ms",
        "gRPC ModelInfer made-up -> 404 in 1.000 ms",
    ]


def test_a_span_continues_the_callers_trace_and_ends_with_the_status() -> None:
    engine = FakeEngine()
    exporter = InMemorySpanExporter()
    engine.tracing = Tracing(TracingSettings(), exporter)  # type: ignore[assignment]
    ledger = Ledger(engine)  # type: ignore[arg-type]
    span = ledger.begin("test", "grpc", "double", [("traceparent", PARENT), ("bin", b"\x00")])
    assert span is not None
    engine.tracing.detach(span)  # a stream's span: answered by another task
    ledger.count(Entry(), "1", 503, 0.01, span)
    [finished] = exporter.get_finished_spans()
    assert finished.context.trace_id == int(PARENT.split("-")[1], 16)
    assert finished.attributes["sluice.status"] == 503
    assert not finished.status.is_ok
