"""loadtests.benchmarks.baseline: the peers sluice is measured against in the same run: a plain
FastAPI app over ONNX Runtime that answers what the model computes, and the no-op ASGI floor."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import numpy as np
import onnxruntime as ort

from loadtests.benchmarks.baseline import FIXED, floor_app, plain_app
from loadtests.benchmarks.batching import json_body
from loadtests.benchmarks.models import write_repository


async def post(app: object, body: bytes) -> httpx.Response:
    transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=transport, base_url="http://peer") as client:
        return await client.post("/v2/models/mlp/infer", content=body)


async def test_the_plain_peer_answers_what_the_model_computes(tmp_path: Path) -> None:
    repo = write_repository(tmp_path)
    body = json_body("mlp")
    answer = await post(plain_app(repo), body)
    assert answer.status_code == 200
    (output,) = answer.json()["outputs"]
    assert (output["name"], output["shape"]) == ("probabilities", [1, 10])
    x = np.array(json.loads(body)["inputs"][0]["data"], np.float32).reshape(1, 64)
    session = ort.InferenceSession(str(repo / "mlp" / "1" / "model.onnx"))
    np.testing.assert_allclose(output["data"], session.run(None, {"x": x})[0].ravel(), rtol=1e-5)


async def test_the_floor_reads_the_body_and_answers_one_fixed_reply() -> None:
    answer = await post(floor_app, json_body("cnn"))
    assert (answer.status_code, answer.content) == (200, FIXED)
    assert answer.headers["content-type"] == "application/json"
