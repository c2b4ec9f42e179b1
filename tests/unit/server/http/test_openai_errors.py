"""OpenAI's error object on /v1 routes (the routes run end to end in
tests/integration/test_openai_embeddings_e2e.py and test_openai_e2e.py)."""

from __future__ import annotations

from collections.abc import Callable

import orjson
import pytest

from engine.auth import Authenticator, Principal, digest_key
from engine.errors import (
    EngineError,
    InvalidInput,
    ModelNotFound,
    Overloaded,
    QuotaExceeded,
    RateLimited,
)
from engine.generation.context import completion_budget
from engine.settings import ApiKey, AuthSettings
from server.http.openai_errors import error_object, openai_error
from server.link.frames import error_payload
from server.link.remote_generate import rebuild_error

NAMED = "unknown model 'nope'; GET /v1/models lists the models this key may use"


def test_an_unknown_model_is_named_without_listing_the_repository() -> None:
    exc = ModelNotFound("nope", available=["secret-step", "other"])
    assert error_object(exc, "invalid_request_error") == {
        "error": {"message": NAMED, "type": "invalid_request_error", "param": None,
                  "code": "model_not_found"}
    }  # fmt: skip


def test_an_unknown_model_relayed_from_the_engine_process_is_named_too() -> None:
    # Under --workers the error arrives as a frame: its class and message, not its fields.
    relayed = rebuild_error(error_payload(1, ModelNotFound("nope", available=["secret-step"])))
    reply = openai_error(relayed, model="nope")
    assert reply.status_code == 404
    assert orjson.loads(bytes(reply.body))["error"]["message"] == NAMED
    # Without the request's name it keeps the engine's words rather than fail (it was a 500).
    assert openai_error(relayed).status_code == 404


def test_a_version_s_404_keeps_its_message() -> None:
    exc = ModelNotFound("m", "3", available=["1"])
    assert error_object(exc, "invalid_request_error")["error"]["message"] == exc.message


def raised(call: Callable[[], object]) -> EngineError:
    with pytest.raises(EngineError) as caught:
        call()
    return caught.value


KEYED = Authenticator(AuthSettings(keys=[ApiKey(digest=digest_key("k"), tenant="acme")]))


@pytest.mark.parametrize(
    ("error", "status", "kind", "code"),
    [
        (ModelNotFound("nope"), 404, "invalid_request_error", "model_not_found"),
        (
            raised(lambda: Principal("acme", "user", ("a",)).check_model("b")),
            403,
            "invalid_request_error",
            "model_not_found",
        ),
        (
            raised(lambda: completion_budget(70, 1, 64)),
            400,
            "invalid_request_error",
            "context_length_exceeded",
        ),
        (
            raised(lambda: KEYED.authenticate("wrong")),
            401,
            "invalid_request_error",
            "invalid_api_key",
        ),
        (raised(lambda: KEYED.authenticate(None)), 401, "invalid_request_error", None),
        (RateLimited("slow down", 1.0), 429, "requests", "rate_limit_exceeded"),
        (RateLimited("slow down", 1.0, tokens=True), 429, "tokens", "rate_limit_exceeded"),
        (QuotaExceeded("used up", 60.0), 429, "insufficient_quota", "insufficient_quota"),
        (InvalidInput("bad", "temperature"), 400, "invalid_request_error", None),
        (Overloaded("full"), 503, "server_error", None),
    ],
)
def test_openai_s_type_and_code_are_read_off_the_engine_error(
    error: EngineError, status: int, kind: str, code: str | None
) -> None:
    """The engine's errors say why (their class) and which field; the /v1 routes give each the
    type and code OpenAI's API answers with, which clients test (LangChain tells a context
    overflow by its code)."""
    reply = openai_error(error)
    body = orjson.loads(bytes(reply.body))["error"]
    assert (reply.status_code, body["type"], body["code"]) == (status, kind, code)
    assert body["param"] == (error.param if code != "context_length_exceeded" else "messages")
