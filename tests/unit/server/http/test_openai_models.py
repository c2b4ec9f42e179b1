"""server.http.openai_models: `GET /v1/models` lists the generative models, then the text-in
embedding models, that the caller's key may use; `GET /v1/models/{id}` answers one of them or a
404 naming it (over a plane faked at its seam; the routes run against a real server in
tests/integration/test_openai_e2e.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from engine.auth import Principal
from engine.errors import ModelNotFound, Unauthenticated
from engine.types import ModelMetadata, TensorSpec
from server.http.openai_models import model_object, models_router, served_models

EMBEDDING = ModelMetadata(
    "emb", ("1",), "ensemble", (TensorSpec("text", "BYTES", (-1,)),),
    (TensorSpec("embeddings", "FP32", (-1, 4)),),
)  # fmt: skip
TENSORS = ModelMetadata(
    "mlp", ("1",), "onnxruntime_onnx", (TensorSpec("x", "FP32", (-1, 4)),),
    (TensorSpec("y", "FP32", (-1, 2)),),
)  # fmt: skip


class Engine:
    """Loaded: an embedding model, a tensor model, a generative model (listed in the index too)
    and a model that goes away between the index and its metadata."""

    async def repository_index(self, ready_only: bool = False) -> list[dict[str, str]]:
        assert ready_only
        return [{"name": name} for name in ("mlp", "emb", "gone", "gpt", "bert")]

    async def model_metadata(self, name: str, version: str | None) -> ModelMetadata:
        if name == "gone":
            raise ModelNotFound(name)
        return EMBEDDING if name in ("emb", "bert") else TENSORS


class Plane:
    engine = Engine()

    def __init__(self, principal: Principal) -> None:
        self.principal = principal

    def generative_models(self) -> list[str]:
        return ["gpt", "llama"]

    def authenticate(self, headers: Mapping[str, str]) -> Principal:
        if headers.get("authorization") == "Bearer wrong":
            raise Unauthenticated("invalid API key")
        return self.principal


ANYONE = Principal("default", "user")
ONLY = Principal("t", "user", models=("llama", "bert", "mlp"))


def test_a_model_object_is_openais() -> None:
    expected = {"id": "gpt", "object": "model", "created": 0, "owned_by": "sluice"}
    assert model_object("gpt") == expected


@pytest.mark.parametrize(
    ("principal", "names"),
    [(ANYONE, ["gpt", "llama", "bert", "emb"]), (ONLY, ["llama", "bert"])],
)
async def test_generative_then_embedding_models_the_caller_may_use(
    principal: Principal, names: list[str]
) -> None:
    assert await served_models(Plane(principal), principal) == names  # type: ignore[arg-type]


async def get(principal: Principal, path: str, **headers: str) -> httpx.Response:
    app = FastAPI()
    app.include_router(models_router(Plane(principal)))  # type: ignore[arg-type]
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return await client.get(path, headers=headers)


async def test_the_list_and_one_model() -> None:
    listed = (await get(ONLY, "/v1/models")).json()
    assert listed == {"object": "list", "data": [model_object("llama"), model_object("bert")]}
    one = await get(ONLY, "/v1/models/bert")
    assert (one.status_code, one.json()) == (200, model_object("bert"))


async def test_a_model_not_served_to_the_caller_is_a_404_naming_it() -> None:
    for name in ("gpt", "mlp", "nope"):  # another key's, not an OpenAI model, none at all
        answer = await get(ONLY, f"/v1/models/{name}")
        assert answer.status_code == 404
        error: dict[str, Any] = answer.json()["error"]
        assert error["message"].startswith(f"unknown model '{name}'")


async def test_an_unauthenticated_caller_is_refused_as_openai_refuses_it() -> None:
    for path in ("/v1/models", "/v1/models/gpt"):
        answer = await get(ANYONE, path, authorization="Bearer wrong")
        assert answer.status_code == 401
        assert answer.json()["error"]["message"] == "invalid API key"
