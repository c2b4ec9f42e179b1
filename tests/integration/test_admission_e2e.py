"""Admission control end to end: API keys, rate limits, quotas, fairness and Redis faults against
real `sluice serve` processes (HTTP, and the auth matrix over gRPC with sluice's own stubs)."""

from __future__ import annotations

import asyncio
import datetime as dt
import math
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest

from server.grpc.proto import grpc_service_pb2 as pb
from server.grpc.proto import grpc_service_pb2_grpc as pb_grpc
from tests.integration.helpers_e2e import (
    Key,
    Stream,
    demo_input,
    demo_repository,
    infer_body,
    slow_model,
    start_all,
    stop_all,
    wait_for,
    write_settings,
)
from tests.models import write_model
from tests.redis_process import RedisProcess
from tests.servers import ServerProcess

KEYS = {
    "admin": Key.create("ops", role="admin"),
    "user": Key.create("acme", models=["demo"]),
    "other": Key.create("other", models=["slow"]),
    "rate": Key.create("ratey"),
    "rate_grpc": Key.create("ratey-grpc"),
    "quota": Key.create("quotay"),
    "flood": Key.create("flood"),
    "modest": Key.create("modest"),
    "global": Key.create("global"),
    "steady": Key.create("steady"),
}
SLOW_CONFIG = """\
max_batch_size: 8
instances: 1
dynamic_batching:
  max_queue_size: 32
onnxruntime:
  intra_op_threads: 1
  inter_op_threads: 1
"""
GLOBAL_RATE, GLOBAL_BURST = 5.0, 5.0


def settings(**rate_limit: Any) -> dict[str, Any]:
    return {
        "auth": {"keys": [key.entry() for key in KEYS.values()]},
        "rate_limit": {
            "tenants": {
                "ratey": {"rate_per_s": 1, "burst": 2},
                "ratey-grpc": {"rate_per_s": 1, "burst": 2},
                "quotay": {"quota_per_day": 2},
                "flood": {"max_queue_share": 0.25},
                "global": {"rate_per_s": GLOBAL_RATE, "burst": GLOBAL_BURST},
                "steady": {"rate_per_s": 100, "burst": 100},
            },
            **rate_limit,
        },
    }


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = demo_repository(
        tmp_path_factory.mktemp("admission-repo"), {"demo": "max_batch_size: 64\n"}
    )
    # ~4x the default depth: the model, not HTTP, must be what saturates (~100 rows/s here).
    write_model(repo, "slow", slow_model(depth=160), SLOW_CONFIG)
    return repo


@pytest.fixture(scope="module")
def server(repository: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The in-memory limiter; HTTP and gRPC."""
    folder = tmp_path_factory.mktemp("admission-memory")
    config = write_settings(folder / "server.yaml", settings())
    process = ServerProcess(
        "--config", str(config), "--model-repository", str(repository),
        log_path=folder / "server.log",
    )  # fmt: skip
    process.start()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisProcess]:
    """A redis-server of this module's own, which one test kills and restarts."""
    process = RedisProcess(tmp_path_factory.mktemp("admission-redis"))
    process.start()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def replicas(
    repository: Path, redis_server: RedisProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """Two replicas sharing one Redis for their limits: A fails open, B fails closed."""
    folder = tmp_path_factory.mktemp("admission-replicas")
    processes = []
    for name, fail_open in (("open", True), ("closed", False)):
        config = settings(
            backend="redis",
            redis_url=redis_server.url,
            fail_open=fail_open,
            redis_timeout_s=0.5,  # a loaded CI machine must not fall back by accident
            redis_retry_interval_s=0.2,
        )
        path = write_settings(folder / f"{name}.yaml", config)
        processes.append(
            ServerProcess(
                "--config",
                str(path),
                "--model-repository",
                str(repository),
                log_path=folder / f"{name}.log",
                grpc=False,
            )
        )
    start_all(processes)
    yield processes[0], processes[1]
    stop_all(processes)


def infer(url: str, headers: dict[str, str], model: str = "demo", seed: int = 0) -> httpx.Response:
    return httpx.post(
        f"{url}/v2/models/{model}/infer", json=infer_body(seed), headers=headers, timeout=10.0
    )


def error(response: httpx.Response) -> str:
    message: str = response.json()["error"]
    return message


# -- authentication ------------------------------------------------------------------------------


def test_auth_matrix_http(server: ServerProcess) -> None:
    url = server.url
    missing = infer(url, {})
    assert missing.status_code == 401
    assert "missing API key" in error(missing)
    unknown = infer(url, {"Authorization": "Bearer sluice_not-a-configured-key"})
    assert unknown.status_code == 401
    assert "unknown API key" in error(unknown)
    basic = infer(url, {"Authorization": "Basic dXNlcjpwYXNz"})
    assert basic.status_code == 401
    assert "scheme 'Basic'" in error(basic)

    user = KEYS["user"]
    assert infer(url, user.bearer()).status_code == 200
    assert infer(url, user.x_api_key()).status_code == 200
    elsewhere = infer(url, KEYS["other"].bearer())
    assert elsewhere.status_code == 403
    assert error(elsewhere) == "tenant 'other' may use models [slow]; got 'demo'"
    metadata = httpx.get(f"{url}/v2/models/demo", headers=KEYS["other"].x_api_key())
    assert metadata.status_code == 403

    for path in ("/v2/health/live", "/v2/health/ready"):
        assert httpx.get(f"{url}{path}").status_code == 200
    assert httpx.get(f"{url}/v2/tenants/self/usage").status_code == 401
    assert httpx.get(f"{url}/v2").status_code == 401


def test_admin_endpoint_needs_admin_key_http(server: ServerProcess) -> None:
    index = f"{server.url}/v2/repository/index"
    as_admin = httpx.post(index, headers=KEYS["admin"].bearer())
    if as_admin.status_code == 404:
        pytest.skip("POST /v2/repository/index is not served: server/http/app.py does not include "
                    "server/http/triton.py's router")  # fmt: skip
    assert as_admin.status_code == 200
    assert {row["name"] for row in as_admin.json()} == {"demo", "slow"}
    as_user = httpx.post(index, headers=KEYS["user"].bearer())
    assert as_user.status_code == 403
    assert "repository endpoints need an admin key" in error(as_user)
    assert httpx.post(index).status_code == 401


def grpc_request(model: str = "demo", seed: int = 0) -> Any:
    values = np.asarray(demo_input(seed), dtype=np.float32)
    tensor = pb.ModelInferRequest.InferInputTensor(name="x", datatype="FP32", shape=[1, 16])
    return pb.ModelInferRequest(
        model_name=model, inputs=[tensor], raw_input_contents=[values.tobytes()]
    )


def grpc_stub(channel: grpc.Channel) -> Any:
    return pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]


def grpc_error(call: Any, **metadata: str) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        call(metadata=tuple(metadata.items()))
    return caught.value


def test_auth_matrix_grpc(server: ServerProcess) -> None:
    with grpc.insecure_channel(server.grpc_url) as channel:
        stub = grpc_stub(channel)

        def model_infer(**kwargs: Any) -> Any:
            return stub.ModelInfer(grpc_request(), timeout=10.0, **kwargs)

        def repository_index(**kwargs: Any) -> Any:
            return stub.RepositoryIndex(pb.RepositoryIndexRequest(), timeout=10.0, **kwargs)

        missing = grpc_error(model_infer)
        assert missing.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "missing API key" in (missing.details() or "")
        unknown = grpc_error(model_infer, authorization="Bearer sluice_not-a-configured-key")
        assert unknown.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "unknown API key" in (unknown.details() or "")

        user = KEYS["user"]
        for metadata in (("authorization", f"Bearer {user.key}"), ("x-api-key", user.key)):
            reply = model_infer(metadata=(metadata,))
            assert reply.model_name == "demo"
            assert len(reply.raw_output_contents[0]) == 10 * 4  # probabilities: 10 x FP32

        as_user = grpc_error(repository_index, authorization=f"Bearer {user.key}")
        assert as_user.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "repository endpoints need an admin key" in (as_user.details() or "")
        index = repository_index(metadata=(("x-api-key", KEYS["admin"].key),))
        assert {model.name for model in index.models} == {"demo", "slow"}
        elsewhere = grpc_error(model_infer, authorization=f"Bearer {KEYS['other'].key}")
        assert elsewhere.code() == grpc.StatusCode.PERMISSION_DENIED
        assert elsewhere.details() == "tenant 'other' may use models [slow]; got 'demo'"

        assert stub.ServerLive(pb.ServerLiveRequest(), timeout=10.0).live is True
        assert stub.ServerReady(pb.ServerReadyRequest(), timeout=10.0).ready is True


def test_rate_limit_over_grpc_carries_the_facts(server: ServerProcess) -> None:
    metadata = (("x-api-key", KEYS["rate_grpc"].key),)
    with grpc.insecure_channel(server.grpc_url) as channel:
        stub = grpc_stub(channel)
        for _ in range(2):
            stub.ModelInfer(grpc_request(), metadata=metadata, timeout=10.0)
        with pytest.raises(grpc.RpcError) as caught:
            stub.ModelInfer(grpc_request(), metadata=metadata, timeout=10.0)
    refused: Any = caught.value
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "over its rate limit of 1 requests/s (burst 2)" in refused.details()
    trailing = dict(refused.trailing_metadata() or ())
    assert trailing["retry-after"] == "1"
    assert (trailing["x-ratelimit-limit"], trailing["x-ratelimit-remaining"]) == ("2", "0")


# -- rate limits and quotas ----------------------------------------------------------------------


def test_third_request_gets_exact_retry_after(server: ServerProcess) -> None:
    headers = KEYS["rate"].bearer()
    started = time.monotonic()
    statuses = [infer(server.url, headers, seed=i).status_code for i in range(2)]
    refused = infer(server.url, headers, seed=2)
    elapsed = time.monotonic() - started
    assert elapsed < 1.0, "the bucket refilled a whole token: the check below would not hold"
    assert statuses == [200, 200]
    assert refused.status_code == 429
    # Less than one token is back after < 1 s at 1/s: a whole token is < 1 s away -> "1".
    assert refused.headers["retry-after"] == "1"
    assert refused.headers["x-ratelimit-limit"] == "2"
    assert refused.headers["x-ratelimit-remaining"] == "0"
    # Full again after (2 - tokens) s, tokens < 1 -> more than 1 s, rounded up.
    assert refused.headers["x-ratelimit-reset"] == "2"
    message = error(refused)
    assert message.startswith("tenant 'ratey' is over its rate limit of 1 requests/s (burst 2)")
    waited = float(message.rsplit("retry in ", 1)[1].removesuffix(" s"))
    assert 0 < waited <= 1.0


def test_exhausted_quota_has_its_own_message_and_usage(server: ServerProcess) -> None:
    headers = KEYS["quota"].x_api_key()
    usage_url = f"{server.url}/v2/tenants/self/usage"
    fresh = httpx.get(usage_url, headers=headers).json()
    assert (fresh["tenant"], fresh["day"]["used"], fresh["day"]["limit"]) == ("quotay", 0, 2)
    assert [infer(server.url, headers, seed=i).status_code for i in range(2)] == [200, 200]
    refused = infer(server.url, headers, seed=2)
    assert refused.status_code == 429
    now = dt.datetime.now(dt.UTC)
    midnight = dt.datetime.combine(now.date() + dt.timedelta(days=1), dt.time(), dt.UTC)
    assert error(refused) == (
        "tenant 'quotay' used its daily quota of 2 requests (2 used); it resets at "
        f"{midnight:%Y-%m-%dT%H:%M:%SZ}"
    )
    assert "rate limit" not in error(refused)
    assert abs(int(refused.headers["retry-after"]) - (midnight - now).total_seconds()) <= 2
    assert refused.headers["x-ratelimit-limit"] == "2"
    assert refused.headers["x-ratelimit-remaining"] == "0"

    usage = httpx.get(usage_url, headers=headers)
    assert usage.status_code == 200
    day = usage.json()["day"]
    assert (day["used"], day["limit"], day["remaining"]) == (2, 2, 0)
    assert day["resets_at"] == f"{midnight:%Y-%m-%dT%H:%M:%SZ}"


# -- fairness ------------------------------------------------------------------------------------


async def test_flooding_tenant_cannot_starve_a_modest_one(server: ServerProcess) -> None:
    """`flood` keeps 16 requests of 4 rows each in flight (64 rows against a 32-row queue and a
    model that serves ~100 rows/s on a busy CI core), retrying 10 ms after every 503: several
    times what the model can serve. Its max_queue_share of 0.25 caps it at 8 queued rows, so
    `modest`, sending 1 row ten times a second, always finds room and is served round-robin
    within the level. With a share of 1.0 the flood fills the queue and `modest` gets 503s
    ("queue is full"), which this test catches."""
    flood_headers = KEYS["flood"].bearer()
    flood_body = infer_body(seed=1, rows=4)
    flood: Counter[int] = Counter()
    refusals: set[str] = set()
    stop, saturated = asyncio.Event(), asyncio.Event()
    limits = httpx.Limits(max_connections=64)

    async with httpx.AsyncClient(base_url=server.url, limits=limits, timeout=30.0) as client:

        async def flooder() -> None:
            while not stop.is_set():
                response = await client.post(
                    "/v2/models/slow/infer", json=flood_body, headers=flood_headers
                )
                flood[response.status_code] += 1
                if response.status_code == 503:
                    refusals.add(response.json()["error"].split(" holds ")[0])
                    saturated.set()
                    await asyncio.sleep(0.01)

        async def modest(index: int) -> tuple[int, float]:
            await asyncio.sleep(index * 0.1)  # pacing: ten requests a second, open loop
            started = time.monotonic()
            response = await client.post(
                "/v2/models/slow/infer",
                json=infer_body(seed=100 + index),
                headers=KEYS["modest"].bearer(),
            )
            return response.status_code, time.monotonic() - started

        flooders = [asyncio.create_task(flooder()) for _ in range(16)]
        try:
            async with asyncio.timeout(10):  # until the flood fills its share of the queue
                await saturated.wait()
            started = time.monotonic()
            answers = await asyncio.gather(*(modest(i) for i in range(20)))
            flood_window = time.monotonic() - started
        finally:
            stop.set()
            await asyncio.gather(*flooders)

    assert [status for status, _ in answers] == [200] * 20
    latencies = sorted(latency for _, latency in answers)
    p99 = latencies[math.ceil(0.99 * len(latencies)) - 1]
    assert p99 < 2.0, f"modest tenant p99 {p99:.3f} s; latencies {latencies}"
    assert set(flood) == {200, 503}, dict(flood)
    # It really was a flood: most of its attempts found its share of the queue full.
    assert refusals == {"tenant 'flood'"}, refusals
    assert flood[503] > flood[200], (dict(flood), flood_window)


# -- across replicas, and Redis faults -----------------------------------------------------------


async def test_replicas_sharing_redis_hold_one_global_limit(
    replicas: tuple[ServerProcess, ServerProcess],
) -> None:
    urls = [server.url for server in replicas]
    headers = KEYS["global"].bearer()
    body = infer_body(seed=3)
    outcomes: list[tuple[int, int]] = []  # (replica, status)
    run_s = 2.0

    async with httpx.AsyncClient(timeout=10.0) as client:

        async def worker(replica: int) -> None:
            while time.monotonic() < end:
                url = urls[replica]
                response = await client.post(
                    f"{url}/v2/models/demo/infer", json=body, headers=headers
                )
                outcomes.append((replica, response.status_code))

        started = time.monotonic()
        end = started + run_s
        await asyncio.gather(*(worker(i % 2) for i in range(4)))
        elapsed = time.monotonic() - started

    statuses = Counter(status for _, status in outcomes)
    assert set(statuses) == {200, 429}, statuses
    accepted = statuses[200]
    bound = GLOBAL_RATE * elapsed + GLOBAL_BURST + 1
    assert accepted <= bound, f"{accepted} accepted in {elapsed:.2f} s; one limit allows {bound}"
    # Each replica alone would allow as much again: both took part, and the sum still holds.
    assert accepted >= GLOBAL_BURST
    for replica in (0, 1):
        assert {status for r, status in outcomes if r == replica} == {200, 429}


def test_redis_killed_fail_open_and_fail_closed(
    replicas: tuple[ServerProcess, ServerProcess], redis_server: RedisProcess
) -> None:
    fail_open, fail_closed = replicas
    headers = KEYS["steady"].bearer()
    usage_path = "/v2/tenants/self/usage"
    with (
        Stream([fail_open.url], headers=headers, workers=2) as opened,
        Stream([fail_closed.url], headers=headers, workers=2) as closed,
    ):
        wait_for(lambda: opened.answered >= 10 and closed.answered >= 10, 10.0, "a steady load")
        redis_server.stop()  # SIGKILL, with requests in flight
        try:
            admitted_at_kill = opened.statuses[(0, 200)]
            wait_for(
                lambda: (
                    closed.statuses[(0, 503)] >= 5
                    and opened.statuses[(0, 200)] >= admitted_at_kill + 20
                ),
                10.0,
                "503s from the fail-closed replica and 200s from the fail-open one",
            )
            refused = infer(fail_closed.url, headers)
            usage_open = httpx.get(f"{fail_open.url}{usage_path}", headers=headers)
            usage_closed = httpx.get(f"{fail_closed.url}{usage_path}", headers=headers)
        finally:
            redis_server.start()  # same port, empty
        admitted_at_restart = closed.statuses[(0, 200)]
        # Redis is back: both replicas use it again once their retry interval has passed.
        wait_for(
            lambda: closed.statuses[(0, 200)] > admitted_at_restart,
            10.0,
            "the fail-closed replica to admit again",
        )
        wait_for(
            lambda: (
                httpx.get(f"{fail_open.url}{usage_path}", headers=headers).json()["source"]
                == "redis"
            ),
            10.0,
            "the fail-open replica to read its usage from Redis again",
        )

    # fail_open: the replica's own limiter decides (200, or 429 when steady's bucket is empty).
    assert opened.failures(allowed=(200, 429)) == []
    assert usage_open.status_code == 200
    assert usage_open.json()["source"] == "memory (fallback: redis unavailable)"
    # fail_closed: 503 with Retry-After and a message naming the cause; never a 500.
    assert closed.failures(allowed=(200, 429, 503)) == []
    for response in (refused, usage_closed):
        assert response.status_code == 503, response.text
        assert "retry-after" in response.headers
    for message in [error(refused), *(e for e in closed.errors if " 503 " in e)]:
        assert "rate limiter unavailable: redis at 127.0.0.1:" in message, message
