"""engine/tracing.py with the real OpenTelemetry SDK and its in-memory exporter: stage spans per
request over HTTP and gRPC, carrying the request id; sampling; and no OpenTelemetry tracing code
imported at all while tracing is off."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from engine.demo import DEMO_CONFIG, write_demo_repository
from engine.engine import Engine
from engine.errors import BackendError
from engine.settings import TracingSettings
from engine.tracing import REQUEST_ID, Tracing, build_tracing, request_id
from engine.types import InferRequest
from server.grpc.infer import INFER_SPAN as GRPC_SPAN
from server.grpc.proto import grpc_service_pb2 as pb
from server.grpc.proto import grpc_service_pb2_grpc as pb_grpc
from server.grpc.service import build_grpc_server
from server.http.app import create_app
from server.http.infer_route import INFER_SPAN as HTTP_SPAN
from server.settings import Settings

STAGES = ["admission", "cache", "queue", "execute", "encode"]
ENDPOINT = "http://127.0.0.1:4318/v1/traces"
PARENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


def tracing(exporter: InMemorySpanExporter, ratio: float = 1.0) -> Tracing:
    return Tracing(TracingSettings(otlp_endpoint=ENDPOINT, sample_ratio=ratio), exporter)


@pytest.fixture
async def traced(tmp_path: Path) -> AsyncIterator[tuple[Engine, InMemorySpanExporter]]:
    """An engine serving the demo model with its result cache on, traced into memory."""
    root = write_demo_repository(tmp_path)
    (root / "demo" / "config.yaml").write_text(DEMO_CONFIG + "cache:\n  enabled: true\n")
    engine = Engine(Settings(model_repository=root))
    exporter = InMemorySpanExporter()
    engine.tracing = tracing(exporter)
    await engine.start()
    yield engine, exporter
    await engine.close()


def trace_of(spans: tuple[ReadableSpan, ...], root: ReadableSpan) -> dict[str, ReadableSpan]:
    """The spans of `root`'s trace by name, each checked to be a child of `root`."""
    assert root.context is not None
    trace_id = root.context.trace_id
    members = [span for span in spans if span.context and span.context.trace_id == trace_id]
    found = {span.name: span for span in members}
    assert len(found) == len(members), [span.name for span in members]
    for name, span in found.items():
        if span is not root:
            assert span.parent is not None
            assert span.parent.span_id == root.context.span_id, name
    return found


def roots(spans: tuple[ReadableSpan, ...], name: str) -> list[ReadableSpan]:
    return [span for span in spans if span.name == name]


def check_stages(found: dict[str, ReadableSpan], root: str, rid: str) -> None:
    assert sorted(found) == sorted([root, *STAGES])
    for name, span in found.items():
        assert span.attributes is not None
        assert span.attributes[REQUEST_ID] == rid, name
    queue, execute = found["queue"], found["execute"]
    times = [queue.start_time, queue.end_time, execute.start_time, execute.end_time]
    times.append(found["encode"].start_time)
    assert None not in times
    assert times == sorted(times)  # type: ignore[type-var]
    # Monotonic stage times were converted to the epoch clock: near now, not near boot.
    assert abs((execute.start_time or 0) / 1e9 - time.time()) < 60


def infer_body(seed: int) -> dict[str, Any]:
    data = np.random.default_rng(seed).standard_normal(16).astype(np.float32).tolist()
    return {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 16], "data": data}]}


async def test_http_request_spans_every_stage(traced: tuple[Engine, InMemorySpanExporter]) -> None:
    engine, exporter = traced
    transport = httpx.ASGITransport(app=create_app(engine.settings, engine))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        response = await client.post(
            "/v2/models/demo/infer", json=infer_body(1), headers={"x-request-id": "trace-http-1"}
        )
        assert response.status_code == 200, response.text
        parent = {"traceparent": f"00-{PARENT_TRACE}-00f067aa0ba902b7-01"}
        again = await client.post("/v2/models/demo/infer", json=infer_body(1), headers=parent)
        assert again.json()["parameters"]["cache_hit"] is True
    spans = exporter.get_finished_spans()
    requests = roots(spans, HTTP_SPAN)
    assert len(requests) == 2
    first = trace_of(spans, requests[0])
    check_stages(first, HTTP_SPAN, "trace-http-1")
    assert first[HTTP_SPAN].attributes == {
        "sluice.protocol": "http",
        "sluice.model": "demo",
        REQUEST_ID: "trace-http-1",
        "sluice.status": 200,
    }
    # The second request joined the caller's trace and was a cache hit: no queue, no execute.
    assert requests[1].context is not None
    assert f"{requests[1].context.trace_id:032x}" == PARENT_TRACE
    assert sorted(trace_of(spans, requests[1])) == sorted(
        [HTTP_SPAN, "admission", "cache", "encode"]
    )


async def test_grpc_request_spans_every_stage(traced: tuple[Engine, InMemorySpanExporter]) -> None:
    engine, exporter = traced
    server, port = build_grpc_server(Settings(grpc_port=0), engine)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
            tensor = pb.ModelInferRequest.InferInputTensor(name="x", datatype="FP32", shape=[1, 16])
            raw = np.full((1, 16), 0.5, np.float32).tobytes()
            request = pb.ModelInferRequest(
                model_name="demo", inputs=[tensor], raw_input_contents=[raw]
            )
            call = stub.ModelInfer(request, metadata=(("x-request-id", "trace-grpc-1"),))
            await call
            assert ("x-request-id", "trace-grpc-1") in tuple(await call.trailing_metadata())
    finally:
        await server.stop(None)
    spans = exporter.get_finished_spans()
    (root,) = roots(spans, GRPC_SPAN)
    found = trace_of(spans, root)
    check_stages(found, GRPC_SPAN, "trace-grpc-1")
    attributes = found[GRPC_SPAN].attributes
    assert attributes is not None
    assert (attributes["sluice.protocol"], attributes["sluice.status"]) == ("grpc", 200)


async def test_failed_stage_marks_its_span() -> None:
    exporter = InMemorySpanExporter()
    spans = tracing(exporter)

    async def refuse() -> None:
        raise RuntimeError("no")

    handle = spans.begin("root", "http", "demo")
    with pytest.raises(RuntimeError):
        await spans.stage("admission", refuse())
    spans.end(handle, status=503)
    stage, root = exporter.get_finished_spans()
    assert (stage.name, stage.status.status_code.name) == ("admission", "ERROR")
    assert stage.events[0].name == "exception"
    assert (root.name, root.status.status_code.name) == ("root", "ERROR")


async def test_batched_without_a_run_inside_is_all_queue() -> None:
    exporter = InMemorySpanExporter()
    spans = tracing(exporter)

    async def answer() -> int:
        return 7

    token = request_id.set("rid-9")
    try:
        assert await spans.batched(answer(), lambda: (0.0, 0.0)) == 7
        now = time.monotonic()
        assert await spans.batched(answer(), lambda: (now - 10, now - 9)) == 7
    finally:
        request_id.reset(token)
    names = [span.name for span in exporter.get_finished_spans()]
    assert names == ["queue", "queue"]
    assert all(s.attributes == {REQUEST_ID: "rid-9"} for s in exporter.get_finished_spans())


def test_sample_ratio_zero_records_nothing_but_follows_a_sampled_parent() -> None:
    exporter = InMemorySpanExporter()
    spans = tracing(exporter, ratio=0.0)
    spans.end(spans.begin("unsampled", "http", "demo"), 200)
    carrier = {"traceparent": f"00-{PARENT_TRACE}-00f067aa0ba902b7-01"}
    spans.end(spans.begin("sampled-by-caller", "http", "demo", carrier), 200)
    assert [span.name for span in exporter.get_finished_spans()] == ["sampled-by-caller"]


def test_off_without_an_endpoint() -> None:
    assert build_tracing(TracingSettings()) is None
    assert Engine(Settings()).tracing is None


OFF_SCRIPT = """
import asyncio, sys
import httpx
from engine.engine import Engine
from engine.errors import BackendError
from server.settings import Settings
from server.http.app import create_app

async def main():
    engine = Engine(Settings(**SETTINGS))
    await engine.start()
    transport = httpx.ASGITransport(app=create_app(engine.settings, engine))
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 16], "data": [0.0] * 16}]}
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        assert (await client.post("/v2/models/demo/infer", json=body)).status_code == 200
    await engine.close()

asyncio.run(main())
print(sorted(m for m in sys.modules if m.startswith(("opentelemetry.sdk.trace",
                                                     "opentelemetry.exporter"))))
"""


def imported_after_a_request(settings: dict[str, Any]) -> str:
    script = textwrap.dedent(OFF_SCRIPT).replace("SETTINGS", repr(settings))
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).parents[3],
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


def test_tracing_off_imports_no_tracing_code() -> None:
    """FastAPI imports the OpenTelemetry API (and redis the SDK's metrics) by themselves; with
    tracing off sluice adds neither the SDK's tracing nor an exporter. With it on, both load."""
    assert imported_after_a_request({}) == "[]"
    # Nothing listens there: a short export bound ends the close's flush at its first refusal
    # (the default, 5 s, retried it for 3 s).
    traced = {"otlp_endpoint": "http://127.0.0.1:9/v1/traces", "export_timeout_s": 0.5}
    on = imported_after_a_request({"tracing": traced})
    assert "'opentelemetry.sdk.trace'" in on
    assert "'opentelemetry.exporter.otlp.proto.http.trace_exporter'" in on


def test_engine_tracing_module_imports_no_opentelemetry() -> None:
    script = "import sys, engine.tracing; print([m for m in sys.modules if 'opentelemetry' in m])"
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).parents[3],
        check=True,
    )
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize(
    "garbage",
    [None, 42, "", "not a traceparent", f"00-{'0' * 32}-00f067aa0ba902b7-01",
     f"00-{PARENT_TRACE}-00f067aa0ba902b7-01" + "x" * 100],
)  # fmt: skip
async def test_adopting_garbage_leaves_the_context(garbage: object) -> None:
    """What the engine process adopts comes over a socket: anything but a valid traceparent
    (a zero trace id is invalid) starts no trace of its own and breaks nothing."""
    exporter = InMemorySpanExporter()
    traced = tracing(exporter)
    traced.adopt(garbage)
    traced.record("execute", time.monotonic(), time.monotonic())
    (span,) = exporter.get_finished_spans()
    assert span.parent is None


async def test_a_span_continues_in_another_tracing() -> None:
    """A worker's request span, sent as `traceparent()`, is the parent of the spans the engine
    process's own Tracing records after `adopt` (another provider, as in another process)."""
    worker_spans, engine_spans = InMemorySpanExporter(), InMemorySpanExporter()
    worker, engine = tracing(worker_spans), tracing(engine_spans)
    root = worker.begin("infer", "http", "demo")
    sent = worker.traceparent()
    worker.end(root, 200)
    assert sent is not None
    assert len(sent) == 55

    async def engine_task() -> None:
        engine.adopt(sent)
        engine.record("execute", time.monotonic(), time.monotonic())

    await asyncio.create_task(engine_task())
    (request,) = worker_spans.get_finished_spans()
    (stage,) = engine_spans.get_finished_spans()
    assert request.context is not None
    assert stage.parent is not None
    assert stage.parent.span_id == request.context.span_id
    assert stage.context is not None
    assert stage.context.trace_id == request.context.trace_id
    assert engine.traceparent() is None  # the task's context, not the caller's


async def test_a_failed_run_has_its_execute_span_with_the_exception(
    traced: tuple[Engine, InMemorySpanExporter], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failed batch left no execute span (its run time counted as queue time) and no span
    recorded the exception."""
    engine, exporter = traced
    backend = engine.registry.resolve("demo", None).backend

    def broken(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        raise RuntimeError("the kernel broke")

    monkeypatch.setattr(backend, "run", broken)
    x = np.ones((1, 16), np.float32)
    request = InferRequest("demo", {"x": x}, {"x": "FP32"}, parameters={"cache": False})
    span = engine.tracing.begin("ModelInfer", "grpc", "demo", carrier={})  # type: ignore[union-attr]
    with pytest.raises(BackendError, match="the kernel broke"):
        await engine.infer(request)
    engine.tracing.end(span, status=500)  # type: ignore[union-attr]
    spans = exporter.get_finished_spans()
    [execute] = [s for s in spans if s.name == "execute"]
    assert execute.status.status_code.name == "ERROR"
    assert [e.name for e in execute.events] == ["exception"]
    assert "the kernel broke" in str(execute.events[0].attributes)
