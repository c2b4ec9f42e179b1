"""OpenAI's error object on every /v1 route: `{"error": {"message", "type", "param", "code"}}`
with the status engine errors map to everywhere else (server/errors.py), for engine errors and
for what the HTTP layer refuses itself (an unknown /v1 route, a wrong method, a bug). OpenAI's
`code` and `type` are read off the engine error's class (`CODES`, `openai_type`); `param` is
the request field the error names.

An unknown model is named, and only named: the repository's other models (pipeline steps
included) are not listed to whoever asks; `GET /v1/models` lists those the caller may use."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi.responses import Response

from engine.errors import (
    ContextLengthExceeded,
    EngineError,
    InvalidApiKey,
    ModelForbidden,
    ModelNotFound,
    QuotaExceeded,
    RateLimited,
)
from server.errors import error_headers, http_status

V1 = "/v1"
"""The prefix of OpenAI's routes: errors under it take OpenAI's shape."""

ERROR_TYPES = {
    400: "invalid_request_error",
    # OpenAI types a missing or wrong key, a key not allowed a model and an unknown model so
    # too (codes null or invalid_api_key, model_not_found); a 429 is typed by the error.
    401: "invalid_request_error",
    403: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
}
"""OpenAI's error `type` by HTTP status, for errors without a `type` of their own."""

UNKNOWN_ROUTE = "unknown_url"
"""OpenAI's `code` for a path it does not serve."""

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"

# Most specific first: subclasses before their bases. Every other error's code is null.
CODES: tuple[tuple[type[EngineError], str], ...] = (
    (ModelNotFound, "model_not_found"),
    (ModelForbidden, "model_not_found"),  # OpenAI's 403 for a model a key may not use
    (ContextLengthExceeded, CONTEXT_LENGTH_EXCEEDED),
    (InvalidApiKey, "invalid_api_key"),  # a key sent and not valid; a missing one is null
    (QuotaExceeded, "insufficient_quota"),
    (RateLimited, "rate_limit_exceeded"),
)
"""OpenAI's error `code` by engine error class."""


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "server_error" if status >= 500 else "api_error")


def openai_code(exc: EngineError) -> str | None:
    """OpenAI's error `code` for `exc` (CODES), None where OpenAI's API sends null."""
    return next((code for cls, code in CODES if isinstance(exc, cls)), None)


def openai_type(exc: EngineError, status: int) -> str:
    """OpenAI's error `type`: a 429 is typed by what ran out (`insufficient_quota`, `tokens`,
    `requests`), every other error by its HTTP status (`error_type`)."""
    if isinstance(exc, QuotaExceeded):
        return "insufficient_quota"
    if isinstance(exc, RateLimited):
        return "tokens" if exc.tokens else "requests"
    return error_type(status)


def error_body(
    message: str, status: int, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error object for a refusal that is not an engine error."""
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": code}}


def unknown_model(name: str) -> str:
    return f"unknown model '{name}'; GET /v1/models lists the models this key may use"


def error_object(
    exc: EngineError, kind: str, chat: bool = True, model: str | None = None
) -> dict[str, Any]:
    """OpenAI's error object: `param` names the request field at fault and `code` is OpenAI's
    for the error, where there is one. A prompt, or a prompt plus max_tokens, past the context
    is context_length_exceeded on `messages` for a chat, as OpenAI's chat completions answer
    it; its completions send neither a param nor a code for it. An unknown model names the
    model and lists nothing else (param null, as OpenAI's): `model` is the name the request
    gave, for an error relayed from the engine process (which carries its message only)."""
    message, param, code = exc.message, exc.param, openai_code(exc)
    if code == CONTEXT_LENGTH_EXCEEDED:
        param, code = ("messages", code) if chat else (None, None)
    name = getattr(exc, "name", None) or model
    if isinstance(exc, ModelNotFound) and getattr(exc, "version", None) is None and name:
        message = unknown_model(name)
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def openai_error(exc: EngineError, chat: bool = True, model: str | None = None) -> Response:
    """The response for engine error `exc` on a /v1 route (`chat`, `model`: see
    error_object)."""
    status = http_status(exc)
    body = orjson.dumps(error_object(exc, openai_type(exc, status), chat, model))
    return Response(body, status, error_headers(exc), "application/json")


def http_error(
    status: int, message: str, headers: dict[str, str] | None = None, code: str | None = None
) -> Response:
    """The response for a refusal of the HTTP layer's own on a /v1 path (404 for a route that
    does not exist, 405, 500)."""
    body = orjson.dumps(error_body(message, status, code=code))
    return Response(body, status, headers, "application/json")
