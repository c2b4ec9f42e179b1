"""Triton's statistics extension as perf_analyzer reads it (issue 12, item 3).

At the end of every run, perf_analyzer (`inference_profiler.cc`, ReportServerSideStats and
GetTotalEnsembleDurations) takes the difference of two statistics snapshots of the model and
throws "Server side statistics compute counts must be the same." unless

    compute_input.count == compute_infer.count == compute_output.count

It then averages each of them over its own count, and the request's overhead as success time less
queue and compute time. Triton counts each of the three once per request that ran (a batch's
times are counted once for every request in it), and a cache hit counts as a success with no
compute. This file sends real HTTP and gRPC traffic (batched requests, cache hits and misses) to a
real `sluice serve`, and applies the same checks to both statistics endpoints, between two
snapshots as perf_analyzer takes them, and against /metrics."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
from google.protobuf.json_format import MessageToDict

from engine.demo import mlp_model
from server.grpc.proto import grpc_service_pb2 as pb
from server.grpc.proto import grpc_service_pb2_grpc as pb_grpc
from tests.integration.batching_helpers import scrape
from tests.models import write_model
from tests.servers import ServerProcess

WIDTH = 16
# A 50 ms window without idle dispatch: concurrent requests meet in one batch.
BATCHED = (
    "max_batch_size: 16\ndynamic_batching:\n  max_queue_delay_s: 0.05\n"
    "  dispatch_when_idle: false\n"
)
MODELS = {"plain": BATCHED, "cached": BATCHED + "cache:\n  enabled: true\n"}
CONCURRENT = 8  # requests sent at once, per protocol and model
REPEATS = 3  # sequential repeats of earlier requests: cache hits on `cached`
STAGES = ("compute_input", "compute_infer", "compute_output")
DURATIONS = ("success", "queue", *STAGES)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    repo: Path = tmp_path_factory.mktemp("statistics-repo")
    for name, config in MODELS.items():
        write_model(repo, name, mlp_model((WIDTH, 32, 4), seed=5), config)
    log = tmp_path_factory.mktemp("statistics-server") / "server.log"
    process = ServerProcess("--model-repository", str(repo), log_path=log).start()
    yield process
    process.stop()


def rows(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((1, WIDTH)).astype(np.float32)


def http_body(x: np.ndarray) -> dict[str, Any]:
    return {"inputs": [{"name": "x", "datatype": "FP32", "shape": list(x.shape),
                        "data": x.ravel().tolist()}]}  # fmt: skip


def grpc_request(model: str, x: np.ndarray) -> Any:
    tensor = pb.ModelInferRequest.InferInputTensor(name="x", datatype="FP32", shape=list(x.shape))
    return pb.ModelInferRequest(model_name=model, inputs=[tensor], raw_input_contents=[x.tobytes()])


async def send_http(url: str, model: str, first_seed: int) -> None:
    async with httpx.AsyncClient(timeout=30) as client:
        target = f"{url}/v2/models/{model}/infer"
        seeds = range(first_seed, first_seed + CONCURRENT)
        answers = await asyncio.gather(
            *(client.post(target, json=http_body(rows(s))) for s in seeds)
        )
        assert [a.status_code for a in answers] == [200] * CONCURRENT, answers[0].text
        for seed in seeds[:REPEATS]:  # one at a time: hits on the cached model, never coalesced
            answer = await client.post(target, json=http_body(rows(seed)))
            assert answer.status_code == 200, answer.text


async def send_grpc(address: str, model: str, first_seed: int) -> None:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        seeds = range(first_seed, first_seed + CONCURRENT)
        await asyncio.gather(*(stub.ModelInfer(grpc_request(model, rows(s))) for s in seeds))
        for seed in seeds[:REPEATS]:
            await stub.ModelInfer(grpc_request(model, rows(seed)))


def http_stats(url: str, model: str) -> dict[str, Any]:
    response = httpx.get(f"{url}/v2/models/{model}/stats")
    assert response.status_code == 200, response.text
    (entry,) = response.json()["model_stats"]
    return dict(entry)


def grpc_stats(address: str, model: str) -> dict[str, Any]:
    """The ModelStatistics answer as JSON with Triton's field names (uint64s become ints)."""
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        reply = stub.ModelStatistics(pb.ModelStatisticsRequest(name=model), timeout=10)
    (entry,) = MessageToDict(reply, preserving_proto_field_name=True)["model_stats"]
    return _ints(entry)


def _ints(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _ints(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_ints(item) for item in value]
    return int(value) if isinstance(value, str) and value.isdigit() else value


def inference(stats: dict[str, Any], name: str) -> tuple[int, int]:
    """(count, ns) of one of `inference_stats` (protobuf JSON omits zeros)."""
    found = stats["inference_stats"].get(name, {})
    return int(found.get("count", 0)), int(found.get("ns", 0))


def difference(after: dict[str, Any], before: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """What perf_analyzer computes: each duration's (count, ns) growth between two snapshots."""
    names = (*DURATIONS, "cache_hit", "cache_miss")
    return {
        name: (
            inference(after, name)[0] - inference(before, name)[0],
            inference(after, name)[1] - inference(before, name)[1],
        )
        for name in names
    }


def assert_as_perf_analyzer_checks(window: dict[str, tuple[int, int]], cached: bool) -> None:
    computed = window["compute_infer"][0]
    # perf_analyzer's own check, the one that threw before.
    assert window["compute_input"][0] == computed == window["compute_output"][0], window
    hits = window["cache_hit"][0]
    assert window["success"][0] == computed + hits, window  # a hit is a success without compute
    sent = 2 * (CONCURRENT + REPEATS)  # HTTP and gRPC
    assert window["success"][0] == sent
    if cached:
        assert hits == 2 * REPEATS
        assert window["cache_miss"][0] == computed == 2 * CONCURRENT
    else:
        assert hits == 0
        assert window["cache_miss"][0] == 0
    assert window["queue"][0] == computed + hits  # Triton: "This includes cache hits."
    for name in DURATIONS:  # perf_analyzer divides each by its count: none may be zero
        count, ns = window[name]
        assert ns > 0, f"{name} has {count} requests and 0 ns"
    compute_ns = sum(window[name][1] for name in STAGES)
    # The stages are parts of the requests' own time, so perf_analyzer's overhead is not negative.
    assert window["queue"][1] + compute_ns <= window["success"][1], window


@pytest.fixture(scope="module")
def snapshots(server: ServerProcess) -> dict[str, Any]:
    """Both endpoints' statistics of each model before and after the traffic, and /metrics."""

    async def traffic() -> None:
        for index, model in enumerate(MODELS):
            await send_http(server.url, model, 100 * index)
            await send_grpc(server.grpc_url, model, 100 * index + 50)

    before = {m: (http_stats(server.url, m), grpc_stats(server.grpc_url, m)) for m in MODELS}
    asyncio.run(traffic())
    after = {m: (http_stats(server.url, m), grpc_stats(server.grpc_url, m)) for m in MODELS}

    async def scrape_all() -> dict[str, dict[str, float]]:
        async with httpx.AsyncClient(timeout=10) as client:
            return {m: await scrape(client, server.url, m) for m in MODELS}

    return {"before": before, "after": after, "metrics": asyncio.run(scrape_all())}


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("endpoint", ["http", "grpc"])
def test_compute_counts_are_the_same_as_perf_analyzer_requires(
    snapshots: dict[str, Any], model: str, endpoint: str
) -> None:
    index = 0 if endpoint == "http" else 1
    before, after = snapshots["before"][model][index], snapshots["after"][model][index]
    assert_as_perf_analyzer_checks(difference(after, before), cached=model == "cached")
    # The totals since start hold the same way (warm-up runs are not requests).
    assert_as_perf_analyzer_checks(difference(after, {"inference_stats": {}}), model == "cached")


@pytest.mark.parametrize("model", sorted(MODELS))
def test_batch_stats_time_every_stage_of_every_batch(snapshots: dict[str, Any], model: str) -> None:
    stats = snapshots["after"][model][0]
    batches = stats["batch_stats"]
    assert any(b["batch_size"] > 1 for b in batches), f"no batch formed: {batches}"
    for entry in batches:
        assert len({entry[stage]["count"] for stage in STAGES}) == 1, entry
        assert all(entry[stage]["ns"] > 0 for stage in STAGES), entry
    inferred = sum(b["batch_size"] * b["compute_infer"]["count"] for b in batches)
    assert inferred == stats["inference_count"]
    assert sum(b["compute_infer"]["count"] for b in batches) == stats["execution_count"]
    # A batch's time counts once per request in it, so the per-request totals are larger.
    batch_ns = sum(b["compute_infer"]["ns"] for b in batches)
    assert inference(stats, "compute_infer")[1] >= batch_ns
    assert snapshots["after"][model][1]["batch_stats"] == batches  # gRPC reports the same


@pytest.mark.parametrize("model", sorted(MODELS))
def test_metrics_read_the_same_counters(snapshots: dict[str, Any], model: str) -> None:
    stats, found = snapshots["after"][model][0], snapshots["metrics"][model]
    assert found["sluice_inference_rows_total"] == stats["inference_count"]
    assert found["sluice_executions_total"] == stats["execution_count"]
    assert found["sluice_compute_seconds_count"] == stats["execution_count"]
    assert found["sluice_queue_wait_seconds_count"] == inference(stats, "queue")[0]
    batch_s = sum(b["compute_infer"]["ns"] for b in stats["batch_stats"]) / 1e9
    assert found["sluice_compute_seconds_sum"] == pytest.approx(batch_s, abs=1e-6)
