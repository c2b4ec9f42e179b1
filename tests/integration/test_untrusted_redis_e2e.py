"""Values planted in Redis, end to end: real `sluice serve` processes sharing a real redis-server.

Whoever can write to Redis can plant rate-limit state and cache entries. Planted limit state must
never turn into a 5xx or a lifted limit; planted cache entries (with a valid CRC, and with
`cache.signing_key` even with a valid signature) must never be served unless they are what the
model computes for the request."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from engine.cache.codec import Signer, decode, encode
from engine.cache.contract import CachedResult
from tests.integration.helpers_e2e import (
    Key,
    cache_config,
    cache_hit,
    demo_repository,
    infer_body,
    start_all,
    stop_all,
    wait_for,
    write_settings,
)
from tests.redis_process import RedisProcess
from tests.servers import ServerProcess

SECRET = "e2e-signing-key-0123456789abcdef"
BUCKETS = {
    "tokens -1e999": {"tokens": "-1e999", "ts": "0"},
    "tokens 1e999": {"tokens": "1e999", "ts": "0"},
    "tokens nan": {"tokens": "nan", "ts": "0"},
    "tokens inf": {"tokens": "inf", "ts": "0"},
    "tokens abc": {"tokens": "abc", "ts": "0"},
    "tokens negative": {"tokens": "-7", "ts": "0"},
    "ts -1e999": {"tokens": "0", "ts": "-1e999"},  # an endless refill: no limit at all
    "ts missing": {"tokens": "0"},
    "wrong fields": {"level": "1", "stamp": "2"},
    "a list": None,
}
QUOTAS = {
    "used -1e999": "-1e999",
    "used 1e999": "1e999",
    "used nan": "nan",
    "used abc": "abc",
    "used negative": "-2",
    "used non-integer": "1.5",
    "a list": None,
}
BUCKET_KEYS = {case: Key.create(f"bucket-{i}") for i, case in enumerate(BUCKETS)}
QUOTA_KEYS = {case: Key.create(f"quota-{i}") for i, case in enumerate(QUOTAS)}
CACHE_KEY = Key.create("cachey")  # no limits: the cache tests are never rate limited


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisProcess]:
    process = RedisProcess(tmp_path_factory.mktemp("untrusted-redis"))
    process.start()
    yield process
    process.stop()


def repository(root: Path) -> Path:
    return demo_repository(root, {"demo": "max_batch_size: 64\n" + cache_config()})


def server(
    folder: Path, name: str, settings: dict[str, Any], env: dict[str, str] | None = None
) -> ServerProcess:
    config = write_settings(folder / f"{name}.yaml", settings)
    return ServerProcess(
        "--config", str(config), "--model-repository", str(repository(folder / f"repo-{name}")),
        log_path=folder / f"{name}.log", grpc=False, env=env,
    )  # fmt: skip


def redis_cache(url: str, **extra: Any) -> dict[str, Any]:
    return {"redis_url": url, "redis_timeout_s": 0.5, "redis_retry_interval_s": 0.2, **extra}


@pytest.fixture(scope="module")
def plain(
    redis_server: RedisProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """Limits in Redis (fail closed: a script error would be a 503) and the `redis` cache."""
    keys = [*BUCKET_KEYS.values(), *QUOTA_KEYS.values(), CACHE_KEY]
    tenants: dict[str, Any] = {
        k.tenant: {"rate_per_s": 0.01, "burst": 2} for k in BUCKET_KEYS.values()
    }
    tenants |= {k.tenant: {"quota_per_day": 3} for k in QUOTA_KEYS.values()}
    settings = {
        "auth": {"keys": [key.entry() for key in keys]},
        "rate_limit": {
            "backend": "redis",
            "redis_url": redis_server.url,
            "fail_open": False,
            "redis_timeout_s": 0.5,
            "tenants": tenants,
        },
        "cache": {"backend": "redis", **redis_cache(redis_server.url)},
    }
    process = server(tmp_path_factory.mktemp("untrusted-plain"), "plain", settings)
    start_all([process])
    yield process
    stop_all([process])


@pytest.fixture(scope="module")
def signed(
    redis_server: RedisProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """Two replicas with the same `cache.signing_key`: A `tiered`, B `redis`."""
    folder = tmp_path_factory.mktemp("untrusted-signed")
    settings = {"cache": {"backend": "redis", **redis_cache(redis_server.url)}}
    env = {"SLUICE_CACHE__SIGNING_KEY": SECRET}  # the environment route for a secret
    processes = [
        server(folder, "a", {"cache": {**settings["cache"], "backend": "tiered"}}, env),
        server(folder, "b", settings, env),
    ]
    start_all(processes)
    yield processes[0], processes[1]
    stop_all(processes)


def client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, socket_timeout=2.0)


def infer(url: str, body: dict[str, Any], key: Key | None = None) -> httpx.Response:
    headers = key.bearer() if key is not None else {}
    return httpx.post(f"{url}/v2/models/demo/infer", json=body, headers=headers, timeout=10.0)


def usage(url: str, key: Key) -> httpx.Response:
    return httpx.get(f"{url}/v2/tenants/self/usage", headers=key.bearer(), timeout=10.0)


# -- rate-limit state ----------------------------------------------------------------------------


def plant(url: str, key: str, fields: dict[str, str] | None) -> None:
    with client(url) as connection:
        connection.delete(key)
        if fields is None:
            connection.rpush(key, "planted", "list")
        else:
            connection.hset(key, mapping=fields)


def counter(url: str, name: str) -> float:
    """A label-less counter's value on the server's /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == f"{name}_total":
                return float(sample.value)
    raise AssertionError(f"{name} is not exported")


@pytest.mark.parametrize("case", BUCKETS)
def test_a_planted_bucket_never_answers_5xx_and_the_limit_holds(
    plain: ServerProcess, redis_server: RedisProcess, case: str
) -> None:
    key = BUCKET_KEYS[case]
    garbage = counter(plain.url, "sluice_admission_garbage_state")
    plant(redis_server.url, f"sluice:rl:{{{key.tenant}}}:*:bucket", BUCKETS[case])
    before = usage(plain.url, key)
    assert counter(plain.url, "sluice_admission_garbage_state") == garbage + 1
    assert before.status_code == 200, before.text
    assert before.json()["rate"]["available"] == 2.0
    assert before.json()["source"] == "redis"
    statuses = Counter(infer(plain.url, infer_body(seed=1), key).status_code for _ in range(12))
    assert statuses == {200: 2, 429: 10}
    after = usage(plain.url, key)
    assert after.status_code == 200, after.text
    assert after.json()["rate"]["available"] < 1


@pytest.mark.parametrize("case", QUOTAS)
def test_a_planted_quota_counter_never_answers_5xx_and_the_quota_holds(
    plain: ServerProcess, redis_server: RedisProcess, case: str
) -> None:
    key = QUOTA_KEYS[case]
    seconds, _ = client(redis_server.url).time()
    used = QUOTAS[case]
    fields = None if used is None else {"window": str(seconds // 86_400), "used": used}
    plant(redis_server.url, f"sluice:rl:{{{key.tenant}}}:*:day", fields)
    before = usage(plain.url, key)
    assert before.status_code == 200, before.text
    assert (before.json()["day"]["used"], before.json()["day"]["remaining"]) == (0, 3)
    statuses = [infer(plain.url, infer_body(seed=2), key).status_code for _ in range(6)]
    assert statuses == [200, 200, 200, 429, 429, 429]
    assert usage(plain.url, key).json()["day"]["used"] == 3


# -- cache entries -------------------------------------------------------------------------------


def demo_keys(url: str) -> set[bytes]:
    with client(url) as connection:
        return set(connection.keys("sluice:demo:*"))


def stored_key(redis_url: str, before: set[bytes]) -> bytes:
    """The one cache key written since `before` (stores reach Redis after the reply)."""
    found = wait_for(
        lambda: (demo_keys(redis_url) - before) or None, 5.0, "the result to reach Redis"
    )
    assert len(found) == 1, found
    return found.pop()


def first_output(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    output: dict[str, Any] = response.json()["outputs"][0]
    return output


def as_result(response: httpx.Response) -> CachedResult:
    output = first_output(response)
    array = np.array(output["data"], dtype=np.float32).reshape(output["shape"])
    return CachedResult({output["name"]: array}, {output["name"]: output["datatype"]})


def renamed(good: CachedResult) -> CachedResult:
    ((name, array),) = good.outputs.items()
    return CachedResult({f"{name}_planted": array}, {f"{name}_planted": "FP32"})


def retyped(good: CachedResult) -> CachedResult:
    ((name, array),) = good.outputs.items()
    return CachedResult({name: array.astype(np.int32)}, {name: "INT32"})


def thousand_rows(good: CachedResult) -> CachedResult:
    ((name, array),) = good.outputs.items()
    return CachedResult({name: np.resize(array, (1000, array.shape[1]))}, dict(good.datatypes))


PLANTS: dict[str, Callable[[CachedResult], CachedResult]] = {
    "wrong output name": renamed,
    "wrong datatype": retyped,
    "1000 rows for a 2-row request": thousand_rows,
}


@pytest.mark.parametrize("case", PLANTS)
def test_a_planted_entry_with_a_valid_crc_is_not_served(
    plain: ServerProcess, redis_server: RedisProcess, case: str
) -> None:
    body = infer_body(seed=300 + list(PLANTS).index(case), rows=2)
    before = demo_keys(redis_server.url)
    computed = infer(plain.url, body, CACHE_KEY)
    assert cache_hit(computed) is False
    key = stored_key(redis_server.url, before)
    with client(redis_server.url) as connection:
        connection.set(key, encode(PLANTS[case](as_result(computed))), px=60_000)
    rejected = counter(plain.url, "sluice_cache_rejected")
    answered = infer(plain.url, body, CACHE_KEY)
    assert cache_hit(answered) is False
    assert counter(plain.url, "sluice_cache_rejected") == rejected + 1
    assert first_output(answered) == first_output(computed)
    # The server's own result replaced the planted one: the next identical request hits.
    wait_for(
        lambda: cache_hit(infer(plain.url, body, CACHE_KEY)) or None, 5.0, "a hit on the answer"
    )


def test_replicas_with_one_signing_key_share_entries_and_refuse_others(
    signed: tuple[ServerProcess, ServerProcess], redis_server: RedisProcess
) -> None:
    a, b = signed
    body = infer_body(seed=401, rows=2)
    before = demo_keys(redis_server.url)
    computed = infer(a.url, body)
    assert cache_hit(computed) is False
    key = stored_key(redis_server.url, before)
    with client(redis_server.url) as connection:
        signed_value = connection.get(key)
    hit = infer(b.url, body)  # B has no memory tier: this hit is A's signed entry from Redis
    assert cache_hit(hit) is True
    assert first_output(hit) == first_output(computed)

    # The same answer written by a server without the key, then a forged signature: misses.
    unsigned = encode(decode(signed_value))
    forged = bytearray(unsigned)
    forged[5] = 1  # "signed"
    forged += os.urandom(32)
    for planted in (unsigned, bytes(forged)):
        with client(redis_server.url) as connection:
            connection.set(key, planted, px=60_000)
        answered = infer(b.url, body)
        assert cache_hit(answered) is False
        assert first_output(answered) == first_output(computed)

    # A valid signed entry moved to another request's key is refused there.
    other = infer_body(seed=402, rows=2)
    before = demo_keys(redis_server.url)
    other_computed = infer(b.url, other)
    other_key = stored_key(redis_server.url, before)
    with client(redis_server.url) as connection:
        connection.set(other_key, signed_value, px=60_000)
    moved = infer(b.url, other)
    assert cache_hit(moved) is False
    assert first_output(moved) == first_output(other_computed)


def test_a_signed_entry_that_does_not_fit_never_reaches_the_memory_tier(
    signed: tuple[ServerProcess, ServerProcess], redis_server: RedisProcess
) -> None:
    a, b = signed
    body = infer_body(seed=501, rows=2)
    before = demo_keys(redis_server.url)
    computed = infer(b.url, body)  # stored by B; A has not seen this request yet
    key = stored_key(redis_server.url, before)
    # Signed with the right key for the right Redis key, but 1000 rows for a 2-row request.
    planted = encode(thousand_rows(as_result(computed)), signer=Signer(SECRET.encode()), key=key)
    with client(redis_server.url) as connection:
        connection.set(key, planted, px=60_000)
    first = infer(a.url, body)
    assert cache_hit(first) is False
    assert first_output(first) == first_output(computed)
    # A stored its own answer in memory before replying, not the planted entry: a memory hit.
    second = infer(a.url, body)
    assert cache_hit(second) is True
    assert first_output(second) == first_output(computed)
