"""Deterministic batcher tests: pause() holds batch formation, so batch composition is exact."""

from __future__ import annotations

import asyncio
import gc
import time
import weakref
from typing import Literal

import numpy as np
import pytest

import batching.deadlines as deadlines_module
import batching.former as former_module
from batching.assembly import Padding
from batching.batcher import Batcher, BatchTimings
from batching.errors import BatcherClosed, BatchFailed, DeadlinePassed, QueueFull
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


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


def make(recorder: Recorder, **policy: object) -> Batcher:
    settings = {"max_batch_size": 4, "max_queue_delay_s": 5.0, **policy}
    return Batcher(recorder, BatchPolicy(**settings))  # type: ignore[arg-type]


async def test_full_batches_go_at_once(recorder: Recorder) -> None:
    batcher = make(recorder)
    batcher.pause()
    tasks = await submit_all(batcher, [rows(i) for i in range(8)])
    batcher.resume()
    results = await asyncio.gather(*tasks)
    assert recorder.batches == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert [int(r["y"][0, 0]) for r in results] == [2 * i for i in range(8)]
    await batcher.close()


async def test_preferred_size_goes_at_once(recorder: Recorder) -> None:
    batcher = make(recorder, max_batch_size=8, preferred_batch_sizes=(3,))
    batcher.pause()
    tasks = await submit_all(batcher, [rows(i) for i in range(3)])
    batcher.resume()
    await asyncio.gather(*tasks)
    assert recorder.batches == [[0, 1, 2]]
    await batcher.close()


async def test_partial_batch_waits_for_the_delay(recorder: Recorder) -> None:
    batcher = make(recorder, max_batch_size=8, max_queue_delay_s=0.05, dispatch_when_idle=False)
    started = time.monotonic()
    tasks = await submit_all(batcher, [rows(1), rows(2)])
    await asyncio.gather(*tasks)
    assert recorder.batches == [[1, 2]]
    assert time.monotonic() - started >= 0.05
    await batcher.close()


async def test_idle_model_dispatches_at_once_and_busy_model_batches(recorder: Recorder) -> None:
    recorder.gate = asyncio.Event()
    batcher = make(recorder, max_batch_size=8, max_queue_delay_s=30.0)
    first = await submit_all(batcher, [rows(1)])
    await recorder.entered.get()  # sent without waiting 30 s: nothing else was running
    later = await submit_all(batcher, [rows(i) for i in range(2, 10)])
    recorder.gate.set()
    await asyncio.gather(*first, *later)
    assert recorder.batches == [[1], [2, 3, 4, 5, 6, 7, 8, 9]]
    await batcher.close()


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


async def test_callers_handed_over_one_at_a_time_share_batches(recorder: Recorder) -> None:
    """An idle model sent each request alone the moment it came, so callers a front-end hands
    over one at a time (16 of them waiting, as over gRPC) never shared a batch: every call paid
    the whole batch path. Once callers come together, a batch waits for as many as came last."""
    batcher = make(recorder, max_batch_size=16, max_queue_delay_s=0.05)
    await hand_over(batcher, callers=16, calls=2000)
    late = recorder.batches[-50:]
    assert sum(map(len, late)) / len(late) >= 2, [len(b) for b in late]
    await batcher.close()


# The two tests below stretch GROW_WAIT_S to 20 and 50 ms, so that a load on the machine's cores
# (a test suite beside them) does not move them: its stalls last a few ms.


async def test_company_grows_to_every_caller_when_they_come_apart(
    recorder: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A probe for one caller more waited GROW_WAIT_S past the head's arrival, so company could
    only grow to the callers who came within that of the first: over gRPC (calls ~250 µs apart,
    GROW_WAIT_S 1 ms) batches settled near 5 requests of the 16 waiting. It waits past the
    newest caller's arrival instead, and probes again after each that found its caller: with 16
    callers handed over 3 ms apart (6 or 7 within a 20 ms GROW_WAIT_S), batches grow to hold
    nearly all of them."""
    monkeypatch.setattr(former_module, "GROW_WAIT_S", 0.02)
    batcher = make(recorder, max_batch_size=16, max_queue_delay_s=0.2)
    await hand_over(batcher, callers=16, calls=300, pace_s=0.003)
    late = recorder.batches[-8:]
    assert sum(map(len, late)) / len(late) >= 12, [len(b) for b in recorder.batches]
    await batcher.close()


async def test_callers_all_in_the_batch_are_seldom_held_for_one_more(
    recorder: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two callers, each waiting for its answer before its next call: every batch gathers both,
    and a probe for a third waits GROW_WAIT_S for a caller who cannot come. A probe that finds
    nobody doubles the batches to the next (up to GROW_EVERY), so few calls are held."""
    monkeypatch.setattr(former_module, "GROW_WAIT_S", 0.05)
    batcher = make(recorder, max_batch_size=16, max_queue_delay_s=5.0)
    waits = await hand_over(batcher, callers=2, calls=400)
    held = [wait for wait in waits if wait >= 0.04]
    # Probes at batches 1, 3, 7, 15, 31, 63 and 127 of the ~200, each holding both callers;
    # probing every batch would hold nearly all 400.
    assert len(held) <= 20, len(held)
    await batcher.close()


async def test_a_probe_waits_past_the_caller_that_completes_its_company_not_its_window(
    recorder: Recorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A probe (an idle batch waiting for one caller more than the last batch brought) waits
    GROW_WAIT_S past the newest caller once its company has come, else up to its window. When
    callers stopped waking the batcher unless the batch could go, the caller that completed
    the company did not wake it either: the probe slept to the window's end (5 s here; this
    module's test of seldom-held callers took 35 s instead of 0.4)."""
    monkeypatch.setattr(former_module, "GROW_WAIT_S", 0.05)
    batcher = make(recorder, max_batch_size=16, max_queue_delay_s=5.0)
    # The last idle batch had two callers; this batch probes for a third.
    batcher._former._company = 2
    first = await submit_all(batcher, [rows(1)])
    second = await submit_all(batcher, [rows(2)])
    await asyncio.wait_for(asyncio.gather(*first, *second), 2.0)
    assert recorder.batches == [[1, 2]]
    await batcher.close()


async def test_a_lone_caller_is_not_held_for_company(recorder: Recorder) -> None:
    """One caller at a time: never waits for a window, however many calls it makes; after a
    crowd leaves, one batch waits its window before the model sends at once again."""
    batcher = make(recorder, max_batch_size=16, max_queue_delay_s=5.0)
    waits = await hand_over(batcher, callers=1, calls=600)
    assert max(waits) < 1.0  # a window is 5 s; a probe for company waits at most GROW_WAIT_S
    assert {len(batch) for batch in recorder.batches} == {1}
    await batcher.close()

    recorder.batches.clear()
    batcher = make(recorder, max_batch_size=16, max_queue_delay_s=0.05)
    await hand_over(batcher, callers=16, calls=2000)
    waits = await hand_over(batcher, callers=1, calls=20)
    held = [wait for wait in waits if wait >= 0.04]
    assert len(held) <= 1, waits  # the one batch whose window ended alone
    await batcher.close()


async def test_rows_count_and_requests_are_never_split(recorder: Recorder) -> None:
    batcher = make(recorder)
    batcher.pause()
    tasks = await submit_all(batcher, [rows(1, 3), rows(2, 1), rows(3, 2), rows(4, 2)])
    batcher.resume()
    results = await asyncio.gather(*tasks)
    assert recorder.batches == [[1, 1, 1, 2], [3, 3, 4, 4]]
    assert [r["y"].shape[0] for r in results] == [3, 1, 2, 2]
    await batcher.close()


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


async def test_request_past_its_deadline_on_arrival_is_never_queued(recorder: Recorder) -> None:
    batcher = make(recorder)
    with pytest.raises(DeadlinePassed, match="past its timeout"):
        await batcher.submit(rows(7), 1, deadline=time.monotonic() - 1)
    assert batcher.queue.requests == 0
    assert recorder.batches == []
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


async def test_deadline_in_queue_answers_and_never_runs(recorder: Recorder) -> None:
    batcher = make(recorder)
    batcher.pause()
    with pytest.raises(DeadlinePassed, match="it was not run"):
        await batcher.submit(rows(7), 1, deadline=time.monotonic() + 0.01)
    assert batcher.queue.requests == 0
    batcher.resume()
    tasks = await submit_all(batcher, [rows(i) for i in range(4)])
    await asyncio.gather(*tasks)
    assert recorder.batches == [[0, 1, 2, 3]]
    await batcher.close()


@pytest.mark.parametrize("dispatch_when_idle", [True, False])
async def test_a_batch_window_never_outlasts_its_first_requests_deadline(
    recorder: Recorder, monkeypatch: pytest.MonkeyPatch, dispatch_when_idle: bool
) -> None:
    """A fixed window ran its whole delay whatever the head's deadline: a request whose timeout
    was shorter than the window was answered DeadlinePassed unrun by a model with nothing else
    to do (one sent alone over JSON with a 484 µs timeout, when a probe for company held it up
    to 1 ms). The window now ends at the latest start that still meets the head's deadline."""
    monkeypatch.setattr(former_module, "GROW_WAIT_S", 5.0)  # a probe would wait the window
    batcher = make(
        recorder, max_batch_size=8, max_queue_delay_s=5.0, dispatch_when_idle=dispatch_when_idle
    )
    batcher._former._company = 2  # an idle batch waits for company (the callers of the last one)
    # The batch starts a reserve before the deadline, at least MIN_RESERVE_S (2 ms): a loaded
    # machine's timers wake later than that. 0.2 s here, and the deadline a tenth of the window.
    monkeypatch.setattr(deadlines_module, "MIN_RESERVE_S", 0.2)
    deadline = time.monotonic() + 0.5
    answer = await asyncio.wait_for(batcher.submit(rows(3), 1, deadline=deadline), 10)
    assert int(answer["y"][0, 0]) == 6  # run, not DeadlinePassed at its deadline
    assert recorder.batches == [[3]]
    await batcher.close()


async def test_running_request_is_not_cut_off_by_its_deadline(recorder: Recorder) -> None:
    recorder.gate = asyncio.Event()
    batcher = make(recorder, max_batch_size=1)
    task = asyncio.create_task(batcher.submit(rows(5), 1, deadline=time.monotonic() + 0.02))
    await recorder.entered.get()
    await asyncio.sleep(0.03)  # the deadline passes while the batch runs
    recorder.gate.set()
    assert int((await task)["y"][0, 0]) == 10
    await batcher.close()


async def test_cancelled_request_is_removed_before_run(recorder: Recorder) -> None:
    batcher = make(recorder)
    batcher.pause()
    tasks = await submit_all(batcher, [rows(i) for i in range(5)])
    tasks[1].cancel()
    await settle()
    assert batcher.queue.rows == 4
    batcher.resume()
    await asyncio.gather(*(t for i, t in enumerate(tasks) if i != 1))
    assert recorder.batches == [[0, 2, 3, 4]]
    await batcher.close()


async def test_all_cancelled_batch_never_runs(recorder: Recorder) -> None:
    batcher = make(recorder)
    batcher.pause()
    tasks = await submit_all(batcher, [rows(1), rows(2)])
    for task in tasks:
        task.cancel()
    await settle()
    batcher.resume()
    later = await submit_all(batcher, [rows(i) for i in range(10, 14)])
    await asyncio.gather(*later)
    assert recorder.batches == [[10, 11, 12, 13]]
    await batcher.close()


async def test_failure_fails_only_the_bad_request(recorder: Recorder) -> None:
    batcher = make(recorder)
    batcher.pause()
    tasks = await submit_all(batcher, [rows(1), rows(-1), rows(3), rows(4)])
    batcher.resume()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert isinstance(results[1], BatchFailed)
    assert "row with -1" in results[1].message
    assert [int(r["y"][0, 0]) for i, r in enumerate(results) if i != 1] == [2, 6, 8]  # type: ignore[index]
    await batcher.close()


async def test_row_count_mismatch_is_a_clear_error() -> None:
    async def wrong(inputs: Tensors) -> Tensors:
        return {"y": inputs["x"][:1]}

    batcher = Batcher(wrong, BatchPolicy(max_batch_size=4, max_queue_delay_s=0.01))
    with pytest.raises(BatchFailed, match="output 'y' has 1 rows; the batch has 2 rows"):
        await batcher.submit(rows(1, 2), 2)
    await batcher.close()


async def test_shape_groups_batch_apart(recorder: Recorder) -> None:
    batcher = make(recorder, max_queue_delay_s=0.05)
    batcher.pause()
    tasks = await submit_all(batcher, [rows(1), rows(2, width=5), rows(3), rows(4), rows(5)])
    batcher.resume()
    await asyncio.gather(*tasks[:1], *tasks[2:])
    assert recorder.batches[0] == [1, 3, 4, 5]
    await asyncio.wait_for(tasks[1], 10)
    assert recorder.batches[1] == [2]
    await batcher.close()


async def test_unbatched_model_runs_each_request_alone(recorder: Recorder) -> None:
    batcher = make(recorder, max_batch_size=0)
    batcher.pause()
    tasks = await submit_all(batcher, [rows(i) for i in range(3)])
    batcher.resume()
    await asyncio.gather(*tasks)
    assert recorder.batches == [[0], [1], [2]]
    await batcher.close()


@pytest.mark.parametrize("max_batch_size", [0, 4])
async def test_a_finished_batch_holds_no_inputs(recorder: Recorder, max_batch_size: int) -> None:
    """Once a request is answered nothing in the batcher holds its inputs, even while the model
    then sits idle: under --workers they are a slot of a worker's arena (which stayed taken
    until the next batch formed), in one process the request's memory."""
    batcher = make(recorder, max_batch_size=max_batch_size, dispatch_when_idle=True)
    inputs = rows(7)
    held = weakref.ref(inputs["x"])
    assert (await batcher.submit(inputs, 1))["y"][0, 0] == 14
    del inputs
    await settle()  # the finished batch's task completes
    assert held() is None
    await batcher.close()


@pytest.mark.parametrize("company", [1, 3])
async def test_a_failed_batch_holds_no_inputs(recorder: Recorder, company: int) -> None:
    """A request whose batch failed holds its inputs no longer than its error lives, without the
    cyclic collector (which the server runs seldom): the error's tracebacks held the batch's
    frames, whose locals held the request, whose future held the error. Under --workers the
    inputs are a slot of a worker's arena, and a few failures filled it (503 from then on)."""
    batcher = make(recorder, max_batch_size=4, max_queue_delay_s=0.0)
    batches = [rows(-1)] + [rows(i) for i in range(1, company)]  # alone, or failing a batch
    held = [weakref.ref(item["x"]) for item in batches]
    gc.disable()
    try:
        results = await asyncio.gather(
            *(batcher.submit(item, 1) for item in batches), return_exceptions=True
        )
        assert isinstance(results[0], BatchFailed)
        assert all(isinstance(result, dict) for result in results[1:])
        del batches, results
        await settle()
        assert [i for i, ref in enumerate(held) if ref() is not None] == []
    finally:
        gc.enable()
    await batcher.close()


async def test_a_caller_who_left_past_its_deadline_holds_no_inputs(recorder: Recorder) -> None:
    """A caller cancelled while it waited for its running batch past its deadline leaves nothing
    holding its inputs once its batch is over, without the cyclic collector: the wait was
    inside the deadline's `except TimeoutError`, so the CancelledError carried the TimeoutError
    as its context, whose traceback held asyncio.timeout's frame, whose Timeout held the task,
    which held the CancelledError. Under --workers the inputs are a slot of a worker's arena,
    and ten such calls of 2.4 MB filled it (503 from then on)."""
    recorder.gate = asyncio.Event()
    batcher = make(recorder, max_batch_size=1)
    inputs = rows(5)
    held = weakref.ref(inputs["x"])
    gc.disable()
    try:
        task = asyncio.create_task(batcher.submit(inputs, 1, deadline=time.monotonic() + 0.02))
        del inputs
        await recorder.entered.get()
        await asyncio.sleep(0.03)  # the deadline passes while the batch runs
        task.cancel()  # the caller leaves while it waits for the batch
        await asyncio.wait([task])  # done, its error not asked for (as a server's own task)
        assert task.cancelled()
        del task
        recorder.gate.set()
        await settle()  # the batch ends and lets go of its inputs
        assert held() is None
    finally:
        gc.enable()
    await batcher.close()


async def test_a_caller_who_left_during_a_failed_batch_is_not_run_again_alone(
    recorder: Recorder,
) -> None:
    """A failed batch's requests are run again one by one to find the one that broke it: not
    those whose callers left meanwhile (their work would be done for nobody)."""
    recorder.gate = asyncio.Event()
    batcher = make(recorder, max_batch_size=4, max_queue_delay_s=0.05)
    tasks = await submit_all(batcher, [rows(-1), rows(2), rows(3)])
    await recorder.entered.get()  # the three are in one batch, inside run_batch
    tasks[1].cancel()
    await settle()
    recorder.gate.set()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert isinstance(results[0], BatchFailed)
    assert isinstance(results[1], asyncio.CancelledError)
    assert results[2]["y"][0, 0] == 6  # type: ignore[index]
    assert recorder.batches == [[-1, 2, 3], [-1], [3]]
    await batcher.close()


async def test_on_leave_is_called_once_when_the_batcher_is_done_with_a_request(
    recorder: Recorder,
) -> None:
    """Answered, refused, withdrawn while queued: at once. Left while running: when its batch
    is over, not when its caller leaves (what it holds, a concurrency slot, is still used)."""
    left: list[str] = []
    recorder.gate = asyncio.Event()
    batcher = make(recorder, max_batch_size=1, max_queue_size=2, max_queue_delay_s=0.0)

    def submit(name: str, tag: int) -> asyncio.Task[Tensors]:
        return asyncio.create_task(batcher.submit(rows(tag), 1, on_leave=lambda: left.append(name)))

    running = submit("running", 1)
    await recorder.entered.get()
    queued, answered = submit("queued", 2), submit("answered", 3)
    await settle()
    with pytest.raises(QueueFull):
        await batcher.submit(rows(4), 1, on_leave=lambda: left.append("refused"))
    queued.cancel()
    running.cancel()
    await settle()
    assert left == ["refused", "queued"]  # the running one's batch is not over
    recorder.gate.set()
    assert (await answered)["y"][0, 0] == 6
    await settle()
    assert sorted(left) == ["answered", "queued", "refused", "running"]
    await batcher.close()


async def test_instances_run_batches_concurrently(recorder: Recorder) -> None:
    recorder.gate = asyncio.Event()
    batcher = make(recorder, max_batch_size=1, instances=2)
    tasks = await submit_all(batcher, [rows(i) for i in range(4)])
    await recorder.entered.get()
    await recorder.entered.get()  # two batches inside run_batch at once
    recorder.gate.set()
    await asyncio.gather(*tasks)
    assert recorder.peak == 2
    await batcher.close()


async def test_padding_merges_lengths_and_slices_outputs_back(recorder: Recorder) -> None:
    async def identity(inputs: Tensors) -> Tensors:
        recorder.batches.append(list(inputs["x"].shape))
        return {"y": inputs["x"] * 2}

    policy = BatchPolicy(max_batch_size=4, max_queue_delay_s=0.05,
                         padding={"x": Padding(axis=1, value=0, outputs={"y": (1,)})},
                         pad_bucket_ratio=1.5)  # fmt: skip
    batcher = Batcher(identity, policy)
    batcher.pause()
    items = [rows(1, width=4), rows(2, width=5), rows(3, width=9), rows(4, width=5)]
    tasks = await submit_all(batcher, items)
    batcher.resume()
    await asyncio.wait([tasks[0], tasks[1], tasks[3]])
    assert recorder.batches[0] == [3, 5]  # lengths 4 and 5 share a bucket, padded to 5
    results = [t.result() for t in (tasks[0], tasks[1], tasks[3])]
    assert [r["y"].shape for r in results] == [(1, 4), (1, 5), (1, 5)]
    assert (results[0]["y"] == 2).all()
    assert (await asyncio.wait_for(tasks[2], 10))["y"].shape == (1, 9)
    await batcher.close()


async def test_random_payloads_come_back_to_their_callers() -> None:
    async def double(inputs: Tensors) -> Tensors:
        await asyncio.sleep(0)
        return {"y": inputs["x"] * 2}

    batcher = Batcher(double, BatchPolicy(max_batch_size=16, max_queue_delay_s=0.001, instances=3))
    rng = np.random.default_rng(1)
    payloads = [rng.standard_normal((int(rng.integers(1, 4)), 3)) for _ in range(300)]
    results = await asyncio.gather(*(batcher.submit({"x": p}, p.shape[0]) for p in payloads))
    for payload, result in zip(payloads, results, strict=True):
        np.testing.assert_array_equal(result["y"], payload * 2)
    await batcher.close()


async def test_drain_answers_everything_queued(recorder: Recorder) -> None:
    batcher = make(recorder, max_batch_size=4, max_queue_delay_s=30.0)
    tasks = await submit_all(batcher, [rows(i) for i in range(3)])
    await batcher.drain()  # does not wait 30 s for the window
    assert [int(t.result()["y"][0, 0]) for t in tasks] == [0, 2, 4]
    # A request the engine accepted before the drain began is still served, without a window.
    late = await asyncio.wait_for(batcher.submit(rows(5), 1), 5)
    assert int(late["y"][0, 0]) == 10
    await batcher.close()
    with pytest.raises(BatcherClosed):
        await batcher.submit(rows(1), 1)


async def test_close_answers_queued_requests_shutting_down(recorder: Recorder) -> None:
    batcher = make(recorder)
    batcher.pause()
    tasks = await submit_all(batcher, [rows(1), rows(2)])
    await batcher.close()
    for task in tasks:
        with pytest.raises(BatcherClosed):
            await task
    assert recorder.batches == []


class Timings:
    """A BatchObserver that keeps each batch's stage timings."""

    def __init__(self) -> None:
        self.batches: list[tuple[int, int, BatchTimings, bool]] = []

    def batch_done(self, rows: int, requests: int, timings: BatchTimings, ok: bool) -> None:
        self.batches.append((rows, requests, timings, ok))

    def request_dequeued(self, queue_s: float) -> None:
        pass


async def test_observer_gets_each_stage_of_a_padded_batch_timed_apart() -> None:
    async def slow(inputs: Tensors) -> Tensors:
        await asyncio.sleep(0.03)  # the model's run: it must land in infer_s, not in the others
        return {"y": inputs["x"]}

    observer = Timings()
    policy = BatchPolicy(max_batch_size=4, max_queue_delay_s=5.0,
                         padding={"x": Padding(axis=1, value=0, outputs={"y": (1,)})})  # fmt: skip
    batcher = Batcher(slow, policy, observer)
    batcher.pause()
    tasks = await submit_all(batcher, [rows(1, width=4), rows(2, width=5)])
    batcher.resume()
    await asyncio.wait_for(asyncio.gather(*tasks), 10)
    ((batch_rows, requests, timings, ok),) = observer.batches
    assert (batch_rows, requests, ok) == (2, 2, True)
    assert timings.infer_s >= 0.03
    assert 0 < timings.input_s < 0.03
    assert 0 < timings.output_s < 0.03
    await batcher.close()


class CountingEvent(asyncio.Event):
    """asyncio.Event counting its waits: the batcher's owner waits on its wakeup event once per
    time it is woken."""

    def __init__(self) -> None:
        super().__init__()
        self.waits = 0

    async def wait(self) -> Literal[True]:
        self.waits += 1
        return await super().wait()


@pytest.mark.parametrize("dispatch_when_idle", [True, False])
async def test_a_request_that_does_not_end_the_window_does_not_wake_the_owner(
    recorder: Recorder, dispatch_when_idle: bool
) -> None:
    """Every queued request woke the batcher's owner, which found the batch still short and
    waited again: a task step and a timer per request, ~10 µs of each gRPC call (grpc.aio hands
    calls over one loop turn apart, so no two shared a wake-up). It is woken when the batch can
    go (or its window ends), so it waits a few times a batch, not once a request."""
    batcher = make(
        recorder, max_batch_size=16, max_queue_delay_s=0.05, dispatch_when_idle=dispatch_when_idle
    )
    wakeup = batcher._former._wakeup = CountingEvent()
    await hand_over(batcher, callers=16, calls=1600)
    requests_per_batch = 1600 / len(recorder.batches)
    assert requests_per_batch >= 4, [len(b) for b in recorder.batches]
    assert wakeup.waits / len(recorder.batches) <= 3, (wakeup.waits, len(recorder.batches))
    await batcher.close()


@pytest.mark.parametrize("dispatch_when_idle", [True, False])
@pytest.mark.parametrize("width", [2, 5], ids=["same group", "other group"])
async def test_a_later_request_due_before_the_window_ends_is_run_in_time(
    recorder: Recorder, monkeypatch: pytest.MonkeyPatch, dispatch_when_idle: bool, width: int
) -> None:
    """Only the first request's deadline bounded a window: one queued behind it with a shorter
    timeout waited out the whole delay and was answered DeadlinePassed unrun, by a model with
    nothing else to do. A window now ends at the latest start that meets every queued deadline."""
    monkeypatch.setattr(former_module, "GROW_WAIT_S", 5.0)  # a probe would wait the window
    batcher = make(
        recorder, max_batch_size=8, max_queue_delay_s=5.0, dispatch_when_idle=dispatch_when_idle
    )
    batcher._former._company = 3  # an idle batch waits for company (the callers of the last one)
    first = await submit_all(batcher, [rows(1)])
    # The batch starts a reserve before the deadline, at least MIN_RESERVE_S (2 ms): a loaded
    # machine's timers wake later than that. 0.2 s here, and the deadline a tenth of the window.
    monkeypatch.setattr(deadlines_module, "MIN_RESERVE_S", 0.2)
    deadline = time.monotonic() + 0.5
    urgent = await asyncio.wait_for(batcher.submit(rows(2, width=width), 1, deadline=deadline), 2)
    assert int(urgent["y"][0, 0]) == 4  # run, not DeadlinePassed at its deadline
    await asyncio.wait_for(first[0], 10)
    assert sorted(map(sorted, recorder.batches)) == ([[1, 2]] if width == 2 else [[1], [2]])
    await batcher.close()


@pytest.mark.parametrize("dispatch_when_idle", [True, False])
async def test_a_higher_level_in_another_group_does_not_wait_out_a_lower_levels_window(
    recorder: Recorder, dispatch_when_idle: bool
) -> None:
    """The owner waited out the window of the head it had picked, so a level-1 request of
    another shape arriving meanwhile waited behind a level-2 batch for the whole delay. A request
    that outranks the head in another group now ends the head's window: its own batch goes
    first (here at once, at its preferred size), the lower level's window goes on."""
    batcher = make(
        recorder,
        max_batch_size=8,
        preferred_batch_sizes=(4,),
        max_queue_delay_s=5.0,
        priority_levels=2,
        dispatch_when_idle=dispatch_when_idle,
    )
    batcher._former._company = 3
    low = await submit_all(batcher, [rows(1), rows(3)], priority=2)
    await asyncio.wait_for(batcher.submit(rows(2, count=4, width=5), 4, priority=1), 2)
    assert recorder.batches == [[2, 2, 2, 2]]
    await batcher.close()
    answers = await asyncio.gather(*low, return_exceptions=True)
    assert all(isinstance(answer, BatcherClosed) for answer in answers)


async def test_a_window_whose_first_request_leaves_ends_for_the_rest(recorder: Recorder) -> None:
    """A head withdrawn by its caller did not wake the owner, so the requests behind it waited
    out its window: the rest of the batch now goes when the head leaves."""
    batcher = make(recorder, max_batch_size=8, max_queue_delay_s=5.0, dispatch_when_idle=False)
    tasks = await submit_all(batcher, [rows(1), rows(2), rows(3)])
    tasks[0].cancel()
    await asyncio.wait_for(asyncio.gather(*tasks[1:]), 2)
    assert recorder.batches == [[2, 3]]
    await batcher.close()
