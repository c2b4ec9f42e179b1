"""The batcher's queue (batching/queue.py) through a Batcher: priority levels served highest
first, FIFO within a level; tenants taking turns within a level; a tenant's share and the
queue's bound refusing at once. pause() holds batch formation, so batch composition is exact."""

from __future__ import annotations

import asyncio

import pytest

from batching.batcher import Batcher
from batching.errors import QueueFull
from batching.policy import BatchPolicy
from tests.unit.batching.recorder import Recorder, make, rows, submit_all


async def test_level_one_first_fifo_within_level(recorder: Recorder) -> None:
    # Triton's numbering: levels 1..N, 1 the highest.
    batcher = make(recorder, max_batch_size=1, priority_levels=3)
    batcher.pause()
    low = await submit_all(batcher, [rows(1), rows(2)], priority=3)
    middle = await submit_all(batcher, [rows(5)], priority=2)
    high = await submit_all(batcher, [rows(3), rows(4)], priority=1)
    batcher.resume()
    await asyncio.gather(*low, *middle, *high)
    assert recorder.batches == [[3], [4], [5], [1], [2]]
    await batcher.close()


async def test_a_level_outside_the_queue_is_refused(recorder: Recorder) -> None:
    batcher = make(recorder, priority_levels=2)
    for level in (0, 3):
        with pytest.raises(ValueError, match=f"priority level {level} is not in 1..2"):
            await batcher.submit(rows(1), 1, priority=level)
    assert batcher.queue.requests == 0
    await batcher.close()


async def test_tenants_share_a_level_round_robin(recorder: Recorder) -> None:
    batcher = make(recorder, max_batch_size=2)
    batcher.pause()
    flood = await submit_all(batcher, [rows(i) for i in range(6)], tenant="flood")
    modest = await submit_all(batcher, [rows(100), rows(101)], tenant="modest")
    batcher.resume()
    await asyncio.gather(*flood, *modest)
    # The modest tenant's requests are in the first two batches, not after the flood.
    assert recorder.batches[0] == [0, 100]
    assert sorted(recorder.batches[1]) == [1, 101]
    await batcher.close()


async def test_tenant_share_caps_queued_rows(recorder: Recorder) -> None:
    batcher = Batcher(
        recorder,
        BatchPolicy(max_batch_size=4, max_queue_delay_s=5.0, max_queue_size=10),
        tenant_share=lambda tenant: 0.3 if tenant == "flood" else 1.0,
    )
    batcher.pause()
    tasks = await submit_all(batcher, [rows(i) for i in range(3)], tenant="flood")
    with pytest.raises(QueueFull, match="tenant 'flood' holds 3 queued rows"):
        await batcher.submit(rows(9), 1, tenant="flood")
    other = await submit_all(batcher, [rows(50)], tenant="other")
    batcher.resume()
    await asyncio.gather(*tasks, *other)
    assert sorted(tag for batch in recorder.batches for tag in batch) == [0, 1, 2, 50]
    await batcher.close()


async def test_full_queue_rejects_at_once(recorder: Recorder) -> None:
    batcher = make(recorder, max_queue_size=4, max_queue_delay_s=0.05)
    batcher.pause()
    tasks = await submit_all(batcher, [rows(1, 3)])
    with pytest.raises(QueueFull, match="3 of 4 rows queued, request has 2"):
        await batcher.submit(rows(2, 2), 2)
    batcher.resume()
    await asyncio.gather(*tasks)
    await batcher.close()


async def test_unbatched_model_serves_tenants_round_robin(recorder: Recorder) -> None:
    batcher = make(recorder, max_batch_size=0)
    batcher.pause()
    a = await submit_all(batcher, [rows(i) for i in range(3)], tenant="a")
    b = await submit_all(batcher, [rows(i) for i in range(10, 13)], tenant="b")
    batcher.resume()
    await asyncio.gather(*a, *b)
    assert recorder.batches == [[0], [10], [1], [11], [2], [12]]
    await batcher.close()
