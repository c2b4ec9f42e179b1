"""The HTTP/REST front-end: the Open Inference Protocol (KServe v2) on FastAPI."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive

from engine.auth import Principal, authenticate_headers
from engine.engine import Engine
from engine.errors import EngineError, InvalidInput, PayloadTooLarge
from engine.settings import Settings
from engine.types import InferResponse, ModelMetadata
from server import binary, codec
from server.errors import error_headers, http_status
from server.logs import RequestIdMiddleware
from server.triton import triton_router

log = logging.getLogger("sluice.http")

T = TypeVar("T")
# Bodies larger than this are decoded and encoded in a worker thread, off the event loop.
OFF_LOOP_BYTES = 256 * 1024


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


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, or PayloadTooLarge as soon as it passes `limit` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(int(declared), limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(size, limit)
        chunks.append(chunk)
    return b"".join(chunks)


async def until_disconnect(receive: Receive) -> None:
    """Returns when the client goes away (call only after the body was read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Run `work`; if the client disconnects first, cancel it (the batcher withdraws it)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(until_disconnect(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, EngineError):
                await task
    return task.result()


async def off_loop(size: int, func: Callable[..., T], *args: Any) -> T:
    return await asyncio.to_thread(func, *args) if size > OFF_LOOP_BYTES else func(*args)


def create_app(settings: Settings, engine: Engine) -> FastAPI:
    """The FastAPI application serving `engine`."""
    app = FastAPI(title="sluice", version="0.1.0", docs_url=None, redoc_url=None)
    app.state.engine = engine
    app.state.settings = settings
    app.add_middleware(RequestIdMiddleware)

    @app.exception_handler(EngineError)
    async def _engine_error(_: Request, exc: EngineError) -> Response:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> Response:
        return json_response({"error": str(exc.detail)}, exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> Response:
        # A bug, not a client error: the traceback goes to the log, the client gets JSON.
        log.error("unhandled error", exc_info=exc)
        return json_response({"error": "internal server error (see the server log)"}, 500)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> Response:
        return json_response({"error": str(exc.errors())}, 400)

    @app.get("/v2/health/live")
    async def live() -> Response:
        return json_response({"live": engine.live}, 200 if engine.live else 503)

    @app.get("/v2/health/ready")
    async def ready() -> Response:
        return json_response({"ready": engine.ready}, 200 if engine.ready else 503)

    def principal(request: Request, model: str | None = None) -> Principal:
        return authenticate_headers(engine.authenticator, request.headers, model)

    # Before /v2/models/{name}: "/v2/models/stats" is the statistics endpoint, not a model.
    app.include_router(triton_router(engine))

    @app.get("/v2")
    async def server_metadata(request: Request) -> Response:
        principal(request)
        return json_response(engine.server_metadata())

    @app.get("/v2/tenants/self/usage")
    async def usage(request: Request) -> Response:
        return json_response(await engine.limiter.usage(principal(request).tenant))

    @app.get("/v2/models/{name}")
    @app.get("/v2/models/{name}/versions/{version}")
    async def model_metadata(request: Request, name: str) -> Response:
        version = request.path_params.get("version")
        principal(request, name)
        return json_response(metadata_json(engine.model_metadata(name, version)))

    @app.get("/v2/models/{name}/ready")
    @app.get("/v2/models/{name}/versions/{version}/ready")
    async def model_ready(request: Request, name: str) -> Response:
        version = request.path_params.get("version")
        principal(request, name)
        engine.model_metadata(name, version)  # unknown model or version: 404
        is_ready = engine.model_ready(name, version)
        return json_response({"name": name, "ready": is_ready}, 200 if is_ready else 503)

    if settings.metrics.enabled:

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(engine.metrics.exposition(), media_type="text/plain; version=0.0.4")

    @app.post("/v2/models/{name}/infer")
    @app.post("/v2/models/{name}/versions/{version}/infer")
    async def infer(request: Request, name: str) -> Response:
        version = request.path_params.get("version")
        started = time.monotonic()
        status = 200
        try:
            return await _infer(request, name, version)
        except EngineError as exc:
            status = http_status(exc)
            raise
        finally:
            elapsed = time.monotonic() - started
            engine.metrics.request(engine.label_for(name), version or "", "http", status, elapsed)
            log.debug("POST %s -> %d in %.3f ms", request.url.path, status, elapsed * 1e3)

    async def _infer(request: Request, name: str, version: str | None) -> Response:
        tenant = principal(request, name).tenant
        body = await read_body(request, settings.max_request_bytes)
        # Binary tensor data extension (server/binary.py): a JSON header of
        # Inference-Header-Content-Length bytes, then the binary inputs; outputs go back as
        # binary when asked (binary_data / binary_data_output); gzip/deflate both ways.
        if not body:
            raise InvalidInput("request body is empty; expected a JSON inference request")

        def decode() -> tuple[Any, binary.BinaryRequest]:
            limit = settings.max_request_bytes
            plain = binary.decompress(body, request.headers.get("content-encoding"), limit)
            split = binary.split_request(plain, request.headers)
            return codec.decode_request(split.header, name, version, split.arrays), split

        def json_data(array: Any, datatype: str) -> Any:
            return codec.output_json("", datatype, array)["data"]

        infer_request, split = await off_loop(len(body), decode)
        infer_request.tenant = tenant
        response = await unless_disconnected(request, engine.infer(infer_request))
        size = sum(a.nbytes for a in response.outputs.values())
        encode_started = time.monotonic()
        content, headers = await off_loop(
            size,
            binary.encode_response,
            response,
            split.binary_outputs(response.outputs),
            json_data,
            request.headers.get("accept-encoding"),
        )
        engine.metrics.encode.labels("http").observe(time.monotonic() - encode_started)
        return Response(content, headers=headers)

    return app


__all__ = ["InferResponse", "create_app", "error_response", "json_response", "metadata_json"]
