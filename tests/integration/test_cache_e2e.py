"""The result cache end to end: real `sluice serve` processes, a real redis-server, HTTP only.

Counts come from the model's Triton statistics (`GET /v2/models/<m>/stats`: execution_count,
inference_count, cache_hit, cache_miss), checked against /metrics. inference_count counts the rows
the backend really computed: a cached or coalesced request adds none, while an uncoalesced one
adds its row even when it was batched with the others."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from tests.integration.helpers_e2e import (
    Stream,
    cache_config,
    cache_errors,
    cache_hit,
    delta,
    demo_repository,
    held_batching,
    infer_body,
    model_counts,
    output_data,
    start_all,
    stop_all,
    wait_for,
    write_settings,
)
from tests.redis_process import RedisProcess
from tests.servers import ServerProcess

HOLD_S = 1.0
"""How long the `held` model keeps a batch open: every concurrent caller arrives inside it."""


def write_repository(root: Path) -> Path:
    return demo_repository(
        root,
        {
            "demo": "max_batch_size: 64\n" + cache_config(),
            "plain": "max_batch_size: 64\n",  # cache not enabled
            "held": held_batching(HOLD_S) + cache_config(),
        },
    )


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_repository(tmp_path_factory.mktemp("cache-repo"))


@pytest.fixture(scope="module")
def memory_server(
    repository: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("cache-memory") / "server.log"
    server = ServerProcess("--model-repository", str(repository), log_path=log, grpc=False)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisProcess]:
    """A redis-server of this module's own, which one test kills and restarts."""
    server = RedisProcess(tmp_path_factory.mktemp("cache-redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def replicas(
    redis_server: RedisProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """Two replicas sharing `redis_server`, each with its own copy of the same repository (as
    on two machines): A `tiered`, B `redis` (so every hit on B comes from Redis)."""
    folder = tmp_path_factory.mktemp("cache-replicas")
    servers = []
    for name, backend in (("a", "tiered"), ("b", "redis")):
        settings = {
            "cache": {
                "backend": backend,
                "redis_url": redis_server.url,
                # generous: a loaded CI machine must not turn a slow reply into a miss
                "redis_timeout_s": 0.5,
                "redis_retry_interval_s": 0.2,
            }
        }
        config = write_settings(folder / f"{name}.yaml", settings)
        servers.append(
            ServerProcess(
                "--config",
                str(config),
                "--model-repository",
                str(write_repository(folder / f"repo-{name}")),
                log_path=folder / f"{name}.log",
                grpc=False,
            )
        )
    start_all(servers)
    yield servers[0], servers[1]
    stop_all(servers)


def redis_keys(url: str, pattern: str) -> int:
    with redis.Redis.from_url(url, socket_timeout=2.0) as client:
        return len(client.keys(pattern))


def post(url: str, model: str, body: dict[str, object]) -> httpx.Response:
    return httpx.post(f"{url}/v2/models/{model}/infer", json=body, timeout=10.0)


def test_repeated_request_is_a_hit(memory_server: ServerProcess) -> None:
    url = memory_server.url
    before = model_counts(url, "demo")
    first = post(url, "demo", infer_body(seed=101))
    second = post(url, "demo", infer_body(seed=101))
    assert (cache_hit(first), cache_hit(second)) == (False, True)
    assert output_data(second) == output_data(first)
    assert delta(before, model_counts(url, "demo")) == {
        "executions": 1, "rows": 1, "hits": 1, "misses": 1,
    }  # fmt: skip

    # A different input is a different entry: computed, not served from the first one's.
    other = post(url, "demo", infer_body(seed=102))
    assert cache_hit(other) is False
    assert output_data(other) != output_data(first)


def test_cache_false_bypasses(memory_server: ServerProcess) -> None:
    url = memory_server.url
    stored = post(url, "demo", infer_body(seed=111))
    assert cache_hit(stored) is False
    before = model_counts(url, "demo")
    bypass = post(url, "demo", infer_body(seed=111, parameters={"cache": False}))
    assert cache_hit(bypass) is None  # the cache was not consulted at all
    assert output_data(bypass) == output_data(stored)
    assert delta(before, model_counts(url, "demo")) == {
        "executions": 1, "rows": 1, "hits": 0, "misses": 0,
    }  # fmt: skip
    invalid = post(url, "demo", infer_body(seed=111, parameters={"cache": "no"}))
    assert invalid.status_code == 400
    assert "'cache' must be a boolean" in invalid.json()["error"]


def test_model_without_cache_never_hits(memory_server: ServerProcess) -> None:
    url = memory_server.url
    before = model_counts(url, "plain")
    answers = [post(url, "plain", infer_body(seed=121)) for _ in range(3)]
    assert [cache_hit(answer) for answer in answers] == [None, None, None]
    assert output_data(answers[0]) == output_data(answers[2])
    assert delta(before, model_counts(url, "plain")) == {
        "executions": 3, "rows": 3, "hits": 0, "misses": 0,
    }  # fmt: skip


async def test_concurrent_identical_requests_run_once(memory_server: ServerProcess) -> None:
    url = memory_server.url
    callers = 20
    before = model_counts(url, "held")
    limits = httpx.Limits(max_connections=callers)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=10.0) as client:
        answers = await asyncio.gather(
            *(
                client.post("/v2/models/held/infer", json=infer_body(seed=131))
                for _ in range(callers)
            )
        )
    outputs = [output_data(answer) for answer in answers]
    assert all(output == outputs[0] for output in outputs)
    change = delta(before, model_counts(url, "held"))
    # One backend row for twenty callers; uncoalesced they would be twenty rows (in one batch).
    assert (change["executions"], change["rows"]) == (1, 1)
    # They all arrived while the first was held in the queue: they joined it, not the cache.
    computed = [answer for answer in answers if cache_hit(answer) is False]
    assert len(computed) == callers
    assert change["misses"] == callers


def test_computed_on_one_replica_is_a_hit_on_another(
    replicas: tuple[ServerProcess, ServerProcess], redis_server: RedisProcess
) -> None:
    a, b = replicas
    stored_before = redis_keys(redis_server.url, "sluice:demo:*")
    first = post(a.url, "demo", infer_body(seed=141))
    assert cache_hit(first) is False
    # A writes to Redis in the background, after answering: wait until the entry is there.
    wait_for(
        lambda: redis_keys(redis_server.url, "sluice:demo:*") > stored_before,
        5.0,
        "replica A's result to reach Redis",
    )
    before_b = model_counts(b.url, "demo")
    second = post(b.url, "demo", infer_body(seed=141))
    assert cache_hit(second) is True
    assert output_data(second) == output_data(first)
    change = delta(before_b, model_counts(b.url, "demo"))
    assert (change["executions"], change["hits"], change["misses"]) == (0, 1, 0)


def test_redis_killed_mid_load_then_restarted(
    replicas: tuple[ServerProcess, ServerProcess], redis_server: RedisProcess
) -> None:
    a, b = replicas
    errors_before = [cache_errors(server.url) for server in replicas]
    # Half the stream repeats one input (hits when the cache works), half is new every time.
    with Stream([a.url, b.url], seed=lambda sent: 151 if sent % 2 else 10_000 + sent) as stream:
        wait_for(lambda: stream.answered >= 10, 10.0, "10 requests before the outage")
        redis_server.stop()  # SIGKILL
        try:
            at_kill = stream.answered
            # Both replicas notice (they count Redis errors) while requests keep flowing.
            wait_for(
                lambda: all(
                    cache_errors(server.url) > before
                    for server, before in zip(replicas, errors_before, strict=True)
                ),
                10.0,
                "both replicas to count Redis errors",
            )
            wait_for(lambda: stream.answered >= at_kill + 20, 10.0, "20 requests during the outage")
            during_outage = stream.answered - at_kill
        finally:
            redis_server.start()  # same port, empty

        # Hits resume: a new result computed on B reaches Redis, then B reads it back from there.
        def resumed() -> bool:
            seed = 20_000 + stream.sent  # new every time: the restarted Redis is empty
            assert cache_hit(post(b.url, "demo", infer_body(seed))) is False
            # A miss here means B still skips Redis (retry interval): try again, new input.
            return cache_hit(post(b.url, "demo", infer_body(seed))) is True

        wait_for(resumed, 10.0, "cache hits from Redis after the restart")
    assert stream.failures() == []
    assert during_outage >= 20
