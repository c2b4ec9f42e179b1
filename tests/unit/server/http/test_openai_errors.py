"""OpenAI's error object on /v1 routes (the routes run end to end in
tests/integration/test_openai_embeddings_e2e.py and test_openai_e2e.py)."""

from __future__ import annotations

import orjson

from engine.errors import ModelNotFound
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
