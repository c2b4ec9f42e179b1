"""Scale-out on one machine: two real `sluice serve` replicas sharing a real Redis, behind a real
nginx running deploy/nginx.conf.

- a result computed through one replica is a cache hit through the other;
- one tenant's rate limit holds across both replicas;
- SIGTERM to one replica under steady load fails no client request."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import redis
import yaml

from engine.auth import digest_key
from engine.demo import write_demo_repository
from server.keys import new_key
from tests.integration.helpers_e2e import start_all
from tests.nginx_process import NGINX_CONF, NginxProcess, adapt_config
from tests.redis_process import RedisProcess, free_port
from tests.servers import ServerProcess

BURST = 6
INFER = "/v2/models/demo/infer"


@dataclass
class Cluster:
    replicas: list[ServerProcess]
    nginx: NginxProcess
    redis: RedisProcess
    keys: dict[str, str]
    """Tenant -> API key."""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.nginx.http_port}"

    def headers(self, tenant: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[tenant]}"}


def body(seed: int, cache: bool = True) -> dict[str, Any]:
    x = np.random.default_rng(seed).standard_normal(16).astype(np.float32)
    return {
        "inputs": [{"name": "x", "shape": [1, 16], "datatype": "FP32", "data": x.tolist()}],
        "parameters": {"cache": cache},
    }


def start_cluster(workdir: Path, queue_delay_s: float = 0.002) -> Cluster:
    """Redis, two replicas configured like deploy/compose.yaml's, and nginx in front."""
    redis_server = RedisProcess(workdir)
    redis_server.start()
    repo = write_demo_repository(workdir / "models")
    model_config = yaml.safe_load((repo / "demo" / "config.yaml").read_text())
    model_config["cache"] = {"enabled": True, "ttl_s": 300}
    model_config["dynamic_batching"]["max_queue_delay_s"] = queue_delay_s
    (repo / "demo" / "config.yaml").write_text(yaml.safe_dump(model_config))
    keys = {"acme": new_key(), "other": new_key()}
    # Generous Redis timeouts and fail_open off: on a busy machine a slow Redis call must not
    # quietly become a local miss or a local limit, which would hide what is tested here.
    settings = {
        "drain_timeout_s": 10,
        "auth": {"keys": [{"digest": digest_key(k), "tenant": t} for t, k in keys.items()]},
        "cache": {"backend": "tiered", "redis_url": redis_server.url, "redis_timeout_s": 2},
        "rate_limit": {
            "backend": "redis", "redis_url": redis_server.url, "redis_timeout_s": 2,
            "fail_open": False, "tenants": {"acme": {"rate_per_s": 0.001, "burst": BURST}},
        },
    }  # fmt: skip
    config = workdir / "server.yaml"
    config.write_text(yaml.safe_dump(settings))
    replicas = [
        ServerProcess(
            "--config", str(config), "--model-repository", str(repo),
            log_path=workdir / f"sluice-{name}.log",
        )
        for name in ("a", "b")
    ]  # fmt: skip
    nginx: NginxProcess | None = None
    try:
        start_all(replicas)  # together: each start is mostly imports
        a, b = replicas
        http_port, grpc_port = free_port(), free_port()
        text = adapt_config(
            NGINX_CONF.read_text(), workdir,
            {"sluice-a": (a.http_port, a.grpc_port), "sluice-b": (b.http_port, b.grpc_port)},
            http_port, grpc_port,
        )  # fmt: skip
        nginx = NginxProcess(workdir, text, http_port, grpc_port)
        nginx.start()
    except BaseException:
        for server in replicas:
            server.stop()
        redis_server.stop()
        raise
    return Cluster(replicas, nginx, redis_server, keys)


def stop_cluster(cluster: Cluster) -> None:
    cluster.nginx.stop()
    for server in cluster.replicas:
        server.stop()
    cluster.redis.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    started = start_cluster(tmp_path_factory.mktemp("scale-out"))
    yield started
    stop_cluster(started)


def wait_for_redis_keys(url: str, pattern: str, timeout_s: float = 10) -> list[bytes]:
    """Polls Redis until a key matches (the cache store may finish after the reply)."""
    client = redis.Redis.from_url(url)
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = list(client.scan_iter(match=pattern))
            if found:
                return found
            time.sleep(0.02)
    finally:
        client.close()
    raise AssertionError(f"no Redis key matching {pattern!r} after {timeout_s} s")


def test_a_result_computed_on_one_replica_is_a_hit_on_the_other(cluster: Cluster) -> None:
    a, b = cluster.replicas
    request = body(seed=1)
    headers = cluster.headers("other")
    first = httpx.post(a.url + INFER, json=request, headers=headers, timeout=10)
    assert first.status_code == 200, first.text
    assert first.json()["parameters"]["cache_hit"] is False
    wait_for_redis_keys(cluster.redis.url, "sluice:*demo*")
    second = httpx.post(b.url + INFER, json=request, headers=headers, timeout=10)
    assert second.status_code == 200, second.text
    assert second.json()["parameters"]["cache_hit"] is True
    assert second.json()["outputs"] == first.json()["outputs"]
    # And through the balancer, whichever replica answers.
    for _ in range(4):
        through = httpx.post(cluster.url + INFER, json=request, headers=headers, timeout=10)
        assert through.json()["parameters"]["cache_hit"] is True
        assert through.json()["outputs"] == first.json()["outputs"]


def test_a_tenants_rate_limit_holds_across_replicas(cluster: Cluster) -> None:
    a, b = cluster.replicas
    statuses = []
    for i in range(2 * BURST):
        replica = (a, b)[i % 2]
        response = httpx.post(
            replica.url + INFER, json=body(seed=100 + i, cache=False),
            headers=cluster.headers("acme"), timeout=10,
        )  # fmt: skip
        statuses.append((replica is a, response.status_code))
        if response.status_code == 429:
            assert float(response.headers["Retry-After"]) > 0
    # One bucket in Redis: BURST requests in all, alternating replicas, then 429 from both.
    assert statuses == [(i % 2 == 0, 200) for i in range(BURST)] + [
        (i % 2 == 0, 429) for i in range(BURST, 2 * BURST)
    ]
    through = httpx.post(cluster.url + INFER, json=body(seed=999, cache=False),
                         headers=cluster.headers("acme"), timeout=10)  # fmt: skip
    assert through.status_code == 429  # nginx does not retry a 429: it would only fail again
    assert "Retry-After" in through.headers
    other = httpx.post(cluster.url + INFER, json=body(seed=1000, cache=False),
                       headers=cluster.headers("other"), timeout=10)  # fmt: skip
    assert other.status_code == 200  # the limit is acme's alone


class Progress:
    """Counts successful requests; `warm` once the load is established, `stop` once the
    surviving replica has served AFTER_EXIT requests on its own."""

    def __init__(self) -> None:
        self.done = 0
        self.warm = asyncio.Event()
        self.stop = asyncio.Event()
        self.exited_at: int | None = None

    def add(self) -> None:
        self.done += 1
        if self.done >= WARM_UP:
            self.warm.set()
        if self.exited_at is not None and self.done >= self.exited_at + AFTER_EXIT:
            self.stop.set()


WARM_UP = 150
AFTER_EXIT = 150


async def steady_load(cluster: Cluster, progress: Progress, workers: int = 6) -> list[str]:
    """Requests through nginx from `workers` clients until `progress.stop`; the failures."""
    failures: list[str] = []

    async def client(index: int, http: httpx.AsyncClient) -> None:
        seed = index * 1_000_000
        while not progress.stop.is_set():
            seed += 1
            try:
                response = await http.post(INFER, json=body(seed, cache=False))
            except httpx.HTTPError as exc:
                failures.append(f"{type(exc).__name__}: {exc}")
                continue
            if response.status_code == 200:
                progress.add()
            else:
                failures.append(f"{response.status_code}: {response.text[:200]}")

    limits = httpx.Limits(max_connections=workers)
    async with (
        httpx.AsyncClient(
            base_url=cluster.url, headers=cluster.headers("other"), timeout=30, limits=limits
        ) as http,
        asyncio.TaskGroup() as group,
    ):
        for index in range(workers):
            group.create_task(client(index, http))
    return failures


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_sigterm_to_one_replica_under_load_fails_no_request(tmp_path: Path) -> None:
    # A longer batch window keeps requests queued in the replica when SIGTERM lands.
    cluster = await asyncio.to_thread(start_cluster, tmp_path, 0.02)
    try:
        a, _ = cluster.replicas
        progress = Progress()
        async with asyncio.timeout(120):
            load = asyncio.create_task(steady_load(cluster, progress))
            await progress.warm.wait()
            stats = await asyncio.to_thread(
                httpx.get, f"{a.url}/v2/models/demo/stats", headers=cluster.headers("other")
            )
            assert stats.json()["model_stats"][0]["inference_stats"]["success"]["count"] > 0
            a.terminate()
            exit_code = await asyncio.to_thread(a.wait, 30.0)
            progress.exited_at = progress.done
            failures = await load
        assert failures == []
        assert exit_code == 0  # a drained what it had accepted and exited cleanly
        assert progress.done >= progress.exited_at + AFTER_EXIT  # b alone carried the load
        assert "draining" in a.logs()
    finally:
        await asyncio.to_thread(stop_cluster, cluster)
