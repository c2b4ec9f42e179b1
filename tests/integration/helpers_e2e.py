"""Shared pieces of the end-to-end cache and admission tests (test_cache_e2e.py,
test_admission_e2e.py): model repositories, server configs and keys, requests, Prometheus reads
and bounded polling. Every server here is a real `sluice serve` process."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import numpy as np
import onnx
import yaml
from onnx import TensorProto, helper, numpy_helper
from prometheus_client.parser import text_string_to_metric_families

from engine.auth import digest_key
from engine.demo import mlp_model
from server.keys import new_key
from tests.models import write_model
from tests.servers import ServerProcess

T = TypeVar("T")

DEMO_WIDTH = 16
"""Columns of the demo model's input `x` (output `probabilities` has 10)."""


def cache_config(ttl_s: float = 60.0) -> str:
    """The `cache:` block of a model's config.yaml that turns the result cache on."""
    return f"cache:\n  enabled: true\n  ttl_s: {ttl_s}\n"


def held_batching(delay_s: float) -> str:
    """Batching that holds every batch `delay_s` after its first request, even when idle, so
    requests sent together are in flight together."""
    return (
        f"max_batch_size: 64\ndynamic_batching:\n  max_queue_delay_s: {delay_s}\n"
        "  dispatch_when_idle: false\n"
    )


def demo_repository(root: Path, configs: dict[str, str]) -> Path:
    """A repository with one copy of the demo MLP per entry of `configs` (name -> config.yaml)."""
    for name, config in configs.items():
        write_model(root, name, mlp_model(), config)
    return root


def slow_model(width: int = 1024, depth: int = 40, seed: int = 0) -> onnx.ModelProto:
    """`x` FP32 [batch, 16] -> `depth` x (MatMul by one shared [width, width] weight, Tanh) ->
    `y` FP32 [batch, 10]. Costs about 0.7 ms per row per 40 layers on one core with 4 MB of
    weights whatever the depth: deep enough, a handful of HTTP clients keep its queue full."""
    rng = np.random.default_rng(seed)
    weights = {
        "w_in": rng.standard_normal((DEMO_WIDTH, width)) / 4,
        "w": rng.standard_normal((width, width)) / np.sqrt(width),
        "w_out": rng.standard_normal((width, 10)) / np.sqrt(width),
    }
    inits = [numpy_helper.from_array(w.astype(np.float32), n) for n, w in weights.items()]
    nodes = [helper.make_node("MatMul", ["x", "w_in"], ["h"])]
    current = "h"
    for layer in range(depth):
        nodes.append(helper.make_node("MatMul", [current, "w"], [f"m{layer}"]))
        nodes.append(helper.make_node("Tanh", [f"m{layer}"], [f"t{layer}"]))
        current = f"t{layer}"
    nodes.append(helper.make_node("MatMul", [current, "w_out"], ["y"]))
    graph = helper.make_graph(
        nodes,
        "slow",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", DEMO_WIDTH])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 10])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def write_settings(path: Path, settings: dict[str, Any]) -> Path:
    """Write a server settings YAML file (for `--config`)."""
    path.write_text(yaml.safe_dump(settings, sort_keys=False))
    return path


@dataclass(frozen=True)
class Key:
    """An API key made the way `sluice keys create` makes one, and its `auth.keys` entry."""

    key: str
    tenant: str
    role: str = "user"
    models: tuple[str, ...] | None = None

    @classmethod
    def create(cls, tenant: str, role: str = "user", models: Sequence[str] | None = None) -> Key:
        return cls(new_key(), tenant, role, None if models is None else tuple(models))

    def entry(self) -> dict[str, Any]:
        found: dict[str, Any] = {"digest": digest_key(self.key), "tenant": self.tenant}
        found["role"] = self.role
        if self.models is not None:
            found["models"] = list(self.models)
        return found

    def bearer(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}

    def x_api_key(self) -> dict[str, str]:
        return {"x-api-key": self.key}


def demo_input(seed: int, rows: int = 1) -> list[float]:
    """Distinct, deterministic input values for the demo-shaped models (x: [rows, 16])."""
    values = np.random.default_rng(seed).standard_normal(rows * DEMO_WIDTH).astype(np.float32)
    return [float(v) for v in values]


def infer_body(
    seed: int, rows: int = 1, parameters: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A JSON inference request for a demo-shaped model."""
    tensor = {"name": "x", "datatype": "FP32", "shape": [rows, DEMO_WIDTH]}
    body: dict[str, Any] = {"inputs": [{**tensor, "data": demo_input(seed, rows)}]}
    if parameters is not None:
        body["parameters"] = parameters
    return body


def output_data(response: httpx.Response) -> list[float]:
    """The first output's values of a 200 JSON inference response."""
    assert response.status_code == 200, response.text
    data: list[float] = response.json()["outputs"][0]["data"]
    return data


def cache_hit(response: httpx.Response) -> bool | None:
    """The response's `cache_hit` parameter (None when the cache was not consulted)."""
    assert response.status_code == 200, response.text
    hit: bool | None = (response.json().get("parameters") or {}).get("cache_hit")
    return hit


def metrics(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the server's /metrics: (name, sorted labels) -> value."""
    response = httpx.get(f"{url}/metrics", timeout=5.0)
    assert response.status_code == 200, response.text
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def metric(url: str, name: str, **labels: str) -> float:
    """One sample of /metrics (0 when the server does not report it yet)."""
    return metrics(url).get((name, tuple(sorted(labels.items()))), 0.0)


def model_counts(url: str, model: str) -> dict[str, float]:
    """A model's executed batches, inferred rows, cache hits and misses from its Triton
    statistics (`GET /v2/models/<model>/stats`), checked against /metrics, which must agree.
    Call it only while no request is running, or the two reads may see different moments."""
    response = httpx.get(f"{url}/v2/models/{model}/stats", timeout=5.0)
    assert response.status_code == 200, response.text
    stats = response.json()["model_stats"][0]
    counts = {
        "executions": stats["execution_count"],
        "rows": stats["inference_count"],
        "hits": stats["inference_stats"]["cache_hit"]["count"],
        "misses": stats["inference_stats"]["cache_miss"]["count"],
    }
    labels = (("model", model), ("version", "1"))
    found = metrics(url)
    exported = {
        "executions": found.get(("sluice_executions_total", labels)),
        "rows": found.get(("sluice_inference_rows_total", labels)),
    }
    assert exported == {"executions": counts["executions"], "rows": counts["rows"]}, exported
    return counts


def cache_errors(url: str) -> float:
    """The server's `sluice_cache_errors_total` (Redis failures, timeouts and skipped calls)."""
    return metric(url, "sluice_cache_errors_total")


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {name: after[name] - before[name] for name in before}


class Stream:
    """Requests to `urls` in turn, one after another in each of `workers` threads, from
    `__enter__` until `__exit__`. `seed(n)` picks the input of the n-th request. Records every
    answer: `statuses` counts (url index, status) pairs, status 0 for a transport error."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        seed: Callable[[int], int] = lambda sent: sent,
        headers: dict[str, str] | None = None,
        workers: int = 1,
    ) -> None:
        self.urls = list(urls)
        self.sent = 0
        self.statuses: Counter[tuple[int, int]] = Counter()
        self.errors: list[str] = []
        self._seed = seed
        self._headers = headers or {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(workers)]

    def __enter__(self) -> Stream:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(30)

    @property
    def answered(self) -> int:
        """Requests answered so far (transport errors included)."""
        with self._lock:
            return sum(self.statuses.values())

    def failures(self, allowed: Sequence[int] = (200,)) -> list[str]:
        """Every answer whose status is not in `allowed`, with its error text."""
        return [error for error in self.errors if int(error.split(" ", 2)[1]) not in allowed]

    def _run(self) -> None:
        with httpx.Client(timeout=10.0, headers=self._headers) as client:
            while not self._stop.is_set():
                with self._lock:
                    number = self.sent
                    self.sent += 1
                index = number % len(self.urls)
                url = f"{self.urls[index]}/v2/models/demo/infer"
                try:
                    response = client.post(url, json=infer_body(self._seed(number)))
                    status, text = response.status_code, response.text
                except httpx.HTTPError as exc:
                    status, text = 0, f"{type(exc).__name__}: {exc}"
                with self._lock:
                    self.statuses[(index, status)] += 1
                    if status != 200:
                        self.errors.append(f"{self.urls[index]} {status} {text}")


def wait_for(condition: Callable[[], T | None], timeout_s: float, what: str) -> T:
    """Poll `condition` until it returns something truthy (and return that), at most
    `timeout_s`; fail naming `what` otherwise."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = condition()
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.02)


def start_all(servers: Sequence[ServerProcess], timeout_s: float = 60.0) -> None:
    """Start several servers at once (each start is mostly waiting for imports); if one fails,
    stop them all and raise its error."""
    with ThreadPoolExecutor(len(servers)) as pool:
        futures = [pool.submit(server.start, timeout_s) for server in servers]
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        stop_all(servers)
        raise errors[0]  # type: ignore[misc]


def stop_all(servers: Sequence[ServerProcess]) -> None:
    with ThreadPoolExecutor(len(servers)) as pool:
        list(pool.map(lambda server: server.stop(), servers))
