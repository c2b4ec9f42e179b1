"""server.http.infer_route: the infer endpoint as plain ASGI in front of the FastAPI app, over a
real DataPlane and FakeEngine, driven by ASGI messages (no server: each test is a few calls)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import orjson
import pytest
from starlette.types import Message, Receive, Scope, Send

from engine.errors import Overloaded
from server.dataplane import DataPlane
from server.http.app import BodyLimit
from server.http.cycle import RESPOND, WHEN_GONE
from server.http.infer_route import InferRoute
from server.settings import Settings
from tests.unit.server.fake_engine import FakeEngine

LIMIT = 4096
DOUBLE = orjson.dumps(
    {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}
)


class Answer:
    """What the route sent: one response, its head and body."""

    def __init__(self, sent: list[Message]) -> None:
        assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
        self.status: int = sent[0]["status"]
        self.headers: list[tuple[str, str]] = [
            (k.decode(), v.decode()) for k, v in sent[0]["headers"]
        ]
        self.body: bytes = sent[1]["body"]

    def header(self, name: str) -> str:
        values = [v for k, v in self.headers if k == name]
        assert len(values) == 1, f"{name}: {values}"
        return values[0]

    def json(self) -> Any:
        return orjson.loads(self.body)


async def _fallback(scope: Scope, receive: Receive, send: Send) -> None:
    """The app behind the route (FastAPI in the server): says which path it was given."""
    body = scope["path"].encode()
    await send({"type": "http.response.start", "status": 299, "headers": []})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def route(engine: FakeEngine) -> InferRoute:
    settings = Settings(max_request_bytes=LIMIT)
    return InferRoute(_fallback, DataPlane(engine, settings), settings)  # type: ignore[arg-type]


def _scope(
    path: str,
    method: str = "POST",
    headers: list[tuple[str, str]] | None = None,
    extensions: dict[str, Any] | None = None,
) -> Scope:
    raw = [(k.encode(), v.encode()) for k, v in headers or [("content-type", "application/json")]]
    return {
        "type": "http",
        "method": method,
        "path": path,
        "headers": raw,
        "extensions": extensions or {},
    }


async def _call(route: InferRoute, scope: Scope, *chunks: bytes | None) -> list[Message]:
    """Run one request; each chunk is a body message (None: the client disconnects)."""
    messages: list[Message] = [
        {"type": "http.disconnect"}
        if chunk is None
        else {"type": "http.request", "body": chunk, "more_body": n < len(chunks) - 1}
        for n, chunk in enumerate(chunks)
    ]
    sent: list[Message] = []

    async def receive() -> Message:
        return messages.pop(0)

    async def send(message: Message) -> None:
        sent.append(message)

    await route(scope, receive, send)
    return sent


async def _answer(route: InferRoute, scope: Scope, *chunks: bytes | None) -> Answer:
    return Answer(await _call(route, scope, *chunks))


async def test_an_infer_request_is_answered_by_the_route(route: InferRoute) -> None:
    headers = [("content-type", "application/json"), ("x-request-id", "req-7")]
    answer = await _answer(route, _scope("/v2/models/double/infer", headers=headers), DOUBLE)
    assert answer.status == 200
    assert answer.header("x-request-id") == "req-7"
    assert answer.header("content-type") == "application/json"
    assert answer.header("content-length") == str(len(answer.body))
    outputs = {o["name"]: o["data"] for o in answer.json()["outputs"]}
    assert outputs == {"y": [2.0, 4.0, 6.0, 8.0], "total": [10.0]}


async def test_a_versioned_path_reaches_that_version(route: InferRoute, engine: FakeEngine) -> None:
    answer = await _answer(route, _scope("/v2/models/double/versions/1/infer"), DOUBLE)
    assert answer.status == 200
    assert [(r.model_name, r.model_version) for r in engine.requests] == [("double", "1")]
    missing = await _answer(route, _scope("/v2/models/double/versions/9/infer"), DOUBLE)
    assert missing.status == 404
    assert missing.json() == {"error": "unknown version '9' of model 'double'; available: 1"}


@pytest.mark.parametrize(
    "path", ["/v2/models/double", "/v2/models/double/infer/more", "/v2/health/ready"]
)
async def test_other_paths_go_to_the_app_behind(route: InferRoute, path: str) -> None:
    answer = await _answer(route, _scope(path, method="GET"), b"")
    assert (answer.status, answer.body) == (299, path.encode())


async def test_another_method_on_the_infer_path_is_405(route: InferRoute) -> None:
    scope = _scope("/v2/models/double/infer", method="GET", headers=[("x-request-id", "r1")])
    answer = await _answer(route, scope, b"")
    assert answer.status == 405
    assert answer.header("allow") == "POST"
    assert answer.header("x-request-id") == "r1"
    assert answer.json() == {"error": "Method Not Allowed"}
    assert answer.header("content-length") == str(len(answer.body))


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"", "request body is empty; expected a JSON inference request"),
        # Valid JSON that is not an object, or not JSON: the general path names the problem.
        (b"[1, 2]", "inference header must be a JSON object; got list"),
        (b"{not json", "request body is not valid JSON: "),
    ],
)
async def test_a_bad_body_is_400(route: InferRoute, body: bytes, message: str) -> None:
    answer = await _answer(route, _scope("/v2/models/double/infer"), body)
    assert answer.status == 400
    assert answer.json()["error"].startswith(message)


async def test_a_declared_length_past_the_limit_is_413_before_reading(
    route: InferRoute, engine: FakeEngine
) -> None:
    headers = [("content-type", "application/json"), ("content-length", str(LIMIT + 1))]
    # No body message is given: reading one would fail the test (pop from an empty list).
    # The bound is BodyLimit's, in front of every route (server/http/app.py).
    bounded = BodyLimit(route, LIMIT)
    answer = await _answer(bounded, _scope("/v2/models/double/infer", headers=headers))  # type: ignore[arg-type]
    assert answer.status == 413
    assert answer.json() == {
        "error": f"request body of {LIMIT + 1} bytes exceeds the limit of {LIMIT} bytes"
    }
    assert engine.requests == []


async def test_a_streamed_body_past_the_limit_is_413_at_the_chunk_that_passes_it(
    route: InferRoute,
) -> None:
    chunk = b" " * 1000
    bounded = BodyLimit(route, LIMIT)
    answer = await _answer(bounded, _scope("/v2/models/double/infer"), *[chunk] * 5, DOUBLE)  # type: ignore[arg-type]
    assert answer.status == 413
    assert answer.json() == {
        "error": f"request body of 5000 bytes exceeds the limit of {LIMIT} bytes"
    }


async def test_a_body_in_chunks_is_joined(route: InferRoute) -> None:
    answer = await _answer(route, _scope("/v2/models/double/infer"), DOUBLE[:10], DOUBLE[10:])
    assert answer.status == 200


@pytest.mark.parametrize("name", ["content-encoding", "inference-header-content-length"])
async def test_a_header_that_decides_the_reading_sent_twice_is_400(
    route: InferRoute, name: str
) -> None:
    headers = [("content-type", "application/json"), (name, "1"), (name, "2")]
    answer = await _answer(route, _scope("/v2/models/double/infer", headers=headers), DOUBLE)
    assert answer.status == 400
    assert answer.json() == {"error": f"header '{name}' is sent 2 times; send it once"}


async def test_an_engine_error_is_mapped_with_its_headers(
    route: InferRoute, engine: FakeEngine
) -> None:
    engine.fail_next = Overloaded("queue is full", retry_after_s=1.5)
    answer = await _answer(route, _scope("/v2/models/double/infer"), DOUBLE)
    assert answer.status == 503
    assert answer.header("retry-after") == "2"
    assert answer.json() == {"error": "queue is full"}


async def test_while_draining_requests_are_refused_and_asked_to_close(
    route: InferRoute, engine: FakeEngine
) -> None:
    engine.draining = True
    answer = await _answer(route, _scope("/v2/models/double/infer"), DOUBLE)
    assert answer.status == 503
    assert answer.header("connection") == "close"
    assert engine.requests == []
    other = await _answer(route, _scope("/v2/health/ready", method="GET"), b"")
    assert ("connection", "close") in other.headers  # every response, not only inference


async def test_a_request_cancelled_by_the_drain_is_answered_503(
    route: InferRoute, engine: FakeEngine
) -> None:
    task = asyncio.create_task(_call(route, _scope("/v2/models/slow/infer"), DOUBLE))
    await engine.started.wait()
    engine.draining = True
    task.cancel()
    answer = Answer(await task)
    assert answer.status == 503
    assert answer.header("connection") == "close"
    assert answer.json() == {"error": "server shut down before this request was answered"}


async def test_a_cancel_outside_a_drain_propagates(route: InferRoute, engine: FakeEngine) -> None:
    task = asyncio.create_task(_call(route, _scope("/v2/models/slow/infer"), DOUBLE))
    await engine.started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_client_that_leaves_withdraws_its_request_and_gets_nothing(
    route: InferRoute, engine: FakeEngine
) -> None:
    watchers: list[Callable[[], None] | None] = []
    scope = _scope("/v2/models/slow/infer", extensions={WHEN_GONE: watchers.append})
    task = asyncio.create_task(_call(route, scope, DOUBLE))
    await engine.started.wait()
    gone = watchers[-1]
    assert gone is not None
    gone()
    assert await task == []
    assert engine.cancelled.is_set()
    assert watchers[-1] is None  # the route stops watching once it is done


async def test_a_disconnect_while_reading_the_body_answers_nothing(route: InferRoute) -> None:
    assert await _call(route, _scope("/v2/models/double/infer"), DOUBLE[:10], None) == []


async def test_the_whole_answer_goes_in_one_write_when_the_protocol_offers_it(
    route: InferRoute,
) -> None:
    written: list[tuple[int, list[tuple[bytes, bytes]], bytes]] = []

    def respond(status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> bool:
        written.append((status, headers, body))
        return True

    scope = _scope("/v2/models/double/infer", extensions={RESPOND: respond})
    assert await _call(route, scope, DOUBLE) == []
    ((status, headers, body),) = written
    assert status == 200
    assert (b"content-length", str(len(body)).encode()) in headers
    assert orjson.loads(body)["model_name"] == "double"
