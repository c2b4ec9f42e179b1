"""The HTTP application (server/http/app.py) over FakeEngine: one body limit for every route."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import orjson

from server.dataplane import DataPlane
from server.http.app import create_app, fastapi_app
from server.http.infer_route import InferRoute
from server.settings import Settings
from tests.unit.server.fake_engine import FakeEngine

LIMIT = 2048
BODY = orjson.dumps(
    {"inputs": [{"name": "x", "datatype": "FP32", "shape": [128, 4], "data": [0.25] * 512}]}
)


async def test_the_body_limit_is_bound_once_in_front_of_every_route() -> None:
    """`max_request_bytes` is BodyLimit's, in front of the inference route as of every other:
    declared or streamed past it, a body is 413 with the limit named; the inference route
    itself reads what it is given (it bounded its body a second time, by a copy of the same
    code)."""
    assert len(BODY) > LIMIT
    settings = Settings(max_request_bytes=LIMIT)
    engine = FakeEngine()
    app = create_app(settings, engine)  # type: ignore[arg-type]
    url = "http://sluice/v2/models/double/infer"

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: bounded as it streams
        for start in range(0, len(BODY), 1000):
            yield BODY[start : start + 1000]

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app)) as client:
        declared = await client.post(url, content=BODY)
        assert declared.status_code == 413
        limit = f"request body of {len(BODY)} bytes exceeds the limit of {LIMIT} bytes"
        assert declared.json() == {"error": limit}
        streamed = await client.post(url, content=chunks())
        assert streamed.status_code == 413
        assert f"exceeds the limit of {LIMIT} bytes" in streamed.json()["error"]
    assert engine.requests == []

    plane = DataPlane(engine, settings)  # type: ignore[arg-type]
    bare = InferRoute(fastapi_app(settings, plane), plane, settings)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=bare)) as client:
        answer = await client.post(url, content=BODY)
    assert answer.status_code == 200, answer.text
    assert answer.json()["outputs"][0]["shape"] == [128, 4]
