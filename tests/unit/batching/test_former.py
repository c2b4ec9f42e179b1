"""Forming batches (batching/former.py) through a Batcher over a fake run_batch: when a batch goes
(full, at a preferred size, at its window's end, at once on an idle model), the company an idle
batch waits for and the probes that grow it, windows cut short by deadlines, by a request of a
higher level or by the head leaving, and which queued requests wake the owner."""

from __future__ import annotations

import asyncio
import time
from typing import Literal

import pytest

import batching.deadlines as deadlines_module
import batching.former as former_module
from batching.errors import BatcherClosed
from tests.unit.batching.recorder import Recorder, hand_over, make, rows, submit_all


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
