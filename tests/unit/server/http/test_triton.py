"""Triton's HTTP extensions (config, statistics, repository) over FakeEngine."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import Response

from engine.auth import digest_key
from engine.errors import EngineError
from engine.regions import SystemRegions
from engine.settings import ApiKey, AuthSettings, SharedMemorySettings
from server.dataplane import DataPlane
from server.http.app import create_app, error_response
from server.http.triton import triton_router
from server.settings import Settings
from tests.fakes.cuda_client import IpcClient
from tests.fakes.cuda_runtime import FakeCudaRuntime
from tests.fakes.install import hide_package, install_cuda
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


# -- system shared memory --------------------------------------------------------------------------

REGISTER = "/v2/systemsharedmemory/region/{}/register"
CUDA_REGISTER = "/v2/cudasharedmemory/region/{}/register"
CUDA_BODY = {"raw_handle": {"b64": IpcClient.b64(bytes(64))}, "device_id": 0, "byte_size": 64}


def shm_client(engine: FakeEngine) -> httpx.AsyncClient:
    """A client of the whole application (the inference route included) over `engine`."""
    app = create_app(Settings(), engine)  # type: ignore[arg-type]
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://sluice")


def shm_engine(folder: Path, enabled: bool = True, **keys: str) -> FakeEngine:
    """A FakeEngine whose regions are files of `folder`; `keys`: tenant -> its API key."""
    auth = AuthSettings(
        keys=[ApiKey(digest=digest_key(k), tenant=tenant, name=k) for tenant, k in keys.items()]
    )
    return FakeEngine(auth, SystemRegions(SharedMemorySettings(enabled=enabled), folder))


def shm_infer(
    size: int,
    offset: int = 0,
    shape: tuple[int, ...] = (2, 4),
    output: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """An inference body for `double` whose input `x` lies in region `in`."""
    params = {"shared_memory_region": "in", "shared_memory_byte_size": size}
    if offset:
        params["shared_memory_offset"] = offset
    body: dict[str, Any] = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": list(shape), "parameters": params}]
    }
    if output is not None:
        body["outputs"] = [{"name": "y", "parameters": output}, {"name": "total"}]
    return body


async def test_shared_memory_is_off_by_default_and_says_how_to_enable_it(tmp_path: Path) -> None:
    (tmp_path / "in").write_bytes(bytes(32))
    async with shm_client(shm_engine(tmp_path, enabled=False)) as http:
        for response in (
            await http.post(REGISTER.format("in"), json={"key": "/in", "byte_size": 32}),
            await http.get("/v2/systemsharedmemory/status"),
            await http.post("/v2/systemsharedmemory/unregister"),
            await http.post("/v2/models/double/infer", json=shm_infer(32)),
            await http.get("/v2/cudasharedmemory/status"),
            await http.post("/v2/cudasharedmemory/unregister"),
            await http.post("/v2/cudasharedmemory/region/r/register", json=CUDA_BODY),
        ):
            assert response.status_code == 403
            assert "SLUICE_SHARED_MEMORY__ENABLED=true" in response.json()["error"]


async def test_tensors_round_trip_through_registered_regions(tmp_path: Path) -> None:
    x = np.random.default_rng(3).standard_normal((2, 4)).astype(np.float32)
    (tmp_path / "in").write_bytes(b"\0" * 16 + x.tobytes())
    (tmp_path / "out").write_bytes(bytes(64))
    engine = shm_engine(tmp_path)
    async with shm_client(engine) as http:
        body = {"key": "/in", "offset": 16, "byte_size": 32}
        assert (await http.post(REGISTER.format("in"), json=body)).status_code == 200
        body = {"key": "/out", "byte_size": 64}
        assert (await http.post(REGISTER.format("out"), json=body)).status_code == 200
        status = (await http.get("/v2/systemsharedmemory/region/in/status")).json()
        assert status == [{"name": "in", "key": "/in", "offset": 16, "byte_size": 32}]
        out = {
            "shared_memory_region": "out",
            "shared_memory_byte_size": 32,
            "shared_memory_offset": 8,
        }
        answer = await http.post("/v2/models/double/infer", json=shm_infer(32, output=out))
        assert answer.status_code == 200, answer.text
        y, total = answer.json()["outputs"]
        assert y == {"name": "y", "datatype": "FP32", "shape": [2, 4]}  # as Triton answers it
        np.testing.assert_allclose(total["data"], x.sum(axis=1), rtol=1e-6)
        written = np.frombuffer((tmp_path / "out").read_bytes()[8:40], np.float32)
        np.testing.assert_array_equal(written.reshape(2, 4), 2 * x)
        np.testing.assert_array_equal(engine.requests[-1].inputs["x"], x)
        assert (await http.post("/v2/systemsharedmemory/region/in/unregister")).status_code == 200
        left = (await http.get("/v2/systemsharedmemory/status")).json()
        assert [row["name"] for row in left] == ["out"]
        assert (await http.post("/v2/systemsharedmemory/unregister")).status_code == 200
        assert (await http.get("/v2/systemsharedmemory/status")).json() == []


async def test_bad_registrations_are_precise_4xx(tmp_path: Path) -> None:
    (tmp_path / "in").write_bytes(bytes(32))
    (tmp_path / "link").symlink_to(tmp_path / "in")
    engine = shm_engine(tmp_path, a="key-a")
    a = {"x-api-key": "key-a"}
    cases = [
        ({}, {"key": "/in", "byte_size": 32}, 401, "missing API key"),
        (a, {"key": "/link", "byte_size": 8}, 400, "not a link"),
        (a, {"key": "/etc/passwd", "byte_size": 8}, 400, "must name a file directly in"),
        (a, {"key": "/in", "offset": 8, "byte_size": 32}, 400, "passes the end of '/in'"),
        (a, {"byte_size": 8}, 400, "'key' must be a string"),
        (a, {"key": "/in", "byte_size": "8"}, 400, "byte_size must be an integer >= 0"),
    ]
    async with shm_client(engine) as http:
        for headers, body, status, message in cases:
            response = await http.post(REGISTER.format("r"), headers=headers, json=body)
            assert response.status_code == status, body
            assert message in response.json()["error"]
        assert (await http.get("/v2/systemsharedmemory/status", headers=a)).json() == []


async def test_another_tenants_region_and_bad_sizes_are_refused_before_the_engine(
    tmp_path: Path,
) -> None:
    (tmp_path / "in").write_bytes(bytes(32))
    engine = shm_engine(tmp_path, a="key-a", b="key-b")
    a, b = {"x-api-key": "key-a"}, {"x-api-key": "key-b"}
    infer = "/v2/models/double/infer"
    async with shm_client(engine) as http:
        body = {"key": "/in", "byte_size": 32}
        assert (await http.post(REGISTER.format("in"), headers=a, json=body)).status_code == 200
        cases = [
            (await http.post(infer, headers=b, json=shm_infer(32)), 404, "region 'in'"),
            (await http.get("/v2/systemsharedmemory/region/in/status", headers=b), 404, "'in'"),
            (
                await http.post("/v2/systemsharedmemory/region/in/unregister", headers=b),
                404,
                "'in'",
            ),
            (
                await http.post(infer, headers=a, json=shm_infer(32, 8)),
                400,
                "32 bytes at shared_memory_offset 8 pass the end of region 'in' (32 bytes)",
            ),
            (
                await http.post(infer, headers=a, json=shm_infer(28)),
                400,
                "(32 bytes) but shared_memory_byte_size 28",
            ),
            (
                await http.post(infer, headers=a, json=shm_infer(64, shape=(4, 4))),
                400,
                "64 bytes at shared_memory_offset 0 pass the end",
            ),
        ]
        for response, status, message in cases:
            assert response.status_code == status, response.text
            assert message in response.json()["error"]
        assert (await http.get("/v2/systemsharedmemory/status", headers=b)).json() == []
        assert len((await http.get("/v2/systemsharedmemory/status", headers=a)).json()) == 1
    assert engine.requests == []  # nothing reached the engine


# -- CUDA shared memory (engine/cuda_regions.py, on the fake cuda-python runtime) ------------------


async def test_tensors_round_trip_through_cuda_regions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = FakeCudaRuntime()
    install_cuda(monkeypatch, server)
    client = IpcClient()
    x = np.random.default_rng(5).standard_normal((2, 4)).astype(np.float32)
    _, in_handle = client.allocate(x.tobytes())
    out_ptr, out_handle = client.allocate(bytes(64))
    engine = shm_engine(tmp_path)
    try:
        async with shm_client(engine) as http:
            for name, handle, size in (("in", in_handle, 32), ("out", out_handle, 64)):
                body = {
                    "raw_handle": {"b64": client.b64(handle)},
                    "device_id": 0,
                    "byte_size": size,
                }
                response = await http.post(CUDA_REGISTER.format(name), json=body)
                assert response.status_code == 200, response.text
            status = (await http.get("/v2/cudasharedmemory/region/in/status")).json()
            assert status == [{"name": "in", "device_id": 0, "byte_size": 32}]
            out = {"shared_memory_region": "out", "shared_memory_byte_size": 32}
            out["shared_memory_offset"] = 8
            answer = await http.post("/v2/models/double/infer", json=shm_infer(32, output=out))
            assert answer.status_code == 200, answer.text
            y, total = answer.json()["outputs"]
            assert y == {"name": "y", "datatype": "FP32", "shape": [2, 4]}
            np.testing.assert_allclose(total["data"], x.sum(axis=1), rtol=1e-6)
            written = np.frombuffer(client.get(out_ptr + 8, 32), np.float32)
            np.testing.assert_array_equal(written.reshape(2, 4), 2 * x)  # as a plain request
            plain = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 4]}]}
            plain["inputs"][0]["data"] = x.ravel().tolist()
            same = (await http.post("/v2/models/double/infer", json=plain)).json()["outputs"]
            assert np.array_equal(np.float32(same[0]["data"]), 2 * x.ravel())
            assert (await http.post("/v2/cudasharedmemory/region/in/unregister")).status_code == 200
            left = (await http.get("/v2/cudasharedmemory/status")).json()
            assert [row["name"] for row in left] == ["out"]
            assert (await http.post("/v2/cudasharedmemory/unregister")).status_code == 200
            assert (await http.get("/v2/cudasharedmemory/status")).json() == []
        assert server.open_ipc_mappings == 0
    finally:
        client.free()


async def test_bad_cuda_registrations_are_precise_4xx(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hide_package(monkeypatch, "cuda")
    a = {"x-api-key": "key-a"}
    cases = [
        ({}, CUDA_BODY, 401, "missing API key"),
        (a, {**CUDA_BODY, "raw_handle": "abc"}, 400, "'raw_handle' must be {\"b64\""),
        (a, {**CUDA_BODY, "raw_handle": {"b64": "a*c="}}, 400, "not valid base64"),
        (a, {**CUDA_BODY, "raw_handle": {"b64": "YWJj"}}, 400, "64 bytes of a cudaIpcMemHandle_t"),
        (a, {**CUDA_BODY, "device_id": "0"}, 400, "device_id must be an integer >= 0"),
        (a, CUDA_BODY, 400, "CUDA shared memory needs cuda-python and a CUDA device: cuda-python"),
    ]
    async with shm_client(shm_engine(tmp_path, a="key-a")) as http:
        for headers, body, status, message in cases:
            response = await http.post(CUDA_REGISTER.format("r"), headers=headers, json=body)
            assert response.status_code == status, body
            assert message in response.json()["error"]
        assert (await http.get("/v2/cudasharedmemory/status", headers=a)).json() == []
        gone = await http.post("/v2/cudasharedmemory/region/r/unregister", headers=a)
        assert gone.status_code == 404
        assert gone.json()["error"] == "no shared memory region 'r' is registered by this tenant"
