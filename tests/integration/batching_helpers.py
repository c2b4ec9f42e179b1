"""Helpers of the batching and drain integration tests (test_batching_e2e.py, test_drain.py):
the slow CNN and its binary v2 requests, reads of /metrics and Triton's statistics extension, and
polling on a condition rather than sleeping."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import httpx
import numpy as np
import onnx
import onnxruntime as ort
import orjson
from prometheus_client.parser import text_string_to_metric_families

from loadtests.benchmarks.models import CNN_INPUT, cnn_model

ONE_THREAD = "onnxruntime:\n  intra_op_threads: 1\n  inter_op_threads: 1\n"
# Default batching (idle dispatch, 2 ms window); one instance, so a backlog forms under load.
CNN_BATCH = 8
CNN_CONFIG = f"max_batch_size: {CNN_BATCH}\ninstances: 1\n" + ONE_THREAD


def session(model: onnx.ModelProto) -> ort.InferenceSession:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def binary_request(
    array: np.ndarray, input_name: str = "x", parameters: dict[str, Any] | None = None
) -> tuple[bytes, dict[str, str]]:
    """A v2 request body with one FP32 input as binary tensor data (outputs come back as JSON)."""
    data = np.ascontiguousarray(array, dtype=np.float32).tobytes()
    header: dict[str, Any] = {
        "inputs": [
            {
                "name": input_name,
                "datatype": "FP32",
                "shape": list(array.shape),
                "parameters": {"binary_data_size": len(data)},
            }
        ]
    }
    if parameters:
        header["parameters"] = parameters
    head = orjson.dumps(header)
    headers = {
        "Content-Type": "application/octet-stream",
        "Inference-Header-Content-Length": str(len(head)),
    }
    return head + data, headers


def slow_cnn() -> onnx.ModelProto:
    """The benchmark CNN at twice the width and depth: ~20 ms per row on one idle core, input
    `x` [-1, 3, 64, 64], output `logits` [-1, 10]."""
    return cnn_model(channels=64, blocks=4)


def cnn_rows(rows: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, *CNN_INPUT)).astype(np.float32)


async def post_cnn(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    array: np.ndarray,
    parameters: dict[str, Any] | None = None,
) -> httpx.Response:
    body, headers = binary_request(array, parameters=parameters)
    return await client.post(f"{url}/v2/models/{model}/infer", content=body, headers=headers)


def output(response: httpx.Response, name: str) -> np.ndarray:
    """Output `name` of a JSON v2 response, shaped."""
    assert response.status_code == 200, response.text
    for item in response.json()["outputs"]:
        if item["name"] == name:
            return np.asarray(item["data"], dtype=np.float32).reshape(item["shape"])
    raise AssertionError(f"no output {name!r} in {response.text[:200]}")


async def scrape(client: httpx.AsyncClient, url: str, model: str) -> dict[str, float]:
    """The model's samples on /metrics (and the server-wide ones without a model label), keyed
    `name`, `name{le}` for histogram buckets and `name{status}` for request counts."""
    response = await client.get(f"{url}/metrics")
    assert response.status_code == 200, response.text
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.labels.get("model", model) != model:
                continue
            key = sample.name
            if "le" in sample.labels:
                key += "{" + repr(float(sample.labels["le"])) + "}"  # "1" and "1.0" alike
            if "status" in sample.labels:
                key += "{" + sample.labels["status"] + "}"
            found[key] = found.get(key, 0.0) + sample.value
    return found


def delta(after: dict[str, float], before: dict[str, float], key: str) -> float:
    """How much sample `key` grew; a sample missing after the fact fails the test."""
    assert key in after, f"no sample {key} on /metrics; found {sorted(after)[:8]}..."
    return after[key] - before.get(key, 0.0)


def batches_above(
    after: dict[str, float], before: dict[str, float], name: str, bound: int
) -> float:
    """New observations of histogram `name` greater than `bound` (a bucket boundary)."""
    return delta(after, before, f"{name}_count") - delta(
        after, before, f"{name}_bucket{{{bound!r}.0}}"
    )


class Missed(AssertionError):
    """The load finished before the test saw the state it needed (a very slow machine)."""


async def triton_stats(client: httpx.AsyncClient, url: str, model: str) -> dict[str, Any]:
    """The model's entry of Triton's statistics extension (one loaded version)."""
    response = await client.get(f"{url}/v2/models/{model}/stats")
    assert response.status_code == 200, response.text
    (entry,) = response.json()["model_stats"]
    return dict(entry)


def batch_counts(stats: dict[str, Any]) -> dict[int, int]:
    """Executions per batch size (rows) from Triton's `batch_stats`."""
    return {b["batch_size"]: b["compute_infer"]["count"] for b in stats["batch_stats"]}


async def poll(check: Callable[[], Awaitable[bool]], timeout_s: float, what: str) -> None:
    """Poll `check` until it holds (a condition, not a sleep, is what the test waits for)."""
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        await asyncio.sleep(0.005)


async def backlog(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    rows: int,
    pending: Sequence[asyncio.Future[Any]],
) -> None:
    """Wait until at least `rows` rows are queued for `model` (the model is saturated) while
    some of `pending` are still unanswered."""

    async def queued() -> bool:
        found = await scrape(client, url, model)
        if all(f.done() for f in pending):
            raise Missed(f"the load finished before {rows} rows were queued")
        return found["sluice_queue_rows"] >= rows

    await poll(queued, 30, f"{rows} rows queued for {model}")
