"""/v1/embeddings' request checks and row handling (the route runs end to end in
tests/integration/test_openai_embeddings_e2e.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import orjson
import pytest
from fastapi import FastAPI

from engine.auth import Authenticator, Principal
from engine.errors import InvalidInput
from engine.settings import AuthSettings
from engine.types import InferResponse, ModelMetadata, TensorSpec
from server.auth_headers import authenticate_headers
from server.http.embeddings import (
    MAX_INPUTS,
    EmbeddingModel,
    as_embedding_model,
    embeddings_router,
    options_of,
    shorten,
    texts_of,
)
from server.ledger import CLIENT_GONE

TEXT = TensorSpec("text", "BYTES", (-1,))
ROWS = TensorSpec("embeddings", "FP32", (-1, 4))
MODEL = EmbeddingModel("m", "text", "embeddings", 4)


def meta(inputs: tuple[TensorSpec, ...], outputs: tuple[TensorSpec, ...]) -> ModelMetadata:
    return ModelMetadata("m", ("1",), "ensemble", inputs, outputs)


def test_a_text_in_embedding_model_is_recognized() -> None:
    assert as_embedding_model(meta((TEXT,), (ROWS,))) == MODEL


@pytest.mark.parametrize(
    ("inputs", "outputs"),
    [
        ((TensorSpec("ids", "INT64", (-1, -1)),), (ROWS,)),  # an encoder step
        ((TEXT,), (ROWS, TensorSpec("labels", "BYTES", (-1,)))),  # a classifier
        ((TEXT,), (TensorSpec("ids", "INT64", (-1, -1)),)),  # a tokenizer
        ((TEXT,), (TensorSpec("e", "FP32", (-1, -1)),)),  # no fixed width
        ((TensorSpec("text", "BYTES", (-1, 2)),), (ROWS,)),
    ],
)
def test_other_models_are_not_embedding_models(
    inputs: tuple[TensorSpec, ...], outputs: tuple[TensorSpec, ...]
) -> None:
    assert as_embedding_model(meta(inputs, outputs)) is None


def test_input_is_a_string_or_a_list_of_strings() -> None:
    assert texts_of({"input": "a"}, "m") == ["a"]
    assert texts_of({"input": ["a", ""]}, "m") == ["a", ""]


@pytest.mark.parametrize("ids", [[1, 2], [[1, 2], [3]]])
def test_token_ids_are_refused_naming_the_model(ids: object) -> None:
    with pytest.raises(InvalidInput, match=r"^input is token ids; model 'm' takes text") as caught:
        texts_of({"input": ids}, "m")
    assert caught.value.param == "input"


def test_more_inputs_than_allowed_are_refused() -> None:
    with pytest.raises(InvalidInput, match=rf"^input has {MAX_INPUTS + 1} items; at most"):
        texts_of({"input": ["a"] * (MAX_INPUTS + 1)}, "m")


def test_a_missing_input_is_named_as_missing() -> None:
    with pytest.raises(InvalidInput, match=r"^input is required: a string or a list"):
        texts_of({}, "m")


def test_options_default_to_float_and_the_full_width() -> None:
    assert options_of({}, MODEL, matryoshka=False) == (False, 4)
    assert options_of({"encoding_format": "base64", "dimensions": 4}, MODEL, False) == (True, 4)
    assert options_of({"encoding_format": None, "dimensions": 2}, MODEL, True) == (False, 2)


@pytest.mark.parametrize(
    ("dimensions", "shown"), [(0, "0"), (5, "5"), (2.0, "2.0"), (True, "true")]
)
def test_dimensions_out_of_range_are_named_as_sent(dimensions: object, shown: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        options_of({"dimensions": dimensions}, MODEL, matryoshka=True)
    assert caught.value.message == f"dimensions must be an integer from 1 to 4; got {shown}"


def test_shorten_renormalizes_unit_rows_only() -> None:
    unit = np.array([0.5, 0.5, 0.5, 0.5], np.float32)
    raw = np.array([3.0, 4.0, 1.0, 1.0], np.float32)  # the model does not normalize this row
    got = shorten(np.stack([unit, raw]), 2)
    np.testing.assert_allclose(got[0], [2**-0.5, 2**-0.5], rtol=1e-6)
    np.testing.assert_array_equal(got[1], [3.0, 4.0])
    full = np.stack([unit, raw])
    assert shorten(full, 4) is full


class FakeEngine:
    """The engine as the route sees it: one embedding model `m`, 2 rows per batch."""

    async def model_metadata(self, name: str, version: str | None) -> ModelMetadata:
        return meta((TEXT,), (ROWS,))

    async def model_config(self, name: str, version: str | None) -> dict[str, Any]:
        return {"max_batch_size": 2, "parameters": {}}


class HeldPlane:
    """A data plane whose inference never answers: it counts the batches started and
    cancelled."""

    engine = FakeEngine()

    def __init__(self, batches: int) -> None:
        self.started = self.cancelled = 0
        self.all_started = asyncio.Event()
        self.batches = batches

    def authenticate(self, who: object, model: str | None = None) -> Principal:
        return authenticate_headers(Authenticator(AuthSettings()), {})

    async def infer(self, call: object, principal: Principal) -> InferResponse:
        self.started += 1
        if self.started == self.batches:
            self.all_started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        raise AssertionError("unreachable")


async def test_a_client_that_leaves_cancels_its_batches() -> None:
    plane = HeldPlane(batches=3)
    app = FastAPI()
    app.include_router(embeddings_router(plane))  # type: ignore[arg-type]
    body = orjson.dumps({"model": "m", "input": ["a", "b", "c", "d", "e", "f"]})
    messages = [{"type": "http.request", "body": body, "more_body": False}]
    gone = asyncio.Event()

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop(0)
        await gone.wait()
        return {"type": "http.disconnect"}

    sent: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/embeddings", "headers": [],
             "query_string": b"", "http_version": "1.1", "scheme": "http", "root_path": "",
             "server": ("test", 80), "client": ("client", 1)}  # fmt: skip
    served = asyncio.create_task(app(scope, receive, send))  # type: ignore[arg-type]
    async with asyncio.timeout(10):
        await plane.all_started.wait()  # 6 texts, 2 a batch: 3 batches queued
        gone.set()
        await served  # it hung here: the batches ran on with nobody to answer
    assert (plane.started, plane.cancelled) == (3, 3)
    assert sent[0]["status"] == CLIENT_GONE
