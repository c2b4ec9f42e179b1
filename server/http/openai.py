"""The OpenAI-compatible API of generative models: `POST /v1/completions` and
`POST /v1/chat/completions` (the model's chat template from tokenizer_config.json), with
`stream: true` as server-sent events (server/http/sse.py) and the usage in a last chunk of its
own when `stream_options.include_usage` asks for it. Errors are OpenAI's error object
(server/http/openai_errors.py). The model list is server/http/openai_models.py's, embeddings
server/http/embeddings.py's.

Authentication is engine.auth's, as on every route (the OpenAI client's `Authorization: Bearer`
key is read like `x-api-key`), in the process that serves the HTTP request; the rest (model,
sampling, tokens, admission, the scheduler) is engine/generation/service.py's, called in process
or, under `--workers N`, relayed to the engine process (engine/remote.py): these routes are the
same code either way."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from engine.auth import authenticate_headers
from engine.datatypes import past_64_bits, received
from engine.errors import EngineError, InvalidInput
from engine.generation.sampling import check_max_tokens
from engine.generation.sequence import Chunk
from engine.generation.service import (
    SAMPLING_KEYS,
    GenerateRequest,
    Generation,
    TokenStream,
)
from server.generation import ABSENT, FrontEnd, caller, generation_of, refused
from server.http import sse
from server.http.openai_errors import error_object, openai_error

__all__ = ["mount_openai"]


def mount_openai(app: FastAPI, engine: object) -> None:
    """Add the /v1 routes and Triton's generate extension (server/http/triton_generate.py) when
    `engine` serves generation (see generation_of)."""
    from server.http.triton_generate import generate_router

    generation = generation_of(engine)
    if generation is not None:
        front: FrontEnd = engine  # type: ignore[assignment]
        app.include_router(openai_router(front, generation))
        app.include_router(generate_router(front, generation))


def _json(body: Any) -> Response:
    return Response(orjson.dumps(body), media_type="application/json")


async def _body(request: Request) -> dict[str, Any]:
    try:
        body = orjson.loads(await request.body())
    except orjson.JSONDecodeError as exc:
        raise InvalidInput(f"the request body is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise InvalidInput(f"the request body must be a JSON object; got {type(body).__name__}")
    return body


UNSUPPORTED: dict[str, tuple[object, ...]] = {
    "logprobs": (None, False),
    "top_logprobs": (None,),
    "echo": (None, False),
    "suffix": (None, ""),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "response_format": (None, {"type": "text"}),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "web_search_options": (None,),
}
"""OpenAI parameters this server does not implement, with the values that ask for nothing: any
other value is refused, never silently ignored."""

ROLES = ("system", "developer", "user", "assistant", "tool")


def _options(body: dict[str, Any]) -> dict[str, Any]:
    for key, unused in UNSUPPORTED.items():
        value = body.get(key)
        if not any(type(value) is type(u) and value == u for u in unused):
            raise InvalidInput(f"{key} is not supported by this server; got {received(value)}", key)
    if body.get("n") not in (None, 1):
        raise refused("n", "1 (one choice per request)", body["n"])
    if body.get("best_of") not in (None, 1):
        raise refused("best_of", "1", body["best_of"])
    options = {key: body[key] for key in SAMPLING_KEYS if body.get(key) is not None}
    completion = body.get("max_completion_tokens")
    if completion is not None and "max_tokens" not in options:
        check_max_tokens(completion, "max_completion_tokens")  # named as the client sent it
        options["max_tokens"] = completion
    return options


def _prompt(body: dict[str, Any]) -> Any:
    prompt = body.get("prompt", ABSENT)
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) or (
        isinstance(prompt, list) and all(type(t) is int or past_64_bits(t) for t in prompt)
    ):
        # The ids are checked against the model's vocabulary by the service, one past 64 bits
        # (a double, as JSON hands it over) too: it is an id out of range, not a wrong kind.
        return prompt
    raise refused("prompt", "a string or a list of token ids (one prompt per request)", prompt)


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages", ABSENT)
    if not isinstance(messages, list) or not messages:
        raise refused("messages", "a non-empty list of {role, content} objects", messages)
    out = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise refused(f"messages[{index}]", "an object with role and content", message)
        role = message.get("role", ABSENT)
        if role not in ROLES:
            raise refused(f"messages[{index}].role", f"one of {', '.join(ROLES)}", role)
        content = message.get("content", ABSENT)
        if isinstance(content, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in content
        ):
            content = "".join(part["text"] for part in content)  # OpenAI's text parts
        if not isinstance(content, str):
            raise refused(
                f"messages[{index}].content",
                "a string or a list of text parts ({type: text, text}); this model takes text only",
                content,
            )
        out.append({**message, "content": content})
    return out


def _streamed(body: dict[str, Any]) -> bool:
    """Whether the answer is streamed. OpenAI's `stream` is "boolean or null": null (or no
    stream) asks for the default, not streamed, as n: null asks for one choice."""
    stream = body.get("stream")
    if stream is None:
        return False
    if not isinstance(stream, bool):
        raise refused("stream", "true or false", stream)
    return stream


def _include_usage(body: dict[str, Any], stream: bool) -> bool:
    """OpenAI's `stream_options.include_usage`; stream_options without a stream is refused,
    as OpenAI refuses it. Other keys of stream_options are ignored, as unknown fields are."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise InvalidInput("stream_options is only allowed when stream is true", "stream_options")
    if not isinstance(options, dict):
        raise refused("stream_options", "an object such as {include_usage: true}", options)
    include = options.get("include_usage")
    if include is not None and not isinstance(include, bool):
        raise refused("stream_options.include_usage", "true or false", include)
    return bool(include)


class Completion:
    """One request's answer, as OpenAI objects (completion or chat completion)."""

    def __init__(self, chat: bool, model: str, prompt_tokens: int) -> None:
        self.chat = chat
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())

    def usage(self, completion_tokens: int) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens,
        }

    def whole(self, text: str, finish: str | None, tokens: int) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice |= {"text": text, "logprobs": None}
        return self._object("chat.completion" if self.chat else "text_completion", choice) | {
            "usage": self.usage(tokens)
        }

    def chunk(self, text: str, finish: str | None, first: bool = False) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
        if self.chat:
            choice["delta"] = ({"role": "assistant"} if first else {}) | (
                {"content": text} if text or first else {}
            )
        else:
            choice |= {"text": text, "logprobs": None}
        return self._object("chat.completion.chunk" if self.chat else "text_completion", choice)

    def usage_chunk(self, completion_tokens: int) -> dict[str, Any]:
        """The last chunk of a stream that asked for usage: no choices, the usage."""
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return self._object(kind, None) | {"usage": self.usage(completion_tokens)}

    def _object(self, kind: str, choice: dict[str, Any] | None) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": [] if choice is None else [choice]}  # fmt: skip


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


def openai_router(engine: FrontEnd, generation: Generation) -> APIRouter:
    """The /v1 routes over `generation`'s models."""
    router = APIRouter()

    async def complete(request: Request, chat: bool) -> Response:
        named: str | None = None  # the model the request names, for an unknown model's 404
        try:
            principal = authenticate_headers(engine.authenticator, request.headers)
            body = await _body(request)
            named = body["model"] if isinstance(body.get("model"), str) else None
            tenant = caller(engine, principal, body.get("model", ABSENT))
            options = _options(body)
            prompt, messages = (None, _messages(body)) if chat else (_prompt(body), None)
            stream = _streamed(body)
            include_usage = _include_usage(body, stream)
            generate = GenerateRequest(
                body["model"], tenant, prompt, messages, options, refuse_past_context=True
            )
            tokens = await generation.generate(generate)
        except EngineError as exc:
            return openai_error(exc, chat, named)
        answer = Completion(chat, str(body["model"]), tokens.prompt_tokens)
        if stream:
            events = _stream(tokens, answer, include_usage)
            return StreamingResponse(events, media_type="text/event-stream", headers=tokens.headers)
        chunks = await until_disconnected(request, tokens)
        last = chunks[-1]
        if last.error is not None:
            return openai_error(last.error, chat)
        text = "".join(chunk.text for chunk in chunks)
        return _json(answer.whole(text, last.finish_reason, tokens.completion_tokens))

    @router.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await complete(request, chat=False)

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await complete(request, chat=True)

    return router


async def _stream(
    tokens: TokenStream, answer: Completion, include_usage: bool
) -> AsyncIterator[bytes]:
    """Server-sent events; when the client goes away Starlette cancels this generator and the
    sequence's slot is freed at the scheduler's next step. With `include_usage` (OpenAI's
    stream_options) every chunk carries `usage: null` and a last chunk with no choices carries
    the usage; without it the stream carries none."""
    try:
        first = True
        async for chunk in tokens.chunks():
            if chunk.error is not None:
                yield sse.event(error_object(chunk.error, "server_error"))
                break
            if chunk.text or first or chunk.finish_reason is not None:
                event = answer.chunk(chunk.text, chunk.finish_reason, first)
                if include_usage:
                    event["usage"] = None
                yield sse.event(event)
                first = False
            if chunk.finish_reason is not None and include_usage:
                yield sse.event(answer.usage_chunk(tokens.completion_tokens))
        yield sse.DONE
    finally:
        tokens.cancel()
