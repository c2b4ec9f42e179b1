from __future__ import annotations

import asyncio
from collections.abc import Callable

import numpy as np
import pytest

from engine.cache.coalesce import Coalescer
from engine.cache.contract import CachedResult, copy_result
from engine.errors import BackendError


class Computation:
    """A compute function that blocks until released and records what happened to it."""

    def __init__(self, value: int = 42) -> None:
        self.value = value
        self.calls = 0
        self.cancelled = 0
        self.release = asyncio.Event()
        self.error: Exception | None = None

    async def __call__(self) -> CachedResult:
        self.calls += 1
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        if self.error is not None:
            raise self.error
        return CachedResult({"y": np.full(3, self.value, dtype=np.int32)}, {"y": "INT32"})


async def until(condition: Callable[[], bool]) -> None:
    """Let the other tasks run until `condition` holds (bounded; not a timing assumption)."""
    for _ in range(10_000):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition not reached")


def spawn(coalescer: Coalescer[CachedResult], key: bytes, compute: Computation) -> asyncio.Task:
    return asyncio.get_running_loop().create_task(coalescer.run(key, compute))


async def test_concurrent_identical_runs_compute_once_and_each_caller_owns_its_arrays() -> None:
    coalescer: Coalescer[CachedResult] = Coalescer(clone=copy_result)
    compute = Computation()
    tasks = [spawn(coalescer, b"k", compute) for _ in range(50)]
    await until(lambda: coalescer.waiters(b"k") == 50)
    compute.release.set()
    results = await asyncio.gather(*tasks)
    assert compute.calls == 1
    assert coalescer.coalesced == 49
    assert all(r.outputs["y"].tolist() == [42, 42, 42] for r in results)
    assert len({id(r.outputs["y"]) for r in results}) == 50  # nobody shares an array
    results[0].outputs["y"][:] = 0
    assert results[1].outputs["y"].tolist() == [42, 42, 42]
    assert len(coalescer) == 0


async def test_different_keys_compute_separately() -> None:
    coalescer: Coalescer[CachedResult] = Coalescer()
    first, second = Computation(1), Computation(2)
    tasks = [spawn(coalescer, b"a", first), spawn(coalescer, b"b", second)]
    await until(lambda: len(coalescer) == 2)
    first.release.set()
    second.release.set()
    got = await asyncio.gather(*tasks)
    assert [r.outputs["y"][0] for r in got] == [1, 2]
    assert (first.calls, second.calls) == (1, 1)


async def test_a_cancelled_waiter_does_not_cancel_the_computation() -> None:
    coalescer: Coalescer[CachedResult] = Coalescer()
    compute = Computation()
    tasks = [spawn(coalescer, b"k", compute) for _ in range(3)]
    await until(lambda: coalescer.waiters(b"k") == 3)
    tasks[0].cancel()
    with pytest.raises(asyncio.CancelledError):
        await tasks[0]
    assert coalescer.waiters(b"k") == 2
    compute.release.set()
    rest = await asyncio.gather(*tasks[1:])
    assert [r.outputs["y"].tolist() for r in rest] == [[42, 42, 42]] * 2
    assert (compute.calls, compute.cancelled) == (1, 0)


async def test_a_waiter_timing_out_does_not_cancel_the_others() -> None:
    coalescer: Coalescer[CachedResult] = Coalescer()
    compute = Computation()
    patient = spawn(coalescer, b"k", compute)
    await until(lambda: coalescer.waiters(b"k") == 1)
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.01):
            await coalescer.run(b"k", compute)
    compute.release.set()
    assert (await patient).outputs["y"].tolist() == [42, 42, 42]
    assert (compute.calls, compute.cancelled) == (1, 0)


async def test_the_last_waiter_leaving_cancels_the_computation_and_forgets_it() -> None:
    coalescer: Coalescer[CachedResult] = Coalescer()
    compute = Computation()
    tasks = [spawn(coalescer, b"k", compute) for _ in range(2)]
    await until(lambda: coalescer.waiters(b"k") == 2)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert len(coalescer) == 0
    await until(lambda: compute.cancelled == 1)
    fresh = Computation(7)
    fresh.release.set()
    assert (await coalescer.run(b"k", fresh)).outputs["y"].tolist() == [7, 7, 7]
    assert fresh.calls == 1


async def test_an_exception_reaches_every_waiter_and_the_next_run_recomputes() -> None:
    coalescer: Coalescer[CachedResult] = Coalescer()
    compute = Computation()
    compute.error = BackendError("model crashed")
    tasks = [spawn(coalescer, b"k", compute) for _ in range(4)]
    await until(lambda: coalescer.waiters(b"k") == 4)
    compute.release.set()
    outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    assert [str(o) for o in outcomes] == ["model crashed"] * 4
    assert all(isinstance(o, BackendError) for o in outcomes)
    assert len(coalescer) == 0
    compute.error = None
    assert (await coalescer.run(b"k", compute)).outputs["y"].tolist() == [42, 42, 42]
    assert compute.calls == 2


async def test_a_computation_cancelled_from_inside_is_a_backend_error_for_waiters() -> None:
    coalescer: Coalescer[CachedResult] = Coalescer()

    async def cancelled_inside() -> CachedResult:
        raise asyncio.CancelledError

    with pytest.raises(BackendError, match="shared computation was cancelled"):
        await coalescer.run(b"k", cancelled_inside)
    assert len(coalescer) == 0


async def test_finished_entries_are_removed_so_later_runs_compute_again() -> None:
    coalescer: Coalescer[CachedResult] = Coalescer()
    compute = Computation()
    compute.release.set()
    await coalescer.run(b"k", compute)
    await coalescer.run(b"k", compute)
    assert (compute.calls, len(coalescer), coalescer.coalesced) == (2, 0, 0)
