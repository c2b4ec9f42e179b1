"""Hugging Face encoder folders converted with the real `sluice convert` command and served by a
real `sluice serve` (no Python steps allowed): served embeddings, logits and labels equal the
source's own (sentence-transformers `encode`, the transformers forward) over KServe v2 JSON,
concurrent one-text requests that the batcher pads into shared batches, tritonclient http and
tritonclient grpc (in a child process, see test_tritonclient.py for why)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from click.testing import CliRunner

from server.cli import main as sluice
from tests.hf_models import (
    LABELS,
    MAX_SEQ_LENGTH,
    classifier_folder,
    sentence_transformer_folder,
)
from tests.servers import ServerProcess

TEXTS = [
    "the quick brown fox",
    "",
    "a classifier answers with one label per text, and embeddings place similar sentences close",
    " ".join(["long texts are cut at the model's maximum length"] * 5),
    "café 東京 🙂",
]


def convert(folder: Path, repository: Path, name: str) -> None:
    """`sluice convert`, dispatched by the `sluice` command, in this process: the folders were
    built here, so torch and transformers are imported already (a child process spent seconds
    importing them again; the conversion itself takes well under one)."""
    args = ["convert", str(folder), "--name", name, "--repository", str(repository),
            "--measure-iterations", "0"]  # fmt: skip
    result = CliRunner().invoke(sluice, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {
        "st": sentence_transformer_folder(root / "mini-st"),
        "cls": classifier_folder(root / "mini-cls"),
    }


@pytest.fixture(scope="module")
def server(
    folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    repository = tmp_path_factory.mktemp("repository")
    convert(folders["st"], repository, "embedder")
    convert(folders["cls"], repository, "sentiment")
    log = tmp_path_factory.mktemp("log") / "server.log"
    process = ServerProcess("--model-repository", str(repository), log_path=log)
    process.start(timeout_s=120)
    yield process
    process.stop()


def source_embeddings(folders: dict[str, Path], texts: list[str]) -> np.ndarray:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(folders["st"]), device="cpu")
    return np.asarray(model.encode(texts), np.float32)


def source_logits(folders: dict[str, Path], texts: list[str]) -> np.ndarray:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(folders["cls"]).eval()
    tokenizer = AutoTokenizer.from_pretrained(folders["cls"])
    with torch.no_grad():
        encoded = tokenizer(texts, padding=True, truncation=True, return_tensors="pt")
        return np.asarray(model(**encoded).logits.numpy(), np.float32)


def infer(server: ServerProcess, model: str, texts: list[str]) -> dict[str, Any]:
    tensor = {"name": "text", "datatype": "BYTES", "shape": [len(texts)], "data": texts}
    response = httpx.post(
        f"{server.url}/v2/models/{model}/infer", json={"inputs": [tensor]}, timeout=60
    )
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def output(body: dict[str, Any], name: str) -> np.ndarray:
    (found,) = [o for o in body["outputs"] if o["name"] == name]
    dtype = object if found["datatype"] == "BYTES" else np.float32
    return np.array(found["data"], dtype).reshape(found["shape"])


def test_embeddings_over_json_equal_encode(server: ServerProcess, folders: dict[str, Path]) -> None:
    body = infer(server, "embedder", TEXTS)
    got = output(body, "embeddings")
    assert got.shape == (len(TEXTS), 32)
    np.testing.assert_allclose(got, source_embeddings(folders, TEXTS), atol=1e-5)
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(folders["st"] / "tokenizer.json"))
    lengths = [len(e.ids) for e in tokenizer.encode_batch(TEXTS)]
    cut = sum(length > MAX_SEQ_LENGTH for length in lengths)
    assert cut >= 1
    tokens = sum(min(length, MAX_SEQ_LENGTH) for length in lengths)
    # Long texts are cut, as encode cuts them; `tokens` counts what the model was given.
    assert body["parameters"] == {"truncated_rows": cut, "tokens": tokens}
    metadata = httpx.get(f"{server.url}/v2/models/embedder").json()
    assert metadata["inputs"] == [{"name": "text", "datatype": "BYTES", "shape": [-1]}]
    assert metadata["outputs"] == [{"name": "embeddings", "datatype": "FP32", "shape": [-1, 32]}]


def test_concurrent_single_texts_share_padded_batches_and_keep_their_rows(
    server: ServerProcess, folders: dict[str, Path]
) -> None:
    rng = np.random.default_rng(7)
    words = " ".join(TEXTS).split()
    texts = [" ".join(rng.choice(words, int(rng.integers(1, 12)))) for _ in range(48)]
    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(lambda t: output(infer(server, "embedder", [t]), "embeddings"), texts))
    np.testing.assert_allclose(np.concatenate(got), source_embeddings(folders, texts), atol=1e-5)


def test_classifier_logits_and_labels_over_json(
    server: ServerProcess, folders: dict[str, Path]
) -> None:
    body = infer(server, "sentiment", TEXTS)
    want = source_logits(folders, TEXTS)
    np.testing.assert_allclose(output(body, "logits"), want, rtol=1e-4, atol=1e-5)
    assert list(output(body, "labels")) == [LABELS[int(i)] for i in want.argmax(axis=1)]
    metadata = httpx.get(f"{server.url}/v2/models/sentiment").json()
    assert metadata["outputs"] == [
        {"name": "logits", "datatype": "FP32", "shape": [-1, len(LABELS)]},
        {"name": "labels", "datatype": "BYTES", "shape": [-1]},
    ]


def test_tritonclient_http_binary_and_json(server: ServerProcess, folders: dict[str, Path]) -> None:
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
    want = source_embeddings(folders, TEXTS)
    for binary in (False, True):
        tensor = httpclient.InferInput("text", [len(TEXTS)], "BYTES")
        tensor.set_data_from_numpy(np.array([t.encode() for t in TEXTS], object), binary)
        outputs = [httpclient.InferRequestedOutput("embeddings", binary_data=binary)]
        result = client.infer("embedder", [tensor], outputs=outputs)
        np.testing.assert_allclose(result.as_numpy("embeddings"), want, atol=1e-5)
    tensor = httpclient.InferInput("text", [len(TEXTS)], "BYTES")
    tensor.set_data_from_numpy(np.array([t.encode() for t in TEXTS], object), True)
    result = client.infer("sentiment", [tensor])
    labels = [LABELS[int(i)] for i in source_logits(folders, TEXTS).argmax(axis=1)]
    assert [label.decode() for label in result.as_numpy("labels")] == labels
    client.close()


def tritonclient_grpc(url: str) -> dict[str, Any]:
    """The tritonclient.grpc calls; runs in a child process (it clashes with sluice's protos)."""
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    tensor = grpcclient.InferInput("text", [len(TEXTS)], "BYTES")
    tensor.set_data_from_numpy(np.array([t.encode() for t in TEXTS], object))
    embedded = client.infer("embedder", [tensor]).as_numpy("embeddings")
    classified = client.infer("sentiment", [tensor])
    return {
        "embeddings": embedded.tolist(),
        "logits": classified.as_numpy("logits").tolist(),
        "labels": [label.decode() for label in classified.as_numpy("labels")],
    }


def test_tritonclient_grpc(server: ServerProcess, folders: dict[str, Path]) -> None:
    child = subprocess.run(
        [sys.executable, __file__, server.grpc_url],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    assert child.returncode == 0, child.stderr
    out = json.loads(child.stdout)
    np.testing.assert_allclose(
        np.array(out["embeddings"], np.float32), source_embeddings(folders, TEXTS), atol=1e-5
    )
    want = source_logits(folders, TEXTS)
    np.testing.assert_allclose(np.array(out["logits"], np.float32), want, rtol=1e-4, atol=1e-5)
    assert out["labels"] == [LABELS[int(i)] for i in want.argmax(axis=1)]


if __name__ == "__main__":
    print(json.dumps(tritonclient_grpc(sys.argv[1])))
