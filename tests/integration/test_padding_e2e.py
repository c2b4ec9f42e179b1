"""Padded batches end to end: requests of different lengths share a batch of a real ONNX model
served by a real `sluice serve`, and every output comes back with the request's own shape and the
values the model gives that request alone (issue 12, item 1).

The model has a padded input `x` [batch, seq] and two outputs: `hidden` [batch, seq, 3], which
follows the padded axis, and `logits` [batch, 4], which does not but is as long as the padded
length when a 3-long request is padded to 4."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from tests.integration.batching_helpers import batch_counts, output, session, triton_stats
from tests.models import OPSET, write_model
from tests.servers import ServerProcess

BATCHED_TOGETHER = (
    "max_batch_size: 8\n"
    "dynamic_batching:\n"
    "  max_queue_delay_s: 2.0\n"
    "  dispatch_when_idle: false\n"
    "  preferred_batch_sizes: [2]\n"  # the two requests go as soon as both are queued
    "  pad_bucket_ratio: 5\n"  # lengths 3 and 4 share a bucket
)
AUTO = BATCHED_TOGETHER + "  pad:\n    x: {axis: 1, value: 0}\n"
EXPLICIT = BATCHED_TOGETHER + "  pad:\n    x: {axis: 1, value: 0, outputs: {hidden: 1}}\n"


def padded_model(hidden_axis: str) -> onnx.ModelProto:
    """`hidden` = x[..., None] * w (its axis 1 named `hidden_axis`); `logits` = sum(x) @ v + b."""
    rng = np.random.default_rng(3)
    weights = [
        helper.make_tensor("w", TensorProto.FLOAT, [1, 1, 3], rng.standard_normal(3).tolist()),
        helper.make_tensor("v", TensorProto.FLOAT, [1, 4], rng.standard_normal(4).tolist()),
        helper.make_tensor("b", TensorProto.FLOAT, [4], rng.standard_normal(4).tolist()),
        helper.make_tensor("axes1", TensorProto.INT64, [1], [1]),
        helper.make_tensor("axes2", TensorProto.INT64, [1], [2]),
    ]
    nodes = [
        helper.make_node("Unsqueeze", ["x", "axes2"], ["x3"]),
        helper.make_node("Mul", ["x3", "w"], ["hidden"]),
        helper.make_node("ReduceSum", ["x", "axes1"], ["total"], keepdims=1),
        helper.make_node("MatMul", ["total", "v"], ["projected"]),
        helper.make_node("Add", ["projected", "b"], ["logits"]),
    ]
    graph = helper.make_graph(
        nodes,
        "padded",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq"])],
        [
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 4]),
            helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["batch", hidden_axis, 3]),
        ],
        initializer=weights,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


MODELS = {
    "auto": (padded_model("seq"), AUTO),  # `hidden` follows `seq` by its dim name
    "explicit": (padded_model("tokens"), EXPLICIT),  # the config says so
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    repo: Path = tmp_path_factory.mktemp("padding-repo")
    for name, (model, config) in MODELS.items():
        write_model(repo, name, model, config)
    log = tmp_path_factory.mktemp("padding-server") / "server.log"
    process = ServerProcess("--model-repository", str(repo), log_path=log, grpc=False).start()
    yield process
    process.stop()


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=30) as client:
        yield client


@pytest.mark.parametrize("name", sorted(MODELS))
async def test_requests_of_different_lengths_share_a_batch_and_get_their_own_outputs(
    server: ServerProcess, client: httpx.AsyncClient, name: str
) -> None:
    reference = session(MODELS[name][0])
    rng = np.random.default_rng(11)
    short = rng.standard_normal((1, 3)).astype(np.float32)
    full = rng.standard_normal((1, 4)).astype(np.float32)
    url = f"{server.url}/v2/models/{name}/infer"

    def body(x: np.ndarray) -> dict[str, object]:
        return {"inputs": [{"name": "x", "datatype": "FP32", "shape": list(x.shape),
                            "data": x.ravel().tolist()}]}  # fmt: skip

    responses = await asyncio.gather(*(client.post(url, json=body(x)) for x in (short, full)))

    stats = await triton_stats(client, server.url, name)
    assert batch_counts(stats) == {2: 1}, "the two requests did not run as one padded batch"
    for x, response in zip((short, full), responses, strict=True):
        logits, hidden = reference.run(["logits", "hidden"], {"x": x})
        assert output(response, "logits").shape == (1, 4)
        np.testing.assert_allclose(output(response, "logits"), logits, rtol=1e-5, atol=1e-6)
        assert output(response, "hidden").shape == (1, x.shape[1], 3)
        np.testing.assert_allclose(output(response, "hidden"), hidden, rtol=1e-5, atol=1e-6)
