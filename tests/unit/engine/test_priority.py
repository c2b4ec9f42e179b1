"""Request priorities in the engine, numbered as Triton numbers them: `priority_levels: N` means
levels 1..N with 1 the highest; 0 (or none) means the model's `default_priority_level`; a tenant's
`priority` uses the same numbering and bounds what its requests may ask for.

Ordering is deterministic: the batcher's test hook (`pause`) holds batch formation while every
request is queued, and each request is a batch of its own (max_batch_size 1)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine.auth import digest_key
from engine.engine import Engine
from engine.errors import Forbidden, InvalidInput
from engine.triton_config import triton_config
from engine.types import InferRequest
from server.settings import load_settings
from tests.models import identity_model, write_model

CONFIG = "max_batch_size: 1\ndynamic_batching:\n  priority_levels: 3\n  default_priority_level: 2\n"
TENANTS = {"gold": {"priority": 1}, "silver": {"priority": 7}}  # 7 is below level 3: level 3
OUT_OF_RANGE = (
    "priority {asked} is out of range for model 'm' version 1: its priority levels are 1 "
    "(highest) to 3 (lowest), and 0 or none means its default level 2"
)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    write_model(tmp_path, "m", identity_model("FP32"), CONFIG)
    return tmp_path


async def started(repo: Path, **settings: Any) -> Engine:
    engine = Engine(load_settings(model_repository=repo, grpc_enabled=False, **settings))
    await engine.start()
    return engine


@pytest.fixture
async def engine(repo: Path) -> AsyncIterator[Engine]:
    engine = await started(repo)
    yield engine
    await engine.close()


@pytest.fixture
async def keyed(repo: Path) -> AsyncIterator[Engine]:
    """API keys configured: tenants may not ask for more than their own priority."""
    keys = [{"digest": digest_key(f"key-{t}"), "tenant": t} for t in ("gold", "silver", "bronze")]
    engine = await started(repo, auth={"keys": keys}, rate_limit={"tenants": TENANTS})
    yield engine
    await engine.close()


def request(tag: float, priority: int | None = None, tenant: str | None = None) -> InferRequest:
    x = np.full((1, 4), tag, np.float32)
    return InferRequest("m", {"INPUT0": x}, {"INPUT0": "FP32"}, priority=priority, tenant=tenant)


async def served_order(engine: Engine, requests: list[InferRequest]) -> list[float]:
    """Queue every request while batch formation is held, then let it go: the tags in the order
    their answers came back."""
    batcher = engine.registry.resolve("m", None).batcher
    order: list[float] = []
    batcher.pause()
    tasks = []
    for item in requests:
        task = asyncio.create_task(engine.infer(item))
        task.add_done_callback(lambda t: order.append(float(t.result().outputs["OUTPUT0"][0, 0])))
        tasks.append(task)
    await poll_queued(engine, len(requests))
    batcher.resume()
    await asyncio.wait_for(asyncio.gather(*tasks), 10)
    return order


async def poll_queued(engine: Engine, count: int) -> None:
    queue = engine.registry.resolve("m", None).batcher.queue
    async with asyncio.timeout(10):  # a bounded poll: the queue has no event to wait on
        while queue.requests < count:  # noqa: ASYNC110
            await asyncio.sleep(0.001)


async def test_level_one_is_served_before_level_three(engine: Engine) -> None:
    order = await served_order(
        engine, [request(3, priority=3), request(2), request(0, priority=0), request(1, 1)]
    )
    assert order == [1, 2, 0, 3]  # 1, then the default level 2 (none and 0) in FIFO order, then 3


async def test_the_last_level_is_accepted_and_one_past_it_is_invalid(engine: Engine) -> None:
    answer = await engine.infer(request(5, priority=3))
    assert answer.outputs["OUTPUT0"].tolist() == [[5, 5, 5, 5]]
    with pytest.raises(InvalidInput) as caught:
        await engine.infer(request(5, priority=4))
    assert str(caught.value) == OUT_OF_RANGE.format(asked=4)


def test_triton_config_reports_the_levels_the_triton_way(engine: Engine) -> None:
    config = triton_config(engine.registry.resolve("m", None))
    batching = config["dynamic_batching"]
    assert (batching["priority_levels"], batching["default_priority_level"]) == (3, 2)


@pytest.mark.parametrize(
    ("tenant", "asked", "level"), [("silver", 2, 3), ("silver", 1, 3), ("bronze", 1, 2)]
)
async def test_a_tenant_may_not_ask_for_a_higher_priority_than_its_own(
    keyed: Engine, tenant: str, asked: int, level: int
) -> None:
    with pytest.raises(Forbidden) as caught:
        await keyed.infer(request(1, priority=asked, tenant=tenant))
    assert str(caught.value) == (
        f"tenant '{tenant}' may use priority levels {level} to 3 of model 'm' version 1 (1 is "
        f"the highest); asked for {asked}"
    )


async def test_tenants_are_served_at_their_own_level_or_lower_if_they_ask(keyed: Engine) -> None:
    order = await served_order(
        keyed,
        [
            request(3, tenant="silver"),  # its own level, 3 (7 clipped to the model's lowest)
            request(2, tenant="bronze"),  # no priority of its own: the model's default, 2
            request(4, priority=3, tenant="gold"),  # asks for less than its own: allowed
            request(1, tenant="gold"),  # its own level, 1
            request(5, priority=0, tenant="bronze"),  # 0: its default, 2
        ],
    )
    assert order[:3] == [1, 2, 5]  # level 1, then level 2 in FIFO order
    assert sorted(order[3:]) == [3, 4]  # level 3: two tenants, served round-robin
