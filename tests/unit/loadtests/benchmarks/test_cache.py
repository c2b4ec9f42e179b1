"""loadtests.benchmarks.cache: its request bodies, with the cache or asking for none, and its
table of the hit path against the computed path."""

from __future__ import annotations

import json

import numpy as np

from loadtests.benchmarks.cache import bodies, table


def test_bodies_ask_for_no_cache_only_on_the_computed_path() -> None:
    cached, computed = bodies("mlp", cache=True), bodies("mlp", cache=False)
    assert json.loads(cached["json"][0])["parameters"] == {}
    assert json.loads(computed["json"][0])["parameters"] == {"cache": False}
    body, headers = computed["binary"]
    length = int(headers["Inference-Header-Content-Length"])
    header = json.loads(body[:length])
    assert header["parameters"] == {"cache": False}
    data = np.frombuffer(body[length:], np.float32)
    assert data.tolist() == json.loads(computed["json"][0])["inputs"][0]["data"]


def test_the_table_says_how_many_times_faster_a_hit_is() -> None:
    rows = [
        {"backend": "memory", "path": path, "protocol": "json", "throughput": rps,
         "p50_us": 800.0, "p99_us": 2000.0, "errors": 0, "non2xx": 0}
        for path, rps in (("computed", 1000.0), ("hit", 4500.0))
    ]  # fmt: skip
    text = table({"rows": rows, "concurrency": 16, "machine": {"cpus": 2}}, 3.0)
    assert "| memory | hit | json | 4,500 | 4.5 | 0.80 | 2.00 | 0 |" in text.splitlines()
    assert "| memory | computed | json | 1,000 | 1.0 | 0.80 | 2.00 | 0 |" in text.splitlines()
