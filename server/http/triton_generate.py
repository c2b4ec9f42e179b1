"""Triton's generate extension for generative models: `POST /v2/models/{name}/generate` answers
`{"model_name", "model_version", "text_output", "finish_reason", "usage"}`, and
`/generate_stream` sends one server-sent event per token batch with the new `text_output`.
The request is `{"text_input": ..., "parameters": {...}}` as Triton's LLM backends take it: the
sampling keys (max_tokens, temperature, top_k, top_p, seed, stop) at the top level as input
tensors (`16` or `[16]`), in `parameters`, or in vLLM's `sampling_parameters`, with TensorRT-LLM's
names and fields too (server/http/generate_inputs.py).
A max_tokens past what the context leaves after the prompt is clamped (finish reason
`length`), as Triton's TensorRT-LLM backend clamps it, where the OpenAI routes refuse it;
a prompt that leaves no room is refused on both. Errors are the v2 `{"error": "..."}` body
with the status engine errors map to. The routes only convert: the data plane
(server/dataplane.py) authenticates, authorizes and calls the engine's generation."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from engine.errors import EngineError, InvalidInput
from engine.generation.sequence import Chunk
from engine.generation.service import GenerateRequest, TokenStream
from server.dataplane import DataPlane
from server.errors import error_headers, http_status
from server.generating import GenerationRoute
from server.http import sse
from server.http.generate_inputs import generate_request

GENERATE_SPAN = "POST /v2/models/{name}/generate"


def v2_error(exc: EngineError) -> Response:
    body = orjson.dumps({"error": exc.message})
    return Response(body, http_status(exc), error_headers(exc), "application/json")


def _request(body: Any) -> tuple[str, dict[str, Any]]:
    """(text_input, sampling options) of a request body (server/http/generate_inputs.py)."""
    return generate_request(body)


async def until_disconnected(request: Request, stream: TokenStream) -> list[Chunk]:
    """Every chunk of a stream answered in one response; a client that goes away first
    cancels it (its slot is freed at the next step) instead of leaving it to run to the end."""

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        stream.cancel()

    watcher = asyncio.create_task(watch())
    try:
        return [chunk async for chunk in stream.chunks()]
    finally:
        watcher.cancel()
        stream.cancel()  # a no-op once finished


def generate_router(plane: DataPlane) -> APIRouter:
    """The /v2/models/{name}/generate[_stream] routes over the data plane's generation
    (mounted when the engine serves generation: server/http/app.py)."""
    router = APIRouter()

    async def begin(request: Request, name: str, span_name: str) -> TokenStream:
        route = GenerationRoute("http", span_name, f"POST {request.url.path}", request.headers)
        call = plane.generation_call(route, name)  # before the body is read
        with call.reading():
            try:
                body = orjson.loads(await request.body())
            except orjson.JSONDecodeError as exc:
                raise InvalidInput(f"the request body is not JSON: {exc}") from exc
            text, options = _request(body)
        [tokens] = await call.start([GenerateRequest(name, call.tenant, text, None, options)])
        return tokens

    def answer(name: str, text: str, tokens: TokenStream, final: bool) -> dict[str, Any]:
        body: dict[str, Any] = {"model_name": name, "model_version": "", "text_output": text}
        if final:
            body["finish_reason"] = tokens.finish_reason
            body["usage"] = {
                "prompt_tokens": tokens.prompt_tokens,
                "completion_tokens": tokens.completion_tokens,
            }
        return body

    @router.post("/v2/models/{name}/generate")
    async def generate(request: Request, name: str) -> Response:
        try:
            tokens = await begin(request, name, GENERATE_SPAN)
        except EngineError as exc:
            return v2_error(exc)
        chunks = await until_disconnected(request, tokens)
        if chunks[-1].error is not None:
            return v2_error(chunks[-1].error)
        text = "".join(chunk.text for chunk in chunks)
        body = orjson.dumps(answer(name, text, tokens, True))
        return Response(body, media_type="application/json")

    @router.post("/v2/models/{name}/generate_stream")
    async def generate_stream(request: Request, name: str) -> Response:
        try:
            tokens = await begin(request, name, GENERATE_SPAN + "_stream")
        except EngineError as exc:
            return v2_error(exc)

        async def events() -> AsyncIterator[bytes]:
            try:
                async for chunk in tokens.chunks():
                    if chunk.error is not None:
                        yield sse.event({"error": chunk.error.message})
                        return
                    final = chunk.finish_reason is not None
                    if chunk.text or final:
                        event = answer(name, chunk.text, tokens, final)
                        yield sse.event(event)
            finally:
                tokens.cancel()

        return StreamingResponse(events(), media_type="text/event-stream")

    return router
