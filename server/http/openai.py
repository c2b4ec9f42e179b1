"""The OpenAI-compatible API of generative models: `POST /v1/completions` and
`POST /v1/chat/completions` (the model's chat template from tokenizer_config.json), with
`stream: true` as server-sent events (server/http/sse.py) and the usage in a last chunk of its
own when `stream_options.include_usage` asks for it. Errors are OpenAI's error object
(server/http/openai_errors.py). The model list is server/http/openai_models.py's, embeddings
server/http/embeddings.py's. Structured output and tools are guided decoding
(server/http/openai_tools.py); `n` and a list of prompts are several sequences
(server/http/openai_choices.py); the answer's objects and events are
server/http/openai_answer.py's.

These routes only convert: authentication and authorization are the data plane's
(server/dataplane.py), as on every route (the OpenAI client's `Authorization: Bearer` key is read
like `x-api-key`), in the process that serves the HTTP request, and so is the call; the rest
(model, sampling, tokens, admission, the scheduler) is engine/generation/service.py's, called in
process or, under `--workers N`, relayed to the engine process (server/link/remote.py): these
routes are the same code either way."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from engine.datatypes import past_64_bits, received
from engine.errors import EngineError, InvalidInput
from engine.generation.sampling import check_max_tokens
from engine.generation.service import GUIDANCE, SAMPLING_KEYS, TOOLS, GenerateRequest
from server.dataplane import DataPlane
from server.fields import ABSENT, refused
from server.generating import GenerationRoute
from server.http.openai_answer import Completion, refused_grammar, stream_events
from server.http.openai_choices import Peeked, collect, seeded
from server.http.openai_errors import openai_error
from server.http.openai_tools import (
    ToolPlan,
    history_message,
    response_guidance,
    template_tools,
    tool_plan,
)


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
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "web_search_options": (None,),
}
"""OpenAI parameters this server does not implement, with the values that ask for nothing: any
other value is refused, never silently ignored (docs/protocol/openai.md says why for each)."""
WHY = {
    "logprobs": "the engines hand over tokens without their probabilities",
    "top_logprobs": "the engines hand over tokens without their probabilities",
    "presence_penalty": "onnxruntime-genai has only a multiplicative repetition penalty",
    "frequency_penalty": "onnxruntime-genai has only a multiplicative repetition penalty",
    "logit_bias": "the engines take no per-token bias",
}
"""Why a refused parameter cannot be honoured, where the reason is the engine's."""
MAX_CHOICES = 16
"""The most choices one request may ask for (n times the prompts of a list)."""

ROLES = ("system", "developer", "user", "assistant", "tool")


def _options(body: dict[str, Any]) -> dict[str, Any]:
    for key, unused in UNSUPPORTED.items():
        value = body.get(key)
        if not any(type(value) is type(u) and value == u for u in unused):
            why = f" ({WHY[key]})" if key in WHY else ""
            raise InvalidInput(
                f"{key} is not supported by this server{why}; got {received(value)}", key
            )
    if body.get("best_of") not in (None, 1):
        raise refused("best_of", "1", body["best_of"])
    options = {key: body[key] for key in SAMPLING_KEYS if body.get(key) is not None}
    completion = body.get("max_completion_tokens")
    if completion is not None and "max_tokens" not in options:
        check_max_tokens(completion, "max_completion_tokens")  # named as the client sent it
        options["max_tokens"] = completion
    return options


def _choices(body: dict[str, Any]) -> int:
    """OpenAI's `n`: how many choices each prompt gets."""
    n = body.get("n")
    if n is None:
        return 1
    if type(n) is not int or not 1 <= n <= MAX_CHOICES:
        raise refused("n", f"an integer from 1 to {MAX_CHOICES}", n)
    return n


def _one_prompt(prompt: object) -> bool:
    # The ids are checked against the model's vocabulary by the service, one past 64 bits
    # (a double, as JSON hands it over) too: it is an id out of range, not a wrong kind.
    return isinstance(prompt, str) or (
        isinstance(prompt, list) and all(type(t) is int or past_64_bits(t) for t in prompt)
    )


def _prompts(body: dict[str, Any]) -> list[Any]:
    """The prompts of a completion: one (text or token ids) or a list of them, in order."""
    prompt = body.get("prompt", ABSENT)
    if _one_prompt(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(_one_prompt(p) for p in prompt):
        return prompt
    raise refused("prompt", "a string, a list of token ids, or a non-empty list of either", prompt)


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    messages = body.get("messages", ABSENT)
    if not isinstance(messages, list) or not messages:
        raise refused("messages", "a non-empty list of {role, content} objects", messages)
    out = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise refused(f"messages[{index}]", "an object with role and content", message)
        message = history_message(index, message) or message  # an assistant's tool calls
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


def _guided(body: dict[str, Any], chat: bool) -> tuple[dict[str, Any], ToolPlan | None, str]:
    """The options structured output and tools add (GUIDANCE, TOOLS), the tool plan, and the
    field a grammar the engine refuses is named by."""
    plan = tool_plan(body) if chat else None
    form = response_guidance(body)
    if plan is not None and plan.mode == "auto" and form is not None:
        raise InvalidInput(
            "response_format with tools under tool_choice auto is not supported: the answer "
            "is guided either to a tool call or to the format; use tool_choice required or "
            "leave tools out",
            "response_format",
        )
    added: dict[str, Any] = {}
    tools = template_tools(body) if chat else None
    if tools is not None:
        added[TOOLS] = tools
    guidance = plan.guidance if plan is not None else form
    if guidance is not None:
        added[GUIDANCE] = guidance
    return added, plan, "tools" if plan is not None else "response_format"


def _named(exc: EngineError, source: str) -> EngineError:
    """A refusal of the guidance, named by the field it came from."""
    if isinstance(exc, InvalidInput) and exc.param == GUIDANCE:
        return InvalidInput(f"{source}: {exc.message}", source)
    return exc


def openai_router(plane: DataPlane) -> APIRouter:
    """The /v1 completion routes over the data plane's generation (mounted when the engine
    serves generation: server/http/app.py)."""
    router = APIRouter()

    async def complete(request: Request, chat: bool) -> Response:
        named: str | None = None  # the model the request names, for an unknown model's 404
        source = "response_format"
        path = "POST /v1/chat/completions" if chat else "POST /v1/completions"
        try:
            call = plane.generation_call(GenerationRoute("http", path, path, request.headers))
            with call.reading():  # authenticated before the body is read
                body = await _body(request)
                named = body["model"] if isinstance(body.get("model"), str) else None
                call.choose(body.get("model", ABSENT))
                options = _options(body)
                n = _choices(body)
                prompts, messages = ([None], _messages(body)) if chat else (_prompts(body), None)
                if len(prompts) * n > MAX_CHOICES:
                    raise InvalidInput(
                        f"{len(prompts)} prompts with n {n} ask for {len(prompts) * n} choices; "
                        f"the most is {MAX_CHOICES}",
                        "n",
                    )
                stream = _streamed(body)
                include_usage = _include_usage(body, stream)
                added, plan, source = _guided(body, chat)
            requests = [
                GenerateRequest(
                    body["model"],
                    call.tenant,
                    prompt,
                    messages,
                    seeded(options, k) | added,
                    refuse_past_context=True,
                )
                for prompt in prompts
                for k in range(n)
            ]
            streams = [Peeked(tokens) for tokens in await call.start(requests)]
            if stream and GUIDANCE in added:
                await refused_grammar(streams)
        except EngineError as exc:
            return openai_error(_named(exc, source), chat, named)
        prompt_tokens = sum(s.stream.prompt_tokens for s in streams[::n])
        answer = Completion(chat, str(body["model"]), prompt_tokens)
        if stream:
            events = stream_events(streams, answer, include_usage, plan)
            headers = streams[0].stream.headers
            return StreamingResponse(events, media_type="text/event-stream", headers=headers)
        results = await collect(request, streams)
        choices = []
        for index, chunks in enumerate(results):
            last = chunks[-1]
            if last.error is not None:
                return openai_error(_named(last.error, source), chat)
            text = "".join(chunk.text for chunk in chunks)
            calls = plan.calls(text) if plan is not None else None
            choices.append(answer.choice(index, text, last.finish_reason, calls))
        tokens = sum(s.stream.completion_tokens for s in streams)
        return _json(answer.whole(choices, tokens))

    @router.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await complete(request, chat=False)

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await complete(request, chat=True)

    return router
