"""A fake run_batch that records each batch's rows (`Recorder`), and what the batcher's tests drive
a Batcher with: tagged rows, requests submitted together, a front-end handing calls over one at a
time. The `recorder` fixture is conftest.py's."""

from __future__ import annotations

import asyncio
import time

import numpy as np

from batching.batcher import Batcher
from batching.policy import BatchPolicy

Tensors = dict[str, np.ndarray]


class Recorder:
    """A fake run_batch: doubles `x`, records each batch's row tags; fails on a -1 row."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.running = 0
        self.peak = 0
        self.gate: asyncio.Event | None = None
        self.entered: asyncio.Queue[None] = asyncio.Queue()

    async def __call__(self, inputs: Tensors) -> Tensors:
        self.running += 1
        self.peak = max(self.peak, self.running)
        self.entered.put_nowait(None)
        try:
            if self.gate is not None:
                await self.gate.wait()
            x = inputs["x"]
            self.batches.append([int(v) for v in x[:, 0]])
            if (x == -1).any():
                raise ValueError("row with -1")
            return {"y": x * 2}
        finally:
            self.running -= 1


def rows(tag: int, count: int = 1, width: int = 2) -> Tensors:
    return {"x": np.full((count, width), tag, dtype=np.int64)}


async def settle() -> None:
    """Let every ready task run up to its next real wait."""
    for _ in range(5):
        await asyncio.sleep(0)


async def submit_all(
    batcher: Batcher, items: list[Tensors], **kwargs: object
) -> list[asyncio.Task[Tensors]]:
    tasks = [
        asyncio.create_task(batcher.submit(item, item["x"].shape[0], **kwargs))  # type: ignore[arg-type]
        for item in items
    ]
    await settle()
    return tasks


def make(recorder: Recorder, **policy: object) -> Batcher:
    settings = {"max_batch_size": 4, "max_queue_delay_s": 5.0, **policy}
    return Batcher(recorder, BatchPolicy(**settings))  # type: ignore[arg-type]


async def hand_over(batcher: Batcher, callers: int, calls: int, pace_s: float = 0.0) -> list[float]:
    """A front-end that hands requests over one at a time, a few loop turns apart, as grpc.aio
    accepts one call per wake of its poller, and `pace_s` of the loop's time apart (what reading
    each call costs it); each caller's next request only after its answer. Returns each call's
    wait for its answer, in seconds."""
    free: asyncio.Queue[int] = asyncio.Queue()
    for caller in range(callers):
        free.put_nowait(caller)
    waits: list[float] = []

    async def call(tag: int) -> None:
        started = time.monotonic()
        await batcher.submit(rows(tag), 1)
        waits.append(time.monotonic() - started)
        free.put_nowait(tag)

    async with asyncio.TaskGroup() as group:
        for _ in range(calls):
            tag = await free.get()
            await settle()  # the model runs what it was sent before the next call is read
            time.sleep(pace_s)  # noqa: ASYNC251 - the loop busy reading the call: the pace
            group.create_task(call(tag))
    return waits
