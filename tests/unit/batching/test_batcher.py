"""Deterministic batcher tests: pause() holds batch formation, so batch composition is exact."""

from __future__ import annotations

import asyncio
import gc
import time
import weakref

import numpy as np
import pytest

from batching.assembly import Padding
from batching.batcher import Batcher, BatchTimings
from batching.errors import BatcherClosed, BatchFailed, DeadlinePassed, QueueFull
from batching.policy import BatchPolicy
from tests.unit.batching.recorder import Recorder, Tensors, make, rows, settle, submit_all


async def test_rows_count_and_requests_are_never_split(recorder: Recorder) -> None:
    batcher = make(recorder)
    batcher.pause()
    tasks = await submit_all(batcher, [rows(1, 3), rows(2, 1), rows(3, 2), rows(4, 2)])
    batcher.resume()
    results = await asyncio.gather(*tasks)
    assert recorder.batches == [[1, 1, 1, 2], [3, 3, 4, 4]]
    assert [r["y"].shape[0] for r in results] == [3, 1, 2, 2]
    await batcher.close()


async def test_request_past_its_deadline_on_arrival_is_never_queued(recorder: Recorder) -> None:
    batcher = make(recorder)
    with pytest.raises(DeadlinePassed, match="past its timeout"):
        await batcher.submit(rows(7), 1, deadline=time.monotonic() - 1)
    assert batcher.queue.requests == 0
    assert recorder.batches == []
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
