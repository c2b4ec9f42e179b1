"""loadtests.harness: what a load test is asked (its target and auth headers), the model's
metadata it starts from and the gRPC target it checks first (the ramp of locust steps itself:
tests/integration/test_loadtest.py)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest

from loadtests.harness import LoadTestConfig, check_grpc_target, fetch_metadata
from loadtests.runner import LoadTestError
from tests.redis_process import free_port

METADATA = {"name": "m", "versions": ["1", "2"], "inputs": [], "outputs": []}


class Server(BaseHTTPRequestHandler):
    """Answers /v2/models/m[/versions/2] with METADATA, anything else 404; records each call."""

    seen: ClassVar[list[tuple[str, str | None]]] = []

    def do_GET(self) -> None:
        self.seen.append((self.path, self.headers.get("authorization")))
        found = self.path in ("/v2/models/m", "/v2/models/m/versions/2")
        data = json.dumps(METADATA).encode() if found else b"unknown model"
        self.send_response(200 if found else 404)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Server)
    threading.Thread(target=httpd.serve_forever, args=(0.01,), daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    httpd.shutdown()
    httpd.server_close()


def config(url: str, **given: Any) -> LoadTestConfig:
    fields: dict[str, Any] = {"model": "m", "protocol": "http", "users": [1], "duration_s": 1}
    return LoadTestConfig(url=url, out=Path("out"), **{**fields, **given})


def test_the_target_is_the_url_or_the_grpc_target() -> None:
    assert config("http://h:1").target == "http://h:1"
    assert config("http://h:1", protocol="grpc", grpc_target="h:2").target == "h:2"
    assert config("http://h:1", api_keys=("k1", "k2")).auth_headers() == {
        "Authorization": "Bearer k1"
    }
    assert config("http://h:1").auth_headers() == {}


def test_the_metadata_of_the_model_or_of_one_version(url: str) -> None:
    Server.seen.clear()
    assert fetch_metadata(config(url, api_keys=("k",))) == METADATA
    assert fetch_metadata(config(url, model_version="2")) == METADATA
    assert Server.seen == [("/v2/models/m", "Bearer k"), ("/v2/models/m/versions/2", None)]


def test_no_metadata_says_what_answered_or_that_nothing_did(url: str) -> None:
    with pytest.raises(LoadTestError, match=r"^model metadata at .*/v2/models/x answered 404: "):
        fetch_metadata(config(url, model="x"))
    nobody = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(LoadTestError, match=f"^cannot reach the server at {nobody}/v2/models/m"):
        fetch_metadata(config(nobody))


def test_an_unreachable_grpc_target_is_refused_before_any_step() -> None:
    check_grpc_target(config("http://h:1"))  # no gRPC target: nothing to check
    target = f"127.0.0.1:{free_port()}"
    with pytest.raises(LoadTestError, match=f"^cannot reach the gRPC server at {target} "):
        check_grpc_target(config("http://h:1", grpc_target=target, timeout_s=0.2))
