"""OpenAI's /v1/embeddings and model list end to end: a sentence-transformers folder converted by
the real `sluice convert`, served by a real `sluice serve`, called with the official `openai`
client and httpx. Embeddings equal `SentenceTransformer.encode` for 200 texts in one call (the
pipeline's max batch is 64: the server splits them); base64 is the same float32 bytes; a
Matryoshka pipeline over the same steps answers `dimensions`."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.hf_models import MAX_SEQ_LENGTH, sentence_transformer_folder
from tests.integration.test_hf_convert_serve import convert
from tests.servers import ServerProcess
from tests.text_models import SENTENCES

WIDTH = 32
"""The tiny BERT's hidden size: the embedding's width."""

TEXTS = [
    f"{SENTENCES[i % len(SENTENCES)]} {' '.join(['again'] * (i % 13))} {i}" for i in range(200)
]
"""200 different texts, some past MAX_SEQ_LENGTH tokens (cut, as encode cuts them)."""


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sentence_transformer_folder(tmp_path_factory.mktemp("hf") / "mini-st")


@pytest.fixture(scope="module")
def server(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    repository = tmp_path_factory.mktemp("repository")
    convert(folder, repository, "embedder")
    # A second pipeline over the same steps, declared a Matryoshka model.
    (repository / "mrl").mkdir()
    pipeline = (repository / "embedder" / "config.yaml").read_text()
    (repository / "mrl" / "config.yaml").write_text(pipeline + "embeddings: {matryoshka: true}\n")
    log = tmp_path_factory.mktemp("log") / "server.log"
    process = ServerProcess("--model-repository", str(repository), log_path=log, grpc=False)
    process.start(timeout_s=120)
    yield process
    process.stop()


@pytest.fixture(scope="module")
def encoded(folder: Path) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(folder), device="cpu")
    return np.asarray(model.encode(TEXTS), np.float32)


def client(server: ServerProcess) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def token_count(folder: Path, texts: list[str]) -> int:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    return sum(min(len(e.ids), MAX_SEQ_LENGTH) for e in tokenizer.encode_batch(texts))


def post(server: ServerProcess, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/embeddings", json=body, timeout=60)


def test_200_texts_in_one_call_equal_encode_in_order(
    server: ServerProcess, folder: Path, encoded: np.ndarray
) -> None:
    answer = client(server).embeddings.create(
        model="embedder", input=TEXTS, encoding_format="float"
    )
    assert [item.index for item in answer.data] == list(range(200))
    got = np.array([item.embedding for item in answer.data], np.float32)
    assert got.shape == (200, WIDTH)
    np.testing.assert_allclose(got, encoded, atol=1e-5)
    assert answer.model == "embedder"
    tokens = token_count(folder, TEXTS)
    assert tokens > 200 * 3  # special tokens and words, some rows cut to MAX_SEQ_LENGTH
    assert (answer.usage.prompt_tokens, answer.usage.total_tokens) == (tokens, tokens)


def test_base64_is_the_little_endian_float32_of_the_floats(
    server: ServerProcess, encoded: np.ndarray
) -> None:
    texts = TEXTS[:70]  # two batches
    floats = post(server, {"model": "embedder", "input": texts}).json()
    packed = post(server, {"model": "embedder", "input": texts, "encoding_format": "base64"})
    assert packed.status_code == 200, packed.text
    rows = [np.frombuffer(base64.b64decode(d["embedding"]), "<f4") for d in packed.json()["data"]]
    np.testing.assert_array_equal(
        np.stack(rows), np.array([d["embedding"] for d in floats["data"]], np.float32)
    )
    # The openai client asks for base64 by default and decodes it itself.
    answer = client(server).embeddings.create(model="embedder", input=texts)
    got = np.array([item.embedding for item in answer.data], np.float32)
    np.testing.assert_array_equal(got, np.stack(rows))
    np.testing.assert_allclose(got, encoded[:70], atol=1e-5)


def test_one_string_is_one_embedding(server: ServerProcess, encoded: np.ndarray) -> None:
    answer = client(server).embeddings.create(model="embedder", input=TEXTS[5])
    assert len(answer.data) == 1
    np.testing.assert_allclose(answer.data[0].embedding, encoded[5], atol=1e-5)


def test_dimensions_cut_and_renormalize_a_matryoshka_model(
    server: ServerProcess, encoded: np.ndarray
) -> None:
    answer = client(server).embeddings.create(
        model="mrl", input=TEXTS[:10], dimensions=8, encoding_format="float"
    )
    got = np.array([item.embedding for item in answer.data], np.float32)
    cut = encoded[:10, :8]
    np.testing.assert_allclose(got, cut / np.linalg.norm(cut, axis=1, keepdims=True), atol=1e-5)
    full = post(server, {"model": "embedder", "input": TEXTS[:2], "dimensions": WIDTH})
    assert full.status_code == 200, full.text  # the full width asks for nothing


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"model": "embedder", "input": "x", "dimensions": 8}, "dimensions",
         "dimensions 8 is not supported by model 'embedder': its embeddings have 32 dimensions "
         "and it is not declared a Matryoshka model (embeddings.matryoshka in its config.yaml)"),
        ({"model": "mrl", "input": "x", "dimensions": 33}, "dimensions",
         "dimensions must be an integer from 1 to 32; got 33"),
        ({"model": "embedder", "input": [[1, 2, 3]]}, "input",
         "input is token ids; model 'embedder' takes text (its pipeline tokenizes it): send a "
         "string or a list of strings"),
        ({"model": "embedder", "input": []}, "input",
         "input must be a string or a list of 1 to 2048 strings; got []"),
        ({"model": "embedder", "input": ["a", None]}, "input[1]",
         "input[1] must be a string; got null"),
        ({"model": "embedder", "input": "x", "encoding_format": "int8"}, "encoding_format",
         "encoding_format must be 'float' or 'base64'; got 'int8'"),
        ({"model": "embedder-encoder", "input": "x"}, "model",
         "model 'embedder-encoder' is not a text embedding model (one BYTES input of shape "
         "[-1], one FP32 output of shape [-1, D]); /v1/models lists those this key may use"),
    ],
)  # fmt: skip
def test_bad_requests_are_400_naming_the_field(
    server: ServerProcess, body: dict[str, Any], param: str, message: str
) -> None:
    reply = post(server, body)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error == {"message": message, "type": "invalid_request_error", "param": param,
                     "code": None}  # fmt: skip


def test_unknown_fields_are_ignored(server: ServerProcess, encoded: np.ndarray) -> None:
    reply = post(server, {"model": "embedder", "input": TEXTS[0], "user": "u", "novel": 1})
    assert reply.status_code == 200, reply.text
    np.testing.assert_allclose(reply.json()["data"][0]["embedding"], encoded[0], atol=1e-5)


def test_models_lists_the_embedding_pipelines_not_their_steps(server: ServerProcess) -> None:
    listed = client(server).models.list()
    assert [m.id for m in listed.data] == ["embedder", "mrl"]
    one = client(server).models.retrieve("mrl")
    assert (one.id, one.object, one.owned_by) == ("mrl", "model", "sluice")


@pytest.mark.parametrize("name", ["embedder-encoder", "nope"])
def test_a_model_not_served_is_404_naming_only_it(server: ServerProcess, name: str) -> None:
    from openai import NotFoundError

    with pytest.raises(NotFoundError) as caught:
        client(server).models.retrieve(name)
    error = caught.value.body
    assert error == {
        "message": f"unknown model '{name}'; GET /v1/models lists the models this key may use",
        "type": "invalid_request_error",
        "param": None,
        "code": "model_not_found",
    }
    reply = post(server, {"model": "nope", "input": "x"})
    assert reply.status_code == 404
    assert "embedder" not in reply.text  # the repository is not listed


def test_an_unknown_v1_route_is_openai_s_404(server: ServerProcess) -> None:
    reply = httpx.get(f"{server.url}/v1/nothing/here")
    assert reply.status_code == 404
    assert reply.json() == {
        "error": {
            "message": "Unknown request URL: GET /v1/nothing/here",
            "type": "invalid_request_error",
            "param": None,
            "code": "unknown_url",
        }
    }
    wrong_method = httpx.get(f"{server.url}/v1/embeddings")
    assert wrong_method.status_code == 405
    assert wrong_method.json()["error"]["type"] == "invalid_request_error"
    v2 = httpx.get(f"{server.url}/v2/models/nope").json()  # KServe's routes keep their shape
    assert v2["error"].startswith("unknown model 'nope'")


def test_embeddings_and_models_through_workers(
    server: ServerProcess, encoded: np.ndarray, tmp_path: Path
) -> None:
    # The same repository served by two worker processes: metadata, config and each batch are
    # relayed to the engine process, the token counts with them.
    repository = Path(server.args[server.args.index("--model-repository") + 1])
    process = ServerProcess(
        "--workers", "2", "--model-repository", str(repository),
        log_path=tmp_path / "workers.log", grpc=False,
    ).start(timeout_s=120)  # fmt: skip
    try:
        reply = post(process, {"model": "mrl", "input": TEXTS[:100], "encoding_format": "float"})
        assert reply.status_code == 200, reply.text
        got = np.array([d["embedding"] for d in reply.json()["data"]], np.float32)
        np.testing.assert_allclose(got, encoded[:100], atol=1e-5)
        tokens = post(server, {"model": "mrl", "input": TEXTS[:100]}).json()["usage"]
        assert reply.json()["usage"] == tokens
        assert [m.id for m in client(process).models.list().data] == ["embedder", "mrl"]
        # Relayed from the engine process, an unknown model is still named and only named (it
        # was a 500 on the chat and completion routes).
        for path, body in [
            ("/v1/embeddings", {"model": "nope", "input": "x"}),
            ("/v1/completions", {"model": "embedder-encoder", "prompt": "x"}),
        ]:
            reply = httpx.post(f"{process.url}{path}", json=body, timeout=30)
            assert reply.status_code == 404, reply.text
            name = body["model"]
            assert reply.json()["error"]["message"] == (
                f"unknown model '{name}'; GET /v1/models lists the models this key may use"
            )
    finally:
        process.stop()
