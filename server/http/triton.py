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
    GET  /v2/cudasharedmemory[/region/{name}]/status       [{name, device_id, byte_size}]
    POST /v2/cudasharedmemory/region/{name}/register       {"raw_handle": {"b64"}, "device_id",
                                                           "byte_size"}
    POST /v2/cudasharedmemory[/region/{name}]/unregister   one region, or all the caller's

Include the router before the core `/v2/models/{name}` routes: `/v2/models/stats` must not be
taken for the metadata of a model called "stats" (Triton shadows such a model the same way).
Errors are raised as EngineError for the application's one error handler.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response

from engine.errors import InvalidInput
from server.dataplane import DataPlane
from server.http import codec


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


def _raw_handle(value: Any) -> bytes:
    """The bytes of a CUDA register body's `{"raw_handle": {"b64": "..."}}` (what tritonclient's
    `cuda_shared_memory.get_raw_handle` gives); their length is the registry's to check."""
    b64 = value.get("b64") if isinstance(value, dict) else None
    if not isinstance(b64, str):
        raise InvalidInput(
            '\'raw_handle\' must be {"b64": "<base64 of the CUDA IPC handle>"}, got '
            f"{value!r:.60}"
        )
    try:
        return base64.b64decode(b64, validate=True)
    except binascii.Error as exc:
        raise InvalidInput(f"'raw_handle' is not valid base64: {exc}") from None


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
        name = request.path_params.get("name")
        return _json(await plane.cuda_shm_status(request.headers, name))

    @router.post("/v2/cudasharedmemory/region/{name}/register")
    async def cuda_shm_register(request: Request, name: str) -> Response:
        caller = plane.authenticate(request.headers)  # a stranger's body is never read
        body = await _body(request)
        # device_id and byte_size are checked by the registry (whole numbers)
        handle = _raw_handle(body.get("raw_handle"))
        device, size = body.get("device_id"), body.get("byte_size")
        await plane.cuda_shm_register(caller, name, handle, device, size, "http")
        return Response(status_code=200)

    @router.post("/v2/cudasharedmemory/unregister")
    @router.post("/v2/cudasharedmemory/region/{name}/unregister")
    async def cuda_shm_unregister(request: Request) -> Response:
        await plane.cuda_shm_unregister(request.headers, request.path_params.get("name"))
        return Response(status_code=200)

    return router
