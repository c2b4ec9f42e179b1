"""OpenAI's model list: `GET /v1/models` (the generative models and the text-in embedding models
the caller's key may use) and `GET /v1/models/{id}` (one of them, or a 404 naming it)."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response

from engine.auth import Principal
from engine.errors import EngineError, ModelNotFound
from server.dataplane import DataPlane
from server.http.embeddings import embedding_models
from server.http.openai_errors import openai_error


def model_object(name: str) -> dict[str, Any]:
    """OpenAI's model object (sluice keeps no creation time: 0)."""
    return {"id": name, "object": "model", "created": 0, "owned_by": "sluice"}


async def served_models(plane: DataPlane, principal: Principal) -> list[str]:
    """What /v1 serves to `principal`: generative models, then embedding models, each sorted."""
    generative = plane.generative_models()
    names = [name for name in generative if principal.may_use(name)]
    index = await plane.engine.repository_index(ready_only=True)
    loaded = {entry["name"] for entry in index}
    others = sorted(n for n in loaded if n not in generative and principal.may_use(n))
    return names + await embedding_models(plane, others)


def models_router(plane: DataPlane) -> APIRouter:
    """`GET /v1/models` and `GET /v1/models/{id}` over `plane`."""
    router = APIRouter()

    @router.get("/v1/models")
    async def models(request: Request) -> Response:
        try:
            principal = plane.authenticate(request.headers)
            names = await served_models(plane, principal)
        except EngineError as exc:
            return openai_error(exc)
        body = {"object": "list", "data": [model_object(name) for name in names]}
        return Response(orjson.dumps(body), media_type="application/json")

    @router.get("/v1/models/{name}")
    async def model(request: Request, name: str) -> Response:
        try:
            principal = plane.authenticate(request.headers)
            if name not in await served_models(plane, principal):
                raise ModelNotFound(name)
        except EngineError as exc:
            return openai_error(exc)
        return Response(orjson.dumps(model_object(name)), media_type="application/json")

    return router
