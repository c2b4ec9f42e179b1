"""OpenAI's `POST /v1/embeddings` over text-in embedding models: a repository model with one
BYTES input of shape [-1] and one FP32 output of shape [-1, D], as `sluice convert` makes of a
sentence-transformers folder (a tokenizer -> encoder pipeline).

`input` is a string or a list of strings (token-id arrays are refused: such a model takes text),
any number up to MAX_INPUTS; the server splits them into requests of the model's max_batch_size,
which run through the data plane as any inference (authenticated, admitted, batched, counted),
and answers the rows in order. `usage` counts the tokens the pipeline's tokenizer gave the model
(its `tokens` response parameter; 0 for a model without one). `encoding_format` is `float` or
`base64` (the little-endian float32 bytes, as OpenAI sends them); `dimensions` other than D needs
a Matryoshka model (`embeddings: {matryoshka: true}` in its config.yaml), whose rows are cut to
that many and re-normalized where the model's own rows have unit length."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Awaitable, Coroutine, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response

from engine.auth import Principal
from engine.datatypes import received
from engine.errors import EngineError, InvalidInput
from engine.pipeline import TOKENS
from engine.types import InferRequest, InferResponse, ModelMetadata
from engine.validate import InputCheck
from server.dataplane import DataPlane
from server.fields import ABSENT, refused
from server.http.openai_errors import openai_error
from server.ledger import CLIENT_GONE, Headers

T = TypeVar("T")

MAX_INPUTS = 2048
"""Most inputs in one request, as OpenAI allows."""

IN_FLIGHT = 4
"""Batches of one request queued at once: enough to keep the model's batcher busy, few enough
that one large request does not fill its queue for everyone else."""

UNIT_TOLERANCE = 1e-3
"""How far from 1 a row's length may be to count as normalized by the model."""


@dataclass(frozen=True, slots=True)
class EmbeddingModel:
    """A model /v1/embeddings serves: its text input, its embedding output and width."""

    name: str
    text: str
    output: str
    width: int


def as_embedding_model(meta: ModelMetadata) -> EmbeddingModel | None:
    """`meta`'s model as a text-in embedding model, or None when it is not one."""
    if len(meta.inputs) != 1 or len(meta.outputs) != 1:
        return None
    (text,), (output,) = meta.inputs, meta.outputs
    if (text.datatype, text.shape) != ("BYTES", (-1,)):
        return None
    if output.datatype != "FP32" or len(output.shape) != 2 or output.shape[1] <= 0:
        return None
    return EmbeddingModel(meta.name, text.name, output.name, output.shape[1])


async def embedding_models(plane: DataPlane, candidates: Iterable[str]) -> list[str]:
    """Those of `candidates` (loaded models' names) that are text-in embedding models."""
    found = []
    for name in candidates:
        try:
            meta = await plane.engine.model_metadata(name, None)
        except EngineError:
            continue  # unloaded meanwhile
        if as_embedding_model(meta) is not None:
            found.append(name)
    return found


def texts_of(body: Mapping[str, Any], model: str) -> list[str]:
    """The request's texts: `input` as a string or a list of strings."""
    value = body.get("input", ABSENT)
    texts = [value] if isinstance(value, str) else value
    allowed = f"a string or a list of 1 to {MAX_INPUTS} strings"
    if not isinstance(texts, list) or not texts:
        raise refused("input", allowed, value)
    if len(texts) > MAX_INPUTS:
        raise InvalidInput(
            f"input has {len(texts)} items; at most {MAX_INPUTS} are allowed", "input"
        )
    for index, text in enumerate(texts):
        if isinstance(text, str):
            continue
        if type(text) is int or (isinstance(text, list) and all(type(t) is int for t in text)):
            raise InvalidInput(
                f"input is token ids; model '{model}' takes text (its pipeline tokenizes it): "
                "send a string or a list of strings",
                "input",
            )
        raise refused(f"input[{index}]", "a string", text)
    return texts


def options_of(
    body: Mapping[str, Any], model: EmbeddingModel, matryoshka: bool
) -> tuple[bool, int]:
    """(base64, dimensions) as the request asks for them."""
    encoding = body.get("encoding_format")
    if encoding not in (None, "float", "base64"):
        raise refused("encoding_format", "'float' or 'base64'", encoding)
    dimensions = body.get("dimensions")
    if dimensions is None:
        return encoding == "base64", model.width
    if type(dimensions) is not int or not 1 <= dimensions <= model.width:
        raise refused("dimensions", f"an integer from 1 to {model.width}", dimensions)
    if dimensions != model.width and not matryoshka:
        raise InvalidInput(
            f"dimensions {dimensions} is not supported by model '{model.name}': its embeddings "
            f"have {model.width} dimensions and it is not declared a Matryoshka model "
            "(embeddings.matryoshka in its config.yaml)",
            "dimensions",
        )
    return encoding == "base64", dimensions


def shorten(rows: np.ndarray, dimensions: int) -> np.ndarray:
    """The first `dimensions` of each row; a row of unit length (the model normalizes) is
    re-normalized, as a Matryoshka embedding is used."""
    if dimensions == rows.shape[1]:
        return rows
    unit = np.abs(np.linalg.norm(rows, axis=1) - 1) < UNIT_TOLERANCE
    cut = rows[:, :dimensions].copy()
    norms = np.linalg.norm(cut[unit], axis=1, keepdims=True)
    cut[unit] = cut[unit] / np.maximum(norms, 1e-12)
    return cut


@dataclass(slots=True)
class EmbeddingCall:
    """One batch of a /v1/embeddings request as the data plane's InferCall."""

    model: str
    headers: Headers  # for the trace context: the caller is authenticated already
    request: InferRequest
    protocol: str = "http"
    version: str | None = None
    span_name: str = "POST /v1/embeddings"
    access: str = "/v1/embeddings"

    async def decode(self, check: InputCheck) -> InferRequest:
        check({name: a.shape for name, a in self.request.inputs.items()}, self.request.datatypes)
        return self.request

    def encode(self, response: InferResponse) -> InferResponse:
        return response

    async def wait(self, answer: Awaitable[InferResponse]) -> InferResponse:
        return await answer


async def embed(
    plane: DataPlane,
    caller: tuple[Principal, Headers],
    model: EmbeddingModel,
    texts: list[str],
    max_batch: int,
) -> tuple[np.ndarray, int]:
    """(rows in order, tokens) for `texts`, in requests of at most `max_batch` rows; the first
    refused request's error (the others are cancelled)."""
    size = max_batch if max_batch > 0 else len(texts)
    gate = asyncio.Semaphore(IN_FLIGHT)

    async def run(chunk: list[str]) -> InferResponse:
        array = np.empty(len(chunk), dtype=object)
        array[:] = [text.encode() for text in chunk]
        request = InferRequest(model.name, {model.text: array}, {model.text: "BYTES"})
        async with gate:
            call = EmbeddingCall(model.name, caller[1], request)
            answer: InferResponse = await plane.infer(call, caller[0])
        return answer

    try:
        async with asyncio.TaskGroup() as group:
            tasks = [
                group.create_task(run(texts[i : i + size])) for i in range(0, len(texts), size)
            ]
    except BaseExceptionGroup as failed:
        raise failed.exceptions[0] from None
    answers = [task.result() for task in tasks]
    rows = np.concatenate([np.asarray(a.outputs[model.output], np.float32) for a in answers])
    tokens = sum(int(a.parameters.get(TOKENS, 0)) for a in answers)
    return rows, tokens


async def unless_gone(request: Request, work: Coroutine[Any, Any, T]) -> T | None:
    """`work`'s result, or None when the client disconnects first: the work is cancelled then,
    so a client that leaves a large call does not leave its batches queued and running."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        return None
    return task.result()


def answer_body(name: str, rows: np.ndarray, tokens: int, as_base64: bool) -> dict[str, Any]:
    data: list[dict[str, Any]] = []
    for index, row in enumerate(rows):
        vector: Any = base64.b64encode(row.astype("<f4").tobytes()).decode() if as_base64 else row
        data.append({"object": "embedding", "index": index, "embedding": vector})
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    return {"object": "list", "data": data, "model": name, "usage": usage}


async def _body(request: Request) -> dict[str, Any]:
    try:
        body = orjson.loads(await request.body())
    except orjson.JSONDecodeError as exc:
        raise InvalidInput(f"the request body is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise InvalidInput(f"the request body must be a JSON object; got {received(body)}")
    return body


def embeddings_router(plane: DataPlane) -> APIRouter:
    """`POST /v1/embeddings` over `plane`."""
    router = APIRouter()

    @router.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        name: Any = None
        try:
            principal = plane.authenticate(request.headers)  # before the body is read
            body = await _body(request)
            name = body.get("model", ABSENT)
            if not isinstance(name, str) or not name:
                raise refused("model", "a model name (string)", name)
            principal.check_model(name)
            model = as_embedding_model(await plane.engine.model_metadata(name, None))
            if model is None:
                raise InvalidInput(
                    f"model '{name}' is not a text embedding model (one BYTES input of shape "
                    "[-1], one FP32 output of shape [-1, D]); /v1/models lists those this key "
                    "may use",
                    "model",
                )
            config = await plane.engine.model_config(name, None)
            matryoshka = _matryoshka(config)
            as_base64, dimensions = options_of(body, model, matryoshka)
            texts = texts_of(body, name)
            max_batch = int(config["max_batch_size"])
            who = (principal, request.headers)
            done = await unless_gone(request, embed(plane, who, model, texts, max_batch))
        except EngineError as exc:
            return openai_error(exc, model=name if isinstance(name, str) else None)
        if done is None:  # nobody is left to answer; its batches were withdrawn
            return Response(status_code=CLIENT_GONE)
        rows, tokens = done
        rows = shorten(rows, dimensions)
        payload = answer_body(name, rows, tokens, as_base64)
        encoded = await asyncio.to_thread(orjson.dumps, payload, option=orjson.OPT_SERIALIZE_NUMPY)
        return Response(encoded, media_type="application/json")

    return router


def _matryoshka(config: Mapping[str, Any]) -> bool:
    """Whether the model's config.yaml declares it a Matryoshka model (Triton's config carries
    sluice's own as the `sluice_config` parameter, JSON of the keys set)."""
    own = config.get("parameters", {}).get("sluice_config", {}).get("string_value", "{}")
    return bool(orjson.loads(own).get("embeddings", {}).get("matryoshka", False))
