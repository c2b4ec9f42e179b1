"""Observability end to end against real `sluice serve` processes: exact request and rejection
counts after known HTTP and gRPC traffic (successes, 400, 401, 404, 429, 500), agreement with the
Triton statistics endpoint, the separate metrics port, histogram buckets, the start line, request
ids in every access and error line, and OTLP trace export to a collector with text logs."""

from __future__ import annotations

import json
import math
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from engine.demo import DEMO_CONFIG, mlp_model
from server.grpc.infer import INFER_SPAN as GRPC_SPAN
from server.grpc.proto import grpc_service_pb2 as pb
from server.grpc.proto import grpc_service_pb2_grpc as pb_grpc
from server.http.infer_route import INFER_SPAN as HTTP_SPAN
from tests.integration.helpers_e2e import Key, infer_body, metrics, write_settings
from tests.models import write_model
from tests.redis_process import free_port
from tests.servers import ServerProcess

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
KEYS = {name: Key.create(name) for name in ("free", "tiny", "gtiny")}
SECRET = "hunter2-not-for-logs"
BROKEN_CONFIG = "max_batch_size: 0\nwarmup:\n  enabled: false\n"


def broken_model() -> onnx.ModelProto:
    """x FP32 [-1, 16] reshaped to [3, -1]: fails at run time for one row (16 elements)."""
    shape = helper.make_tensor("shape", TensorProto.INT64, [2], [3, -1])
    graph = helper.make_graph(
        [helper.make_node("Reshape", ["x", "shape"], ["y"])],
        "broken",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["a", "b"])],
        [shape],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def grpc_request(rows: int = 1, columns: int = 16, seed: int = 0) -> Any:
    tensor = pb.ModelInferRequest.InferInputTensor(name="x", datatype="FP32", shape=[rows, 16])
    raw = np.random.default_rng(seed).standard_normal((rows, columns)).astype(np.float32)
    return pb.ModelInferRequest(
        model_name="demo", inputs=[tensor], raw_input_contents=[raw.tobytes()]
    )


def grpc_infer(stub: Any, request: Any, metadata: tuple[tuple[str, str], ...]) -> tuple[str, str]:
    """(status code name, returned x-request-id) of one ModelInfer call."""
    try:
        _, call = stub.ModelInfer.with_call(request, metadata=metadata, timeout=10)
    except grpc.RpcError as exc:
        code, trailing = exc.code().name, exc.trailing_metadata()
    else:
        code, trailing = "OK", call.trailing_metadata()
    return code, dict(trailing or ())["x-request-id"]


@dataclass
class Observed:
    """The server after the fixture's traffic, and what the traffic got back."""

    server: ServerProcess
    metrics_port: int
    log: Path
    statuses: Counter[tuple[str, int | str]] = field(default_factory=Counter)
    returned_ids: dict[str, str] = field(default_factory=dict)  # sent id (or label) -> returned

    def lines(self) -> list[dict[str, Any]]:
        """Every log line, parsed: each must be JSON, except what ONNX Runtime's C++ logger
        prints by itself at error severity (the same error is also logged as JSON)."""
        text = self.log.read_text().replace("\x1b[m", "").splitlines()  # ORT's colour reset
        return [json.loads(line) for line in text if line.strip() and ":onnxruntime:" not in line]


def send_traffic(observed: Observed) -> None:
    url, counts, ids = observed.server.url, observed.statuses, observed.returned_ids
    infer = f"{url}/v2/models/demo/infer"
    with httpx.Client(timeout=10, headers=KEYS["free"].bearer()) as client:

        def post(target: str, body: dict[str, Any], rid: str, **headers: str) -> None:
            response = client.post(target, json=body, headers={"x-request-id": rid, **headers})
            counts[("http", response.status_code)] += 1
            ids[rid] = response.headers["x-request-id"]

        for index in range(5):
            post(infer, infer_body(index), f"obs-http-{index}")
        bad = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 15], "data": [0.0] * 15}]}
        for index in range(2):
            post(infer, bad, f"obs-400-{index}")
        post(f"{url}/v2/models/nope/infer", infer_body(0), "obs-404")
        post(f"{url}/v2/models/broken/infer", infer_body(0), "obs-500")
        for index in range(3):
            post(infer, infer_body(10 + index), f"obs-tiny-{index}", **KEYS["tiny"].bearer())
    anonymous = httpx.post(infer, json=infer_body(0), headers={"x-request-id": "obs-401"})
    counts[("http", anonymous.status_code)] += 1
    with grpc.insecure_channel(observed.server.grpc_url) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
        free = (("authorization", f"Bearer {KEYS['free'].key}"),)
        for index in range(3):
            sent = f"obs-grpc-{index}"
            code, ids[sent] = grpc_infer(
                stub, grpc_request(seed=index), (*free, ("x-request-id", sent))
            )
            counts[("grpc", code)] += 1
        code, ids["obs-grpc-400"] = grpc_infer(
            stub, grpc_request(columns=15), (*free, ("x-request-id", "obs-grpc-400"))
        )
        counts[("grpc", code)] += 1
        code, ids["grpc-generated"] = grpc_infer(stub, grpc_request(seed=7), free)
        counts[("grpc", code)] += 1
        tiny = (("authorization", f"Bearer {KEYS['gtiny'].key}"),)
        for index in range(3):
            sent = f"obs-gtiny-{index}"
            code, ids[sent] = grpc_infer(
                stub, grpc_request(seed=20 + index), (*tiny, ("x-request-id", sent))
            )
            counts[("grpc", code)] += 1


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Observed]:
    folder = tmp_path_factory.mktemp("observability")
    root = folder / "models"
    write_model(root, "demo", mlp_model(), DEMO_CONFIG)
    write_model(root, "broken", broken_model(), BROKEN_CONFIG)
    metrics_port = free_port()
    config = write_settings(
        folder / "server.yaml",
        {
            "auth": {"keys": [key.entry() for key in KEYS.values()]},
            "rate_limit": {
                "redis_url": f"redis://:{SECRET}@127.0.0.1:1/0",  # unused (memory), but logged
                "tenants": {
                    "tiny": {"rate_per_s": 0.001, "burst": 2},
                    "gtiny": {"rate_per_s": 0.001, "burst": 2},
                },
            },
            "metrics": {"port": metrics_port},
        },
    )
    log = folder / "server.log"
    server = ServerProcess(
        "--config", str(config), "--model-repository", str(root), "--log-level", "debug",
        log_path=log,
    )  # fmt: skip
    server.start()
    try:
        found = Observed(server, metrics_port, log)
        send_traffic(found)
        yield found
    finally:
        server.stop()


def test_traffic_got_the_expected_answers(observed: Observed) -> None:
    assert observed.statuses == {
        ("http", 200): 7, ("http", 400): 2, ("http", 404): 1, ("http", 500): 1,
        ("http", 401): 1, ("http", 429): 1,
        ("grpc", "OK"): 6, ("grpc", "INVALID_ARGUMENT"): 1, ("grpc", "RESOURCE_EXHAUSTED"): 1,
    }  # fmt: skip


def by_name(samples: Samples, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {labels: value for (sample, labels), value in samples.items() if sample == name}


def key(**labels: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(labels.items()))


def test_request_counts_are_exact(observed: Observed) -> None:
    found = metrics(observed.server.url)

    def req(model: str, version: str, protocol: str, status: int) -> tuple[tuple[str, str], ...]:
        return key(model=model, version=version, protocol=protocol, status=str(status))

    assert by_name(found, "sluice_requests_total") == {
        req("demo", "1", "http", 200): 7,
        req("demo", "", "http", 400): 2,
        req("_unknown", "", "http", 404): 1,
        req("broken", "", "http", 500): 1,
        req("demo", "", "http", 401): 1,
        req("demo", "", "http", 429): 1,
        req("demo", "1", "grpc", 200): 6,
        req("demo", "", "grpc", 400): 1,
        req("demo", "", "grpc", 429): 1,
    }
    assert by_name(found, "sluice_request_duration_seconds_count") == {
        key(model="demo", protocol="http"): 11,
        key(model="demo", protocol="grpc"): 8,
        key(model="_unknown", protocol="http"): 1,
        key(model="broken", protocol="http"): 1,
    }
    assert by_name(found, "sluice_encode_duration_seconds_count") == {
        key(protocol="http"): 7,
        key(protocol="grpc"): 6,
    }


def test_rejections_by_tenant(observed: Observed) -> None:
    found = metrics(observed.server.url)
    assert by_name(found, "sluice_admission_rejections_total") == {
        key(tenant="tiny", reason="rate"): 1,
        key(tenant="gtiny", reason="rate"): 1,
    }
    assert found[("sluice_admission_backend_failures_total", ())] == 0


def test_counts_agree_with_triton_statistics(observed: Observed) -> None:
    url = observed.server.url
    response = httpx.get(f"{url}/v2/models/demo/stats", headers=KEYS["free"].bearer())
    assert response.status_code == 200, response.text
    stats = response.json()["model_stats"][0]
    found = metrics(url)
    model = key(model="demo", version="1")
    assert stats["inference_count"] == found[("sluice_inference_rows_total", model)] == 13
    executions = stats["execution_count"]
    assert found[("sluice_executions_total", model)] == executions
    assert found[("sluice_batch_size_count", model)] == executions
    assert found[("sluice_batch_size_sum", model)] == 13
    assert stats["inference_stats"]["success"]["count"] == 13
    assert found[("sluice_queue_wait_seconds_count", model)] == 13
    assert stats["inference_stats"]["queue"]["count"] == 13
    assert found[("sluice_executions_total", key(model="broken", version="1"))] == 0


def test_metrics_port_serves_the_same_registry(observed: Observed) -> None:
    port_url = f"http://127.0.0.1:{observed.metrics_port}"
    on_port = metrics(port_url)
    on_http = metrics(observed.server.url)
    for name in ("sluice_requests_total", "sluice_admission_rejections_total"):
        assert by_name(on_port, name) == by_name(on_http, name)
    assert httpx.get(f"{port_url}/v2/health/ready").status_code == 404


def test_histogram_buckets(observed: Observed) -> None:
    found = metrics(observed.server.url)
    names = {
        "sluice_request_duration_seconds": key(model="demo", protocol="http"),
        "sluice_encode_duration_seconds": key(protocol="grpc"),
        "sluice_queue_wait_seconds": key(model="demo", version="1"),
        "sluice_compute_seconds": key(model="demo", version="1"),
        "sluice_batch_size": key(model="demo", version="1"),
    }
    for name, labels in names.items():
        series = sorted(
            (float(dict(sample)["le"]), value)
            for sample, value in by_name(found, f"{name}_bucket").items()
            if tuple(item for item in sample if item[0] != "le") == labels
        )
        counts = [count for _, count in series]
        assert counts == sorted(counts), f"{name} is not cumulative: {series}"
        assert math.isinf(series[-1][0]), name
        assert series[-1][1] == found[(f"{name}_count", labels)] > 0, name
        if name != "sluice_batch_size":
            assert sum(1 for bound, _ in series if bound < 0.001) >= 3, name  # sub-millisecond
            assert series[-2][0] >= 10, name  # up to tens of seconds


def test_start_line_and_model_loads(observed: Observed) -> None:
    lines = observed.lines()
    assert SECRET not in observed.log.read_text()
    start = lines[0]
    assert start["message"] == "starting sluice"
    settings = start["settings"]
    assert settings["rate_limit"]["redis_url"] == "redis://:***@127.0.0.1:1/0"
    assert settings["metrics"]["port"] == observed.metrics_port
    assert {entry["digest"] for entry in settings["auth"]["keys"]} == {
        KEYS[name].entry()["digest"][:15] + "…" for name in KEYS
    }
    (demo,) = [line for line in lines if line.get("model") == "demo" and "load_s" in line]
    assert demo["provider"] == "CPUExecutionProvider"
    assert demo["version"] == "1"
    assert demo["warm_up_s"] >= 0
    assert demo["load_s"] >= demo["warm_up_s"]


def test_request_ids_in_every_access_line(observed: Observed) -> None:
    sent = [rid for rid in observed.returned_ids if rid != "grpc-generated"]
    assert all(observed.returned_ids[rid] == rid for rid in sent)
    access = [line for line in observed.lines() if "duration_ms" in line]
    assert len(access) == sum(observed.statuses.values())  # one per inference request
    assert all(line.get("request_id") for line in access)
    by_id = {line["request_id"]: line for line in access}
    assert by_id["obs-http-0"]["status"] == 200
    assert by_id["obs-http-0"]["logger"] == "sluice.http"
    assert by_id["obs-404"]["status"] == 404
    assert by_id["obs-401"]["status"] == 401
    assert by_id["obs-tiny-2"]["status"] == 429
    assert by_id["obs-grpc-0"]["logger"] == "sluice.grpc"
    assert by_id["obs-grpc-400"]["status"] == 400
    assert by_id["obs-gtiny-2"]["status"] == 429
    assert by_id[observed.returned_ids["grpc-generated"]]["status"] == 200


def test_error_lines_carry_the_request_id(observed: Observed) -> None:
    about = [line for line in observed.lines() if line.get("request_id") == "obs-500"]
    # The backend's traceback is logged where the engine translates the batcher's error, in
    # the request's own context, so it carries the request id too.
    assert [(line["level"], line["logger"]) for line in about] == [
        ("error", "sluice.engine"),
        ("error", "sluice.http"),
        ("debug", "sluice.http"),
    ]
    assert "broken" in about[0]["message"]
    assert "broken" in about[1]["message"]
    assert about[2]["status"] == 500


# -- tracing -------------------------------------------------------------------------------------


class Collector:
    """A minimal OTLP/HTTP trace receiver on a free port: stores every export request."""

    def __init__(self) -> None:
        self.requests: list[ExportTraceServiceRequest] = []
        received = self.requests

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                received.append(ExportTraceServiceRequest.FromString(body))
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"

    def spans(self) -> list[tuple[str, str, dict[str, Any]]]:
        """(service name, span name, attributes) of every span received."""
        found = []
        for service, span in self.exported():
            values = {a.key: a.value for a in span.attributes}
            found.append((service, span.name, values))
        return found

    def exported(self) -> list[tuple[str, Span]]:
        """(service name, OTLP span) of every span received."""
        found = []
        for request in self.requests:
            for resource in request.resource_spans:
                attrs = {a.key: a.value.string_value for a in resource.resource.attributes}
                for scope in resource.scope_spans:
                    found += [(attrs["service.name"], span) for span in scope.spans]
        return found


@pytest.fixture
def collector() -> Iterator[Collector]:
    receiver = Collector()
    receiver.thread.start()
    yield receiver
    receiver.server.shutdown()
    receiver.server.server_close()


def test_spans_exported_over_otlp_with_text_logs(tmp_path: Path, collector: Collector) -> None:
    env = {
        "SLUICE_TRACING__OTLP_ENDPOINT": collector.endpoint,
        "SLUICE_TRACING__SERVICE_NAME": "sluice-under-test",
    }
    log = tmp_path / "server.log"
    server = ServerProcess("--log-format", "text", "--log-level", "debug", env=env, log_path=log)
    server.start()
    try:
        response = httpx.post(
            f"{server.url}/v2/models/demo/infer",
            json=infer_body(1),
            headers={"x-request-id": "otlp-http"},
            timeout=10,
        )
        assert response.status_code == 200, response.text
        with grpc.insecure_channel(server.grpc_url) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
            assert grpc_infer(stub, grpc_request(), (("x-request-id", "otlp-grpc"),)) == (
                "OK",
                "otlp-grpc",
            )
    finally:
        assert server.stop() == 0  # a clean shutdown flushes the buffered spans
    spans = collector.spans()
    assert {service for service, _, _ in spans} == {"sluice-under-test"}
    for rid, root in (("otlp-http", HTTP_SPAN), ("otlp-grpc", GRPC_SPAN)):
        names = sorted(name for _, name, attrs in spans
                       if attrs["sluice.request_id"].string_value == rid)  # fmt: skip
        assert names == sorted([root, "admission", "queue", "execute", "encode"]), rid
    text = log.read_text().splitlines()
    assert not any(line.startswith("{") for line in text)
    assert any("sluice.server: starting sluice" in line for line in text)
    assert any("sluice.http: POST /v2/models/demo/infer -> 200" in line and "[otlp-http]" in line
               for line in text)  # fmt: skip
    assert any("sluice.grpc: gRPC ModelInfer demo -> 200" in line and "[otlp-grpc]" in line
               for line in text)  # fmt: skip


def test_worker_and_engine_spans_form_one_trace(collector: Collector) -> None:
    """With --workers, the request span (worker process) and its stage spans (engine process)
    are one trace: every stage span is a child of the request's root span."""
    env = {"SLUICE_TRACING__OTLP_ENDPOINT": collector.endpoint}
    server = ServerProcess("--workers", "2", env=env)
    server.start()
    try:
        response = httpx.post(f"{server.url}/v2/models/demo/infer", json=infer_body(1),
                              headers={"x-request-id": "traced-http"}, timeout=10)  # fmt: skip
        assert response.status_code == 200, response.text
        with grpc.insecure_channel(server.grpc_url) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]
            assert grpc_infer(stub, grpc_request(), (("x-request-id", "traced-grpc"),))[0] == "OK"
    finally:
        assert server.stop() == 0  # every process flushes its buffered spans as it stops
    exported = [span for _, span in collector.exported()]
    for rid, root_name in (("traced-http", HTTP_SPAN), ("traced-grpc", GRPC_SPAN)):
        spans = {span.name: span for span in exported
                 if {a.key: a.value.string_value for a in span.attributes}.get(
                     "sluice.request_id") == rid}  # fmt: skip
        assert sorted(spans) == sorted([root_name, "admission", "queue", "execute", "encode"])
        root = spans.pop(root_name)
        for name, span in spans.items():
            assert span.trace_id == root.trace_id, name
            assert span.parent_span_id == root.span_id, name


def test_a_terminal_gets_text_lines_and_a_one_line_start(tmp_path: Path) -> None:
    """`sluice serve` in a terminal (a pty here), no --log-format: readable lines, and a short
    start line instead of the 2 kB settings object (issue 38; before, JSON lines)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLUICE_")}
    reader, writer = os.openpty()
    command = [sys.executable, "-m", "server", "serve", "--http-port", "0", "--grpc-port", "0"]
    process = subprocess.Popen(
        command, stdin=subprocess.DEVNULL, stdout=writer, stderr=writer, env=env, cwd=tmp_path
    )
    os.close(writer)
    output = b""
    try:
        deadline = time.monotonic() + 60
        while b"starting sluice" not in output or not output.endswith(b"\n"):
            assert time.monotonic() < deadline, output.decode(errors="replace")
            if select.select([reader], [], [], 1.0)[0]:
                output += os.read(reader, 65536)
        process.send_signal(signal.SIGTERM)
        while process.poll() is None or select.select([reader], [], [], 0.1)[0]:
            try:  # keep reading: a full terminal buffer would hold its shutdown lines
                output += os.read(reader, 65536) if select.select([reader], [], [], 0.5)[0] else b""
            except OSError:  # the terminal's last writer is gone
                break
            assert time.monotonic() < deadline + 30, "sluice did not stop on SIGTERM"
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(10)
        os.close(reader)
    lines = output.decode(errors="replace").splitlines()
    assert lines
    assert [line for line in lines if line.lstrip().startswith("{")] == []
    (start,) = [line for line in lines if "starting sluice" in line]
    assert re.match(
        r"\d{4}-\d\d-\d\d [\d:,]+ INFO sluice\.server: starting sluice: http://127\.0\.0\.1:0, "
        r"gRPC on 127\.0\.0\.1:0; serving the built-in demo model",
        start,
    ), start
    assert len(start) < 300
