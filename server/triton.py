"""Triton's HTTP extensions: model configuration, statistics and model repository.

    GET  /v2/models/{name}[/versions/{version}]/config     effective config, Triton's JSON shape
    GET  /v2/models/stats                                  every loaded model version
    GET  /v2/models/{name}[/versions/{version}]/stats      one model (or version)
    POST /v2/repository/index                              {"ready": bool} -> [{name, version,
                                                           state, reason}]
    POST /v2/repository/models/{name}/load                 explicit / poll model control modes
    POST /v2/repository/models/{name}/unload               {"parameters": {"unload_dependents"}}

Include the router before the core `/v2/models/{name}` routes: `/v2/models/stats` must not be
taken for the metadata of a model called "stats" (Triton shadows such a model the same way).
Errors are raised as EngineError for the application's one error handler.
"""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response

from engine.auth import Principal, admin_action, authenticate_headers
from engine.errors import InvalidInput
from engine.facade import EngineFacade
from server import codec


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


def triton_router(engine: EngineFacade) -> APIRouter:
    """The router serving Triton's extensions from `engine`."""
    router = APIRouter()

    def principal(request: Request) -> Principal:
        return authenticate_headers(engine.authenticator, request.headers)

    @router.get("/v2/models/stats")
    async def all_statistics(request: Request) -> Response:
        caller = principal(request)
        caller.require_admin("statistics")
        stats = engine.statistics()
        visible = [entry for entry in stats["model_stats"] if caller.may_use(entry["name"])]
        return _json({"model_stats": visible})

    @router.get("/v2/models/{name}/stats")
    @router.get("/v2/models/{name}/versions/{version}/stats")
    async def model_statistics(request: Request, name: str) -> Response:
        version = request.path_params.get("version")  # never from the query string
        caller = principal(request)
        caller.require_admin("statistics")
        caller.check_model(name)
        return _json(engine.statistics(name, version))

    @router.get("/v2/models/{name}/config")
    @router.get("/v2/models/{name}/versions/{version}/config")
    async def model_config(request: Request, name: str) -> Response:
        version = request.path_params.get("version")  # never from the query string
        caller = principal(request)
        caller.require_admin("config")
        caller.check_model(name)
        return _json(engine.model_config(name, version))

    @router.post("/v2/repository/index")
    async def repository_index(request: Request) -> Response:
        principal(request).require_admin("repository")
        ready = (await _body(request)).get("ready", False)
        if not isinstance(ready, bool):
            raise InvalidInput(f"'ready' must be true or false, got {ready!r:.60}")
        return _json(engine.repository_index(ready_only=ready))

    @router.post("/v2/repository/models/{name}/load")
    async def load(request: Request, name: str) -> Response:
        caller = principal(request)
        caller.require_admin("repository")
        caller.check_model(name)
        with admin_action(caller, "load", model=name, protocol="http"):
            await engine.load_model(name, list(_parameters(await _body(request))))
        return Response(status_code=200)

    @router.post("/v2/repository/models/{name}/unload")
    async def unload(request: Request, name: str) -> Response:
        caller = principal(request)
        caller.require_admin("repository")
        caller.check_model(name)
        with admin_action(caller, "unload", model=name, protocol="http"):
            await engine.unload_model(name, list(_parameters(await _body(request))))
        return Response(status_code=200)

    return router
