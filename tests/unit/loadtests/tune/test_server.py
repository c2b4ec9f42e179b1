"""loadtests.tune.server: reading the served config of the model being tuned, loading candidates
through Triton's repository API and putting the original back, against a small scripted HTTP
server (a real sluice server: tests/integration/test_tune_e2e.py)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

import pytest

from loadtests.runner import LoadTestError
from loadtests.tune.server import Original, ServerControl
from loadtests.tune.space import config_json
from tests.redis_process import free_port

SERVED = {"max_batch_size": 8, "dynamic_batching": {"max_queue_delay_s": 0.002}}


class Scripted(BaseHTTPRequestHandler):
    """Answers GET config with `config` and records every POST (path, body, headers)."""

    config: ClassVar[dict[str, Any]] = {}
    status: ClassVar[int] = 200
    posted: ClassVar[list[tuple[str, Any, str | None]]] = []

    def do_GET(self) -> None:
        self._answer(self.config)

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        self.posted.append((self.path, body, self.headers.get("authorization")))
        self._answer({})

    def _answer(self, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode() if self.status == 200 else b"model 'm' is not ready"
        self.send_response(self.status)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # the tests read what was posted, not the log


@pytest.fixture(scope="module")
def httpd() -> Iterator[ThreadingHTTPServer]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Scripted)
    # A short poll: shutdown() waits for the loop to look again.
    thread = threading.Thread(target=httpd.serve_forever, args=(0.01,), daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def server(httpd: ThreadingHTTPServer) -> str:
    Scripted.config, Scripted.status, Scripted.posted = {}, 200, []
    return f"http://127.0.0.1:{httpd.server_address[1]}/"


def triton_config(source: str | None) -> dict[str, Any]:
    parameters = {"sluice_config": {"string_value": json.dumps(SERVED)}}
    if source is not None:
        parameters["sluice_config_source"] = {"string_value": source}
    return {"name": "m", "parameters": parameters}


def test_the_original_is_the_sluice_config_the_model_serves(server: str) -> None:
    control = ServerControl(server, "m")
    Scripted.config = triton_config(None)
    assert control.original() == Original(SERVED, "repository")
    Scripted.config = triton_config("load")
    assert control.original() == Original(SERVED, "load")
    assert Original.from_dict(control.original().to_dict()) == Original(SERVED, "load")


def test_a_server_that_reports_no_sluice_config_is_named(server: str) -> None:
    Scripted.config = {"name": "m", "parameters": {}}
    with pytest.raises(LoadTestError, match="has no sluice_config parameter"):
        ServerControl(server, "m").original()


def test_candidates_load_with_their_config_and_restore_puts_the_original_back(
    server: str,
) -> None:
    control = ServerControl(server, "m", headers={"authorization": "Bearer k"})
    candidate = {**SERVED, "max_batch_size": 32}
    control.load(candidate)
    control.restore(Original(SERVED, "repository"))  # the folder's config.yaml again
    control.restore(Original(SERVED, "load"))  # the config a load request had given
    load = "/v2/repository/models/m/load"
    assert Scripted.posted == [
        (load, {"parameters": {"config": config_json(candidate)}}, "Bearer k"),
        (load, {}, "Bearer k"),
        (load, {"parameters": {"config": config_json(SERVED)}}, "Bearer k"),
    ]


def test_a_refusal_or_no_server_is_a_load_test_error_naming_the_call(server: str) -> None:
    Scripted.status = 503
    with pytest.raises(LoadTestError, match=r"^GET .*/v2/models/m/config answered 503: model"):
        ServerControl(server, "m").triton_config()
    nobody = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(LoadTestError, match=f"^cannot reach the server at {nobody}/v2/models/m"):
        ServerControl(nobody, "m", timeout_s=2).triton_config()
