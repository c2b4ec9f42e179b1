"""The result-cache path (engine/cache/inference.py) on a real demo model with the memory cache:
how its requests count in the model's Triton statistics."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from engine.demo import write_demo_repository
from engine.engine import Engine
from engine.types import InferRequest
from server.settings import load_settings


@pytest.fixture
async def engine(tmp_path: Path) -> AsyncIterator[Engine]:
    repo = write_demo_repository(tmp_path / "models")
    config = repo / "demo" / "config.yaml"
    config.write_text(config.read_text() + "cache: {enabled: true, ttl_s: 60}\n")
    engine = Engine(load_settings(model_repository=repo))
    await engine.start()
    yield engine
    await engine.close()


def _ask(engine: Engine) -> asyncio.Task[object]:
    x = np.full((1, 16), 0.25, np.float32)
    return asyncio.create_task(engine.infer(InferRequest("demo", {"x": x}, {"x": "FP32"})))


async def _until(condition: object, what: str) -> None:
    deadline = time.monotonic() + 10
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.001)


async def test_coalesced_requests_and_hits_count_in_queue_as_in_success(engine: Engine) -> None:
    """16 identical requests while the first is queued: one computation, 15 callers joined it;
    then 2 cache hits. Triton counts every success in `queue`, cache hits included (before, the
    joiners were missing there: queue 3 for 18 successes); every lookup that missed is a miss."""
    model = engine.registry.resolve("demo", None)
    stats = model.stats
    model.batcher.pause()  # hold the computation in the queue while the others join it
    callers = [_ask(engine) for _ in range(16)]
    await _until(lambda: stats.cache_miss.count == 16, "16 lookups")
    looked_up = time.monotonic()  # every caller has joined: each is queued from before here
    await asyncio.sleep(0.01)  # not a synchronization: makes the wait below worth measuring
    resumed = time.monotonic()
    model.batcher.resume()
    await asyncio.wait_for(asyncio.gather(*callers), 10)
    await asyncio.wait_for(asyncio.gather(_ask(engine), _ask(engine)), 10)

    counts = stats.triton("demo", "1")["inference_stats"]
    assert {name: value["count"] for name, value in counts.items()} == {
        "success": 18,
        "fail": 0,
        "queue": 18,  # 1 computed + 15 joined + 2 hits
        "compute_input": 1,
        "compute_infer": 1,
        "compute_output": 1,
        "cache_hit": 2,
        "cache_miss": 16,
    }
    assert (stats.execution_count, stats.inference_count) == (1, 1)
    # The computation and each joiner waited at least from `looked_up` to `resumed` (a hit: 0).
    assert counts["queue"]["ns"] >= 16 * ((resumed - looked_up) * 1e9 - 1)
    assert counts["queue"]["ns"] <= counts["success"]["ns"]
