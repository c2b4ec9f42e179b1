"""Dynamic batching end to end: concurrent HTTP clients against a real `sluice serve`.

Batch composition is read from the server's statistics: Triton's statistics extension
(`GET /v2/models/{name}/stats`: inference_count, execution_count, batch_stats) and /metrics
(`sluice_batch_requests`, `sluice_inference_rows_total`, and the queue gauges that show
saturation, which only /metrics has). Every answer is compared with the same ONNX model run
in-process one request at a time, on random payloads, so an answer that went to the wrong caller
fails the test. Saturation is observed, never assumed: the tests poll the
queue gauges until the backlog they need is there."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import onnx
import onnxruntime as ort
import orjson
import pytest

from engine.demo import mlp_model
from tests.integration.batching_helpers import (
    CNN_BATCH,
    CNN_CONFIG,
    ONE_THREAD,
    Missed,
    backlog,
    batch_counts,
    batches_above,
    binary_request,
    cnn_rows,
    delta,
    output,
    poll,
    post_cnn,
    scrape,
    session,
    slow_cnn,
    triton_stats,
)
from tests.models import write_model
from tests.servers import ServerProcess

# A 50 ms window without idle dispatch: concurrent requests always meet in one batch.
MLP_CONFIG = (
    "max_batch_size: 64\ndynamic_batching:\n  max_queue_delay_s: 0.05\n"
    "  dispatch_when_idle: false\n" + ONE_THREAD
)
TINY_QUEUE_CONFIG = CNN_CONFIG + f"dynamic_batching:\n  max_queue_size: {CNN_BATCH}\n"
MLP_WIDTH = 16
# Full 8-row batches of the slow CNN (~170 ms each on an idle core): one runs, the rest wait,
# which leaves hundreds of milliseconds in which the model is provably busy.
BLOCKERS = 4


# -- fixtures -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models() -> dict[str, onnx.ModelProto]:
    return {"mlp": mlp_model((MLP_WIDTH, 64, 10), seed=7), "cnn": slow_cnn()}


@pytest.fixture(scope="module")
def server(
    models: dict[str, onnx.ModelProto], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    repo: Path = tmp_path_factory.mktemp("batching-repo")
    write_model(repo, "mlp", models["mlp"], MLP_CONFIG)
    write_model(repo, "cnn", models["cnn"], CNN_CONFIG)
    write_model(repo, "cnn_tiny_queue", models["cnn"], TINY_QUEUE_CONFIG)
    log = tmp_path_factory.mktemp("batching-server") / "server.log"
    process = ServerProcess("--model-repository", str(repo), log_path=log, grpc=False).start()
    yield process
    process.stop()


@pytest.fixture
async def client() -> Any:
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=60, limits=limits) as http:
        yield http


def mlp_request(array: np.ndarray) -> dict[str, Any]:
    return {
        "inputs": [
            {"name": "x", "datatype": "FP32", "shape": list(array.shape), "data": array.ravel()}
        ]
    }


async def post_mlp(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> httpx.Response:
    content = orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)
    headers = {"Content-Type": "application/json"}
    return await client.post(f"{url}/v2/models/mlp/infer", content=content, headers=headers)


# -- tests ----------------------------------------------------------------------------------------


async def test_concurrent_clients_are_batched_and_answered_exactly(
    server: ServerProcess, client: httpx.AsyncClient, models: dict[str, onnx.ModelProto]
) -> None:
    reference = session(models["mlp"])
    rng = np.random.default_rng(1)
    rounds, clients = 3, 64
    payloads = [rng.standard_normal((1, MLP_WIDTH)).astype(np.float32) for _ in range(192)]
    before = await scrape(client, server.url, "mlp")
    triton_before = await triton_stats(client, server.url, "mlp")

    async def one_client(index: int) -> list[tuple[np.ndarray, httpx.Response]]:
        answers = []
        for turn in range(rounds):
            array = payloads[index * rounds + turn]
            answers.append((array, await post_mlp(client, server.url, mlp_request(array))))
        return answers

    results = await asyncio.gather(*(one_client(i) for i in range(clients)))
    after = await scrape(client, server.url, "mlp")
    triton_after = await triton_stats(client, server.url, "mlp")

    for array, response in (pair for answers in results for pair in answers):
        expected = reference.run(None, {"x": array})[0]
        np.testing.assert_allclose(
            output(response, "probabilities"), expected, rtol=1e-4, atol=1e-6
        )
    requests = clients * rounds
    # Triton's statistics: every row inferred once, in far fewer executions, some of them batches
    # of several (one-row) requests.
    inferred = triton_after["inference_count"] - triton_before["inference_count"]
    executions = triton_after["execution_count"] - triton_before["execution_count"]
    assert inferred == requests
    assert 1 <= executions < requests / 4, f"{executions} batches for {requests} requests"
    sizes, sizes_before = batch_counts(triton_after), batch_counts(triton_before)
    new_batches = {size: n - sizes_before.get(size, 0) for size, n in sizes.items()}
    assert sum(size * n for size, n in new_batches.items()) == requests
    assert sum(n for size, n in new_batches.items() if size > 1) >= 1, new_batches
    # /metrics reads the same counters.
    assert delta(after, before, "sluice_inference_rows_total") == requests
    assert delta(after, before, "sluice_executions_total") == executions
    assert batches_above(after, before, "sluice_batch_requests", 1) >= 1, "no batch merged requests"


async def test_multi_row_requests_get_their_own_rows_back(
    server: ServerProcess, client: httpx.AsyncClient, models: dict[str, onnx.ModelProto]
) -> None:
    reference = session(models["mlp"])
    rng = np.random.default_rng(2)
    sizes = [int(rng.integers(1, 9)) if i % 2 else 1 for i in range(64)]
    payloads = [rng.standard_normal((rows, MLP_WIDTH)).astype(np.float32) for rows in sizes]
    before = await scrape(client, server.url, "mlp")

    responses = await asyncio.gather(
        *(post_mlp(client, server.url, mlp_request(array)) for array in payloads)
    )
    after = await scrape(client, server.url, "mlp")

    for array, response in zip(payloads, responses, strict=True):
        got = output(response, "probabilities")
        assert got.shape == (array.shape[0], 10)
        expected = reference.run(None, {"x": array})[0]
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-6)
    assert delta(after, before, "sluice_inference_rows_total") == sum(sizes)
    executions = delta(after, before, "sluice_executions_total")
    assert executions < len(payloads) / 4, f"{executions} batches for {len(payloads)} requests"


async def test_bad_requests_in_a_burst_fail_alone(
    server: ServerProcess, client: httpx.AsyncClient, models: dict[str, onnx.ModelProto]
) -> None:
    reference = session(models["mlp"])
    rng = np.random.default_rng(3)
    payloads = [rng.standard_normal((1, MLP_WIDTH)).astype(np.float32) for _ in range(64)]
    bodies = [mlp_request(array) for array in payloads]
    wrong_shape = rng.standard_normal((1, MLP_WIDTH - 1)).astype(np.float32)
    bodies[20] = mlp_request(wrong_shape)
    bodies[41] = {"inputs": [{"name": "x", "datatype": "INT32", "shape": [1, MLP_WIDTH],
                              "data": list(range(MLP_WIDTH))}]}  # fmt: skip

    responses = await asyncio.gather(*(post_mlp(client, server.url, body) for body in bodies))

    statuses = [response.status_code for response in responses]
    assert statuses[20] == 400
    assert str(MLP_WIDTH - 1) in responses[20].json()["error"]
    assert statuses[41] == 400
    assert "INT32" in responses[41].json()["error"]
    for index, (array, response) in enumerate(zip(payloads, responses, strict=True)):
        if index not in (20, 41):
            expected = reference.run(None, {"x": array})[0]
            np.testing.assert_allclose(
                output(response, "probabilities"), expected, rtol=1e-4, atol=1e-6
            )


async def saturate(
    client: httpx.AsyncClient, url: str, model: str, blockers: int, seed: int
) -> tuple[dict[str, float], list[np.ndarray], list[asyncio.Task[httpx.Response]]]:
    """Make `model` (one instance, no other traffic) provably busy: one full batch running and
    `blockers - 1` full batches queued behind it. Returns the statistics from just before, the
    blockers' inputs and their pending answers. A machine so loaded that a whole batch ran
    before the test could look gets another try."""
    for attempt in range(3):
        before = await scrape(client, url, model)
        arrays = [cnn_rows(CNN_BATCH, seed + 10 * attempt + index) for index in range(blockers)]
        futures: list[asyncio.Task[httpx.Response]] = []
        try:
            await _block(client, url, model, arrays, before, futures)
        except Missed:
            await asyncio.gather(*futures)
            continue
        return before, arrays, futures
    raise AssertionError(f"could not keep {model} busy long enough to look, three times")


async def _block(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    arrays: list[np.ndarray],
    before: dict[str, float],
    futures: list[asyncio.Task[httpx.Response]],
) -> None:
    futures.append(asyncio.create_task(post_cnn(client, url, model, arrays[0])))

    async def running() -> bool:
        found = await scrape(client, url, model)
        if futures[0].done():
            raise Missed("the first blocker finished before it was seen running")
        # A request's queue wait is recorded when its batch starts.
        return delta(found, before, "sluice_queue_wait_seconds_count") >= 1

    await poll(running, 30, f"a batch of {model} to run")
    futures += [asyncio.create_task(post_cnn(client, url, model, a)) for a in arrays[1:]]
    await backlog(client, url, model, CNN_BATCH, futures)


def assert_logits(reference: ort.InferenceSession, array: np.ndarray, got: httpx.Response) -> None:
    expected = reference.run(None, {"x": array})[0]
    np.testing.assert_allclose(output(got, "logits"), expected, rtol=1e-4, atol=1e-5)


async def test_request_past_its_deadline_in_queue_gets_504_and_never_runs(
    server: ServerProcess, client: httpx.AsyncClient, models: dict[str, onnx.ModelProto]
) -> None:
    reference = session(models["cnn"])
    before, blocking, blocked = await saturate(client, server.url, "cnn", BLOCKERS, seed=0)

    late = cnn_rows(3, 100)  # 3 rows: its absence from the row count is visible
    patient = cnn_rows(2, 101)
    expired, answered = await asyncio.gather(
        post_cnn(client, server.url, "cnn", late, {"timeout": 1000}),
        post_cnn(client, server.url, "cnn", patient),
    )
    blocked_answers = await asyncio.gather(*blocked)
    after = await scrape(client, server.url, "cnn")

    assert expired.status_code == 504, expired.text
    assert "it was not run" in expired.json()["error"]
    assert_logits(reference, patient, answered)
    for array, response in zip(blocking, blocked_answers, strict=True):
        assert_logits(reference, array, response)
    assert delta(after, before, "sluice_inference_rows_total") == BLOCKERS * CNN_BATCH + 2
    assert delta(after, before, "sluice_requests_total{504}") == 1
    assert delta(after, before, "sluice_requests_total{200}") == BLOCKERS + 1


async def test_full_queue_answers_503_with_retry_after(
    server: ServerProcess, client: httpx.AsyncClient, models: dict[str, onnx.ModelProto]
) -> None:
    reference = session(models["cnn"])
    model = "cnn_tiny_queue"
    # One full batch runs, one fills the queue (max_queue_size is one batch).
    before, blocking, blocked = await saturate(client, server.url, model, 2, seed=200)
    burst = [cnn_rows(1, 210 + seed) for seed in range(16)]

    responses = await asyncio.gather(*(post_cnn(client, server.url, model, a) for a in burst))
    blocked_answers = await asyncio.gather(*blocked)
    after = await scrape(client, server.url, model)

    statuses = [response.status_code for response in responses]
    assert set(statuses) <= {200, 503}, statuses
    assert 503 in statuses, "every request of the burst found room in a full queue"
    for response in responses:
        if response.status_code == 503:
            assert int(response.headers["Retry-After"]) >= 1
            assert "queue is full" in response.json()["error"]
    for array, response in zip(blocking + burst, blocked_answers + responses, strict=True):
        if response.status_code == 200:
            assert_logits(reference, array, response)
    served = 2 * CNN_BATCH + statuses.count(200)
    assert delta(after, before, "sluice_inference_rows_total") == served
    assert delta(after, before, "sluice_requests_total{503}") == statuses.count(503)


async def test_client_that_leaves_is_withdrawn_and_not_computed(
    server: ServerProcess, client: httpx.AsyncClient
) -> None:
    before, _, blocked = await saturate(client, server.url, "cnn", BLOCKERS, seed=300)

    # The leaver has 3 rows and every blocker a full batch of 8, so queued rows are 3 modulo 8
    # exactly while the leaver waits in the queue.
    body, headers = binary_request(cnn_rows(3, 399))
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    _, writer = await asyncio.open_connection("127.0.0.1", server.http_port)
    writer.write(
        f"POST /v2/models/cnn/infer HTTP/1.1\r\nHost: test\r\nContent-Length: {len(body)}\r\n"
        f"{head}\r\n".encode()
        + body
    )
    await writer.drain()

    def leaver_rows(rows: int) -> Callable[[], Awaitable[bool]]:
        async def check() -> bool:
            found = await scrape(client, server.url, "cnn")
            return found.get("sluice_queue_rows", 0) % CNN_BATCH == rows

        return check

    await poll(leaver_rows(3), 30, "the 3-row request to be queued")
    writer.close()
    await writer.wait_closed()
    await poll(leaver_rows(0), 30, "the 3-row request to leave the queue")
    waiting = (await scrape(client, server.url, "cnn"))["sluice_queue_depth"]
    responses = await asyncio.gather(*blocked)
    after = await scrape(client, server.url, "cnn")

    # Withdrawn at once, while blockers still waited ahead of it, not run when its turn came.
    assert waiting >= 1, "the 3-row request stayed queued until its turn after its client left"
    assert [response.status_code for response in responses] == [200] * BLOCKERS
    assert delta(after, before, "sluice_inference_rows_total") == BLOCKERS * CNN_BATCH
    assert delta(after, before, "sluice_executions_total") == BLOCKERS
