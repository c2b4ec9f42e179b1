"""The HTTP/REST front-end: the Open Inference Protocol (KServe v2). Inference is served by
server/http/infer_route.py; everything else by FastAPI.

Exposed surfaces: `/openapi.json` answers any valid key once keys are configured (it lists every
route); the `/docs` and `/redoc` pages are not served at all (they would load scripts from a
CDN, which air-gapped sites cannot reach and nobody should have to trust). `/metrics` names
tenants and models: it needs an admin key with `metrics.require_key`, or by default when the
server binds beyond loopback."""

from __future__ import annotations

import logging
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.errors import EngineError, PayloadTooLarge
from engine.facade import EngineFacade
from engine.types import ModelMetadata
from server.dataplane import DataPlane
from server.errors import error_headers, http_status
from server.http.embeddings import embeddings_router
from server.http.infer_route import InferRoute
from server.http.openai import openai_router
from server.http.openai_errors import UNKNOWN_ROUTE, V1, http_error, openai_error
from server.http.openai_models import models_router
from server.http.triton import triton_router
from server.http.triton_generate import generate_router
from server.logs import RequestIdMiddleware
from server.settings import Settings

log = logging.getLogger("sluice.http")
READ = ["GET", "HEAD"]


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(
        orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY),
        status_code=status,
        media_type="application/json",
        headers=headers,
    )


def error_response(exc: EngineError) -> Response:
    return json_response({"error": exc.message}, http_status(exc), error_headers(exc))


def metadata_json(meta: ModelMetadata) -> dict[str, Any]:
    return {
        "name": meta.name,
        "versions": list(meta.versions),
        "platform": meta.platform,
        "inputs": [spec.as_dict() for spec in meta.inputs],
        "outputs": [spec.as_dict() for spec in meta.outputs],
    }


def create_app(settings: Settings, engine: EngineFacade) -> ASGIApp:
    """The ASGI application serving `engine`: the inference route in front of FastAPI, so the
    hot path skips FastAPI's layers (see server/http/infer_route.py), both over one data plane."""
    plane = DataPlane(engine, settings)
    routes = InferRoute(fastapi_app(settings, plane), plane, settings)
    return BodyLimit(routes, settings.max_request_bytes)


class BodyLimit:
    """ASGI middleware: a request body past `limit` bytes is PayloadTooLarge (413) when the app
    reads it, as soon as its Content-Length or the bytes received pass the limit. The one bound
    of every route's body: an inference request, a prompt, a generate request, a repository
    load."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limit
        declared = -1
        for key, value in scope["headers"]:
            if key == b"content-length":
                declared = int(value) if value.isdigit() else -1
                break
        if 0 <= declared <= limit:
            # The server reads no more body than a Content-Length declares (HTTP/1.1 framing;
            # httptools refuses one sent with Transfer-Encoding too): only a body without
            # one, or one declared past the limit, is bounded as it is read.
            await self.app(scope, receive, send)
            return
        size = 0

        async def bounded() -> Message:
            nonlocal size
            if declared > limit:
                raise PayloadTooLarge(declared, limit)
            message = await receive()
            size += len(message.get("body", b""))
            if size > limit:
                raise PayloadTooLarge(size, limit)
            return message

        await self.app(scope, bounded, send)


def _v1(request: Request) -> bool:
    path: str = request.url.path
    return path == V1 or path.startswith(V1 + "/")


def fastapi_app(settings: Settings, plane: DataPlane) -> FastAPI:
    """Every endpoint but inference: health, metadata, usage, metrics, Triton extensions."""
    app = FastAPI(title="sluice", version="0.1.0", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(RequestIdMiddleware)

    # Every refusal in the protocol's shape: KServe's {"error": "..."}, or OpenAI's error
    # object under /v1 (server/http/openai_errors.py), unknown /v1 routes included.
    @app.exception_handler(EngineError)
    async def _engine_error(request: Request, exc: EngineError) -> Response:
        return openai_error(exc) if _v1(request) else error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        # Its headers too: a 405's Allow (RFC 9110 requires it).
        headers = dict(exc.headers) if exc.headers else None
        if _v1(request):
            unknown = exc.status_code == 404
            message = (
                f"Unknown request URL: {request.method} {request.url.path}"
                if unknown
                else str(exc.detail)
            )
            return http_error(exc.status_code, message, headers, UNKNOWN_ROUTE if unknown else None)
        return json_response({"error": str(exc.detail)}, exc.status_code, headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        # A bug, not a client error: the traceback goes to the log, the client gets JSON.
        log.error("unhandled error", exc_info=exc)
        message = "internal server error (see the server log)"
        return http_error(500, message) if _v1(request) else json_response({"error": message}, 500)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        if _v1(request):
            return http_error(400, str(exc.errors()))
        return json_response({"error": str(exc.errors())}, 400)

    # Health and metadata answer HEAD too (load balancers' health checks use it).
    @app.api_route("/v2/health/live", methods=READ)
    async def live() -> Response:
        return json_response({"live": plane.live}, 200 if plane.live else 503)

    @app.api_route("/v2/health/ready", methods=READ)
    async def ready() -> Response:
        is_ready = await plane.ready_now()
        return json_response({"ready": is_ready}, 200 if is_ready else 503)

    # Before /v2/models/{name}: "/v2/models/stats" is the statistics endpoint, not a model.
    app.include_router(triton_router(plane))
    if plane.serves_generation:
        app.include_router(openai_router(plane))  # /v1 completions (server/http/openai.py)
        app.include_router(generate_router(plane))  # Triton's generate extension
    app.include_router(embeddings_router(plane))  # /v1/embeddings (server/http/embeddings.py)
    app.include_router(models_router(plane))  # /v1/models (server/http/openai_models.py)

    @app.get("/v2")
    async def server_metadata(request: Request) -> Response:
        return json_response(plane.server_metadata(request.headers))

    @app.get("/v2/tenants/self/usage")
    async def usage(request: Request) -> Response:
        return json_response(await plane.usage(request.headers))

    @app.api_route("/v2/models/{name}", methods=READ)
    @app.api_route("/v2/models/{name}/versions/{version}", methods=READ)
    async def model_metadata(request: Request, name: str) -> Response:
        version = request.path_params.get("version")
        meta = await plane.model_metadata(request.headers, name, version)
        return json_response(metadata_json(meta))

    @app.api_route("/v2/models/{name}/ready", methods=READ)
    @app.api_route("/v2/models/{name}/versions/{version}/ready", methods=READ)
    async def model_ready(request: Request, name: str) -> Response:
        version = request.path_params.get("version")
        is_ready = await plane.model_ready(request.headers, name, version, unknown_is_error=True)
        return json_response({"name": name, "ready": is_ready}, 200 if is_ready else 503)

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(request: Request) -> Response:
        plane.authenticate(request.headers)  # any valid key: no secret, but not for strangers
        return json_response(app.openapi())

    if settings.metrics.enabled:

        @app.get("/metrics")
        async def metrics(request: Request) -> Response:
            exposition = await plane.metrics(request.headers)
            return Response(exposition, media_type="text/plain; version=0.0.4")

    return app
