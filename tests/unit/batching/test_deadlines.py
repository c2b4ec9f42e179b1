"""The deadlines a batcher knows of: the soonest one queued, and no more entries than the queue."""

from __future__ import annotations

import asyncio
import gc
import weakref

import numpy as np

from batching.cost import BatchCost
from batching.deadlines import Deadlines
from batching.queue import Pending, RequestQueue


def pending(loop: asyncio.AbstractEventLoop, deadline: float) -> Pending:
    inputs = {"x": np.zeros((1, 2), np.float32)}
    return Pending(inputs, 1, 1, "", "g", 0.0, loop.create_future(), deadline)


async def test_the_soonest_deadline_is_of_a_request_still_queued() -> None:
    loop = asyncio.get_running_loop()
    queue = RequestQueue(levels=1, max_rows=64)
    deadlines = Deadlines(queue, BatchCost(), max_batch_size=8, label="m")
    assert deadlines.soonest() is None
    items = [pending(loop, due) for due in (3.0, 1.0, 2.0)]
    for item in items:
        queue.put(item)
        deadlines.add(item, item.deadline or 0.0)
    assert deadlines.soonest() == 1.0
    queue.cancel(items[1])  # withdrawn: its deadline no longer counts
    assert deadlines.soonest() == 2.0
    queue.take("g", max_rows=8)  # running: neither do theirs
    assert deadlines.soonest() is None


async def test_entries_stay_within_the_queue_and_hold_no_request() -> None:
    """Entries are weak and dropped once they outnumber what is queued: a server whose requests
    set long timeouts keeps neither their inputs nor an entry per request it ever served."""
    loop = asyncio.get_running_loop()
    queue = RequestQueue(levels=1, max_rows=64)
    deadlines = Deadlines(queue, BatchCost(), max_batch_size=8, label="m")
    gone = []
    for n in range(1000):
        item = pending(loop, 1000.0 - n)  # each sooner than the last: none comes up on its own
        queue.put(item)
        deadlines.add(item, 1000.0 - n)
        queue.take("g", max_rows=8)
        gone.append(weakref.ref(item))
        del item
    gc.collect()
    assert all(ref() is None for ref in gone)
    assert len(deadlines._due) <= 64 + 1
