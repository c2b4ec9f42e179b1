"""Triton's HTTP extensions: model configuration, statistics and model repository.

    GET  /v2/models/{name}[/versions/{version}]/config     effective config, Triton's JSON shape
    GET  /v2/models/stats                                  every loaded model version
    GET  /v2/models/{name}[/versions/{version}]/stats      one model (or version)
    POST /v2/repository/index                              {"ready": bool} -> [{name, version,
                                                           state, reason}]
    POST /v2/repository/models/{name}/load                 explicit / poll model control modes
    POST /v2/repository/models/{name}/unload               {"parameters": {"unload_dependents"}}
    GET  /v2/systemsharedmemory[/region/{name}]/status     [{name, key, offset, byte_size}]
    POST /v2/systemsharedmemory/region/{name}/register     {"key", "offset", "byte_size"}
    POST /v2/systemsharedmemory[/region/{name}]/unregister one region, or all the caller's
    GET  /v2/cudasharedmemory[/region/{name}]/status       [] (none is ever registered)
    POST /v2/cudasharedmemory[/region/{name}]/unregister   200, nothing to drop
    POST /v2/cudasharedmemory/region/{name}/register       400: no CUDA shared memory here

Include the router before the core `/v2/models/{name}` routes: `/v2/models/stats` must not be
taken for the metadata of a model called "stats" (Triton shadows such a model the same way).
Errors are raised as EngineError for the application's one error handler.
"""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response

from engine.errors import InvalidInput
from server.dataplane import DataPlane
from server.http import codec

CUDA_SHARED_MEMORY = (
    "sluice serves no CUDA shared memory (no GPU backend reads it); pass tensors through system "
    "shared memory (/v2/systemsharedmemory) or in the request"
)


def _json(body: Any) -> Response:
    return Response(orjson.dumps(body), media_type="application/json")


async def _body(request: Request) -> dict[str, Any]:
    """The optional JSON object body of a repository request ({} when empty)."""
    raw = await request.body()
    return codec.parse_json(raw) if raw.strip() else {}


def _parameters(body: dict[str, Any]) -> dict[str, Any]:
    params = body.get("parameters") or {}
    if not isinstance(params, dict):
        raise InvalidInput(f"'parameters' must be an object, got {type(params).__name__}")
    return params


def triton_router(plane: DataPlane) -> APIRouter:
    """The router serving Triton's extensions over the data plane."""
    router = APIRouter()

    @router.get("/v2/models/stats")
    async def all_statistics(request: Request) -> Response:
        return _json(await plane.statistics(request.headers))

    @router.get("/v2/models/{name}/stats")
    @router.get("/v2/models/{name}/versions/{version}/stats")
    async def model_statistics(request: Request, name: str) -> Response:
        version = request.path_params.get("version")  # never from the query string
        return _json(await plane.statistics(request.headers, name, version))

    @router.get("/v2/models/{name}/config")
    @router.get("/v2/models/{name}/versions/{version}/config")
    async def model_config(request: Request, name: str) -> Response:
        version = request.path_params.get("version")  # never from the query string
        return _json(await plane.model_config(request.headers, name, version))

    @router.post("/v2/repository/index")
    async def repository_index(request: Request) -> Response:
        caller = plane.repository_caller(request.headers)  # a stranger's body is never read
        ready = (await _body(request)).get("ready", False)
        if not isinstance(ready, bool):
            raise InvalidInput(f"'ready' must be true or false, got {ready!r:.60}")
        return _json(await plane.repository_index(caller, ready_only=ready))

    @router.post("/v2/repository/models/{name}/load")
    async def load(request: Request, name: str) -> Response:
        caller = plane.repository_caller(request.headers, name)  # before the body is read
        await plane.load_model(caller, name, _parameters(await _body(request)), "http")
        return Response(status_code=200)

    @router.post("/v2/repository/models/{name}/unload")
    async def unload(request: Request, name: str) -> Response:
        caller = plane.repository_caller(request.headers, name)  # before the body is read
        await plane.unload_model(caller, name, _parameters(await _body(request)), "http")
        return Response(status_code=200)

    @router.get("/v2/systemsharedmemory/status")
    @router.get("/v2/systemsharedmemory/region/{name}/status")
    async def shm_status(request: Request) -> Response:
        name = request.path_params.get("name")
        return _json(await plane.shm_status(request.headers, name))

    @router.post("/v2/systemsharedmemory/region/{name}/register")
    async def shm_register(request: Request, name: str) -> Response:
        caller = plane.authenticate(request.headers)  # a stranger's body is never read
        body = await _body(request)
        key, offset, size = body.get("key"), body.get("offset", 0), body.get("byte_size")
        # offset and byte_size are checked by the registry (whole numbers >= 0)
        if not isinstance(key, str):
            raise InvalidInput(f"'key' must be a string, got {key!r:.60}")
        await plane.shm_register(caller, name, key, offset, size, "http")
        return Response(status_code=200)

    @router.post("/v2/systemsharedmemory/unregister")
    @router.post("/v2/systemsharedmemory/region/{name}/unregister")
    async def shm_unregister(request: Request) -> Response:
        await plane.shm_unregister(request.headers, request.path_params.get("name"))
        return Response(status_code=200)

    @router.get("/v2/cudasharedmemory/status")
    @router.get("/v2/cudasharedmemory/region/{name}/status")
    async def cuda_shm_status(request: Request) -> Response:
        plane.cuda_shm_status(request.headers, request.path_params.get("name"))
        return _json([])

    @router.post("/v2/cudasharedmemory/unregister")
    @router.post("/v2/cudasharedmemory/region/{name}/unregister")
    async def cuda_shm_unregister(request: Request) -> Response:
        plane.cuda_shm_status(request.headers, request.path_params.get("name"))
        return Response(status_code=200)

    @router.post("/v2/cudasharedmemory/region/{name}/register")
    async def cuda_shm_register(request: Request) -> Response:
        plane.authenticate(request.headers)
        raise InvalidInput(CUDA_SHARED_MEMORY)

    return router
