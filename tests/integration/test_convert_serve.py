"""Models converted by `sluice convert` and served by a real `sluice serve` answer over HTTP as
their source models do: a PyTorch CNN, a transformer encoder converted to fp16, and a
scikit-learn pipeline."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import joblib
import numpy as np
import pytest
import torch
from click.testing import CliRunner
from sklearn.datasets import load_iris
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import Pipeline, make_pipeline
from sklearn.preprocessing import StandardScaler

from converters.cli import convert
from tests.servers import ServerProcess
from tests.unit.converters import nets

NETS = Path(nets.__file__)


def run_convert(*args: str | Path) -> None:
    result = CliRunner().invoke(convert, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == 0, result.output


@pytest.fixture(scope="module")
def iris_pipeline() -> Pipeline:
    x, y = load_iris(return_X_y=True)
    return make_pipeline(StandardScaler(), LogisticRegression(max_iter=1000)).fit(x, y)


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, iris_pipeline: Pipeline
) -> Iterator[ServerProcess]:
    """A repository written by `sluice convert` only, served by a real server."""
    root = tmp_path_factory.mktemp("convert-serve")
    repository = root / "models"
    common: list[str | Path] = [
        "--repository",
        repository,
        "--measure-iterations",
        "0",
        "--samples",
        "8",
    ]
    run_convert(f"{NETS}:build_cnn", "--input", "image:FP32:-1,3,16,16", "--name", "cnn",
                "--max-batch-size", "8", *common)  # fmt: skip
    run_convert(f"{NETS}:build_encoder", "--input", "input_ids:INT64:batch,sequence=12:0..100",
                "--name", "encoder", "--precision", "fp16", "--max-batch-size", "8",
                "--pad", "input_ids:1:0", *common)  # fmt: skip
    joblib.dump(iris_pipeline, root / "iris.joblib")
    run_convert(root / "iris.joblib", "--trust-pickle", "--name", "iris", *common)
    process = ServerProcess("--model-repository", str(repository), log_path=root / "server.log")
    process.start()
    yield process
    process.stop()


def tensor(name: str, array: np.ndarray, datatype: str) -> dict[str, Any]:
    return {"name": name, "shape": list(array.shape), "datatype": datatype,
            "data": array.ravel().tolist()}  # fmt: skip


def outputs(body: dict[str, Any]) -> dict[str, np.ndarray]:
    return {o["name"]: np.asarray(o["data"]).reshape(o["shape"]) for o in body["outputs"]}


def infer(server: ServerProcess, model: str, inputs: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    response = httpx.post(f"{server.url}/v2/models/{model}/infer", json={"inputs": inputs},
                          timeout=30)  # fmt: skip
    assert response.status_code == 200, response.text
    return outputs(response.json())


def test_cnn_answers_as_the_torch_module(server: ServerProcess) -> None:
    module = nets.build_cnn()
    for batch in (1, 3, 8):
        image = np.random.default_rng(batch).standard_normal((batch, 3, 16, 16)).astype(np.float32)
        served = infer(server, "cnn", [tensor("image", image, "FP32")])["output"]
        with torch.inference_mode():
            expected = module(torch.from_numpy(image)).numpy()
        assert served.shape == (batch, 10)
        np.testing.assert_allclose(served, expected, rtol=1e-3, atol=1e-4)


async def test_concurrent_requests_batched_by_the_server_each_get_their_answer(
    server: ServerProcess,
) -> None:
    module = nets.build_cnn()
    images = [
        np.random.default_rng(100 + i).standard_normal((1 + i % 3, 3, 16, 16)).astype(np.float32)
        for i in range(12)
    ]
    async with httpx.AsyncClient(base_url=server.url) as client:

        async def one(image: np.ndarray) -> dict[str, np.ndarray]:
            async with asyncio.timeout(30):
                response = await client.post(
                    "/v2/models/cnn/infer", json={"inputs": [tensor("image", image, "FP32")]}
                )
            assert response.status_code == 200, response.text
            return outputs(response.json())

        answers = await asyncio.gather(*(one(image) for image in images))
    for image, answer in zip(images, answers, strict=True):
        with torch.inference_mode():
            expected = module(torch.from_numpy(image)).numpy()
        np.testing.assert_allclose(answer["output"], expected, rtol=1e-3, atol=1e-4)


def test_fp16_encoder_answers_as_the_torch_module(server: ServerProcess) -> None:
    module = nets.build_encoder()
    tokens = np.random.default_rng(5).integers(0, 100, (4, 12))
    served = infer(server, "encoder", [tensor("input_ids", tokens, "INT64")])["output"]
    with torch.inference_mode():
        expected = module(torch.from_numpy(tokens)).numpy()
    assert served.shape == (4, 4)
    np.testing.assert_allclose(served, expected, rtol=1e-2, atol=1e-2)


def test_sklearn_pipeline_answers_as_sklearn(
    server: ServerProcess, iris_pipeline: Pipeline
) -> None:
    features = load_iris().data[::7].astype(np.float32)
    served = infer(server, "iris", [tensor("input", features, "FP32")])
    np.testing.assert_array_equal(served["label"], iris_pipeline.predict(features))
    np.testing.assert_allclose(
        served["probabilities"], iris_pipeline.predict_proba(features), rtol=1e-4, atol=1e-5
    )


def test_served_metadata_matches_the_conversion(server: ServerProcess) -> None:
    metadata = httpx.get(f"{server.url}/v2/models/encoder", timeout=10).json()
    assert metadata["inputs"] == [{"name": "input_ids", "datatype": "INT64", "shape": [-1, -1]}]
    assert metadata["outputs"] == [{"name": "output", "datatype": "FP32", "shape": [-1, 4]}]
