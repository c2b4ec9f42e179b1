"""Triton's HTTP extensions (config, statistics, repository) over FakeEngine."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import Response

from engine.auth import digest_key
from engine.errors import EngineError
from engine.settings import ApiKey, AuthSettings, Settings
from server.dataplane import DataPlane
from server.http.app import error_response
from server.http.triton import triton_router
from tests.unit.server.fake_engine import MAX_BATCH_SIZE, FakeEngine


def make_app(engine: FakeEngine) -> FastAPI:
    app = FastAPI()
    app.include_router(triton_router(DataPlane(engine, Settings())))  # type: ignore[arg-type]

    @app.get("/v2/models/{name}")
    async def metadata(name: str) -> dict[str, str]:  # the core route the router must precede
        return {"metadata_of": name}

    @app.exception_handler(EngineError)
    async def _error(_: Request, exc: EngineError) -> Response:
        return error_response(exc)

    return app


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
async def client(engine: FakeEngine) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=make_app(engine))
    async with httpx.AsyncClient(transport=transport, base_url="http://sluice") as http:
        yield http


async def test_model_config(client: httpx.AsyncClient) -> None:
    for path in ("/v2/models/double/config", "/v2/models/double/versions/1/config"):
        response = await client.get(path)
        assert response.status_code == 200
        config = response.json()
        assert config["name"] == "double"
        assert config["max_batch_size"] == MAX_BATCH_SIZE
        assert config["input"] == [{"name": "x", "data_type": "TYPE_FP32", "dims": [4]}]
        assert config["dynamic_batching"]["preferred_batch_size"] == [4, 8]
    missing = await client.get("/v2/models/double/versions/9/config")
    assert missing.status_code == 404
    assert missing.json() == {"error": "unknown version '9' of model 'double'; available: 1"}


async def test_statistics(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    engine.counts["echo"] = 3
    everything = (await client.get("/v2/models/stats")).json()
    assert sorted(s["name"] for s in everything["model_stats"]) == [
        "double",
        "echo",
        "slow",
        "types",
    ]
    one = (await client.get("/v2/models/echo/stats")).json()["model_stats"]
    assert [(s["name"], s["inference_count"]) for s in one] == [("echo", 3)]
    versioned = await client.get("/v2/models/echo/versions/1/stats")
    assert versioned.json()["model_stats"][0]["version"] == "1"
    assert (await client.get("/v2/models/nope/stats")).status_code == 404
    # the core metadata route still answers for other names
    assert (await client.get("/v2/models/double")).json() == {"metadata_of": "double"}


async def test_repository_index_load_unload(client: httpx.AsyncClient, engine: FakeEngine) -> None:
    unload = await client.post(
        "/v2/repository/models/echo/unload", json={"parameters": {"unload_dependents": False}}
    )
    assert (unload.status_code, unload.content) == (200, b"")
    index = (await client.post("/v2/repository/index", content=b"")).json()
    assert {"name": "echo", "version": "1", "state": "UNAVAILABLE", "reason": "unloaded"} in index
    ready = (await client.post("/v2/repository/index", json={"ready": True})).json()
    assert [row["name"] for row in ready] == ["double", "slow", "types"]
    assert (await client.post("/v2/repository/models/echo/load")).status_code == 200
    assert "echo" in engine.loaded
    missing = await client.post("/v2/repository/models/nope/load")
    assert missing.status_code == 404


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("/v2/repository/index", b"{", "malformed JSON in request body"),
        ("/v2/repository/index", b"[1]", "request body must be a JSON object, got list"),
        ("/v2/repository/index", b'{"ready": "yes"}', "'ready' must be true or false, got 'yes'"),
        (
            "/v2/repository/models/echo/load",
            b'{"parameters": {"file:1/model.onnx": "AAAA"}}',
            "unknown load parameters file:1/model.onnx; allowed: config",
        ),
        (
            "/v2/repository/models/echo/load",
            b'{"parameters": {"config": "{\\"max_batch_size\\": -1}"}}',
            "invalid configuration in load parameter 'config':\n  max_batch_size:",
        ),
        (
            "/v2/repository/models/echo/load",
            b'{"parameters": {"config": "{nope"}}',
            "load parameter 'config' is not valid JSON",
        ),
        (
            "/v2/repository/models/echo/load",
            b'{"parameters": {"config": {"max_batch_size": 4}}}',
            "load parameter 'config' must be a JSON string holding the model config, got dict",
        ),
        (
            "/v2/repository/models/echo/unload",
            b'{"parameters": {"force": true}}',
            "unknown unload parameters force; allowed: unload_dependents",
        ),
        ("/v2/repository/models/echo/unload", b'{"parameters": 3}', "'parameters' must be an"),
    ],
)
async def test_bad_repository_bodies(
    client: httpx.AsyncClient, path: str, body: bytes, message: str
) -> None:
    response = await client.post(path, content=body)
    assert response.status_code == 400
    assert message in response.json()["error"]


async def test_admin_groups_and_model_allow_list() -> None:
    keys = [
        ApiKey(digest=digest_key("user"), tenant="acme", models=["double"]),
        ApiKey(digest=digest_key("root"), tenant="ops", role="admin"),
    ]
    engine = FakeEngine(AuthSettings(keys=keys, admin_endpoints=["repository", "statistics"]))
    transport = httpx.ASGITransport(app=make_app(engine))
    async with httpx.AsyncClient(transport=transport, base_url="http://sluice") as http:
        user: dict[str, Any] = {"headers": {"x-api-key": "user"}}
        root: dict[str, Any] = {"headers": {"Authorization": "Bearer root"}}
        assert (await http.get("/v2/models/double/config")).status_code == 401
        assert (await http.get("/v2/models/double/config", **user)).status_code == 200
        assert (await http.get("/v2/models/echo/config", **user)).status_code == 403
        denied = await http.get("/v2/models/stats", **user)
        assert denied.status_code == 403
        assert "statistics endpoints need an admin key" in denied.json()["error"]
        assert (await http.post("/v2/repository/index", **user)).status_code == 403
        assert (await http.post("/v2/repository/index", **root)).status_code == 200
        stats = (await http.get("/v2/models/stats", **root)).json()["model_stats"]
        assert len(stats) == 4
