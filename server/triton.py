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

from engine.auth import Principal, authenticate_headers
from engine.engine import Engine
from engine.errors import InvalidInput


def _json(body: Any) -> Response:
    return Response(orjson.dumps(body), media_type="application/json")


async def _body(request: Request) -> dict[str, Any]:
    """The optional JSON object body of a repository request ({} when empty)."""
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidInput(f"malformed JSON in request body: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidInput(f"request body must be a JSON object, got {type(body).__name__}")
    return body


def _parameters(body: dict[str, Any]) -> dict[str, Any]:
    params = body.get("parameters") or {}
    if not isinstance(params, dict):
        raise InvalidInput(f"'parameters' must be an object, got {type(params).__name__}")
    return params


def triton_router(engine: Engine) -> APIRouter:
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
    async def model_statistics(request: Request, name: str, version: str | None = None) -> Response:
        caller = principal(request)
        caller.require_admin("statistics")
        caller.check_model(name)
        return _json(engine.statistics(name, version))

    @router.get("/v2/models/{name}/config")
    @router.get("/v2/models/{name}/versions/{version}/config")
    async def model_config(request: Request, name: str, version: str | None = None) -> Response:
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
        params = _parameters(await _body(request))
        if params:
            raise InvalidInput(
                f"load parameters are not supported (got {', '.join(sorted(params))}); put the "
                "model's config.yaml and files in the repository instead"
            )
        await engine.load_model(name)
        return Response(status_code=200)

    @router.post("/v2/repository/models/{name}/unload")
    async def unload(request: Request, name: str) -> Response:
        caller = principal(request)
        caller.require_admin("repository")
        caller.check_model(name)
        # `unload_dependents` (always sent by tritonclient) has no effect: sluice has no ensembles.
        unknown = sorted(set(_parameters(await _body(request))) - {"unload_dependents"})
        if unknown:
            raise InvalidInput(
                f"unknown unload parameters {', '.join(unknown)}; allowed: unload_dependents"
            )
        await engine.unload_model(name)
        return Response(status_code=200)

    return router
