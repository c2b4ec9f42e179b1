"""The dynamic batcher: one owner task per model version turns queued requests into batches.

A batch is sent when it holds `max_batch_size` rows, when it reaches a preferred size, or when
`max_queue_delay_s` has passed since its first request was queued — or at once when no batch of
the model is running (`dispatch_when_idle`): waiting then only adds latency, and requests that
arrive while it runs form the next batch by themselves. A window ends sooner when a queued
request's deadline needs it, at the latest start that still meets it; a request of a higher level
whose shape differs from the batch's ends it at once, unsent, and its own batch goes first. Up to
`instances` batches run at once. A request is never split across batches; requests whose shapes
differ are batched apart.

`max_queue_delay_s` "auto" plans the window from a deadline instead: the batcher fits what a
batch of n rows costs from its own recent batches (`batching.cost`) and waits for more rows only
while the soonest deadline queued (a request's own timeout, else `latency_target_s` after it was
queued) can still be met after the predicted compute. A request that can no longer meet its
deadline when its batch forms is answered DeadlinePassed without being run (it is "shed"), and
the batch is topped up from the queue with what the deadlines of those left still allow
(`batching.deadlines`).

Requests are answered with batching.errors (QueueFull, BatcherClosed, DeadlinePassed,
BatchFailed); the engine translates them (engine.errors.from_batching).

This module queues requests, runs the batches and answers their callers; forming each batch
from the queue (its window, the company an idle batch waits for) is `batching.former`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from batching.assembly import SplitError, Tensors, concat, group_key, split
from batching.cost import BatchCost
from batching.deadlines import Deadlines
from batching.errors import BatcherClosed, BatchFailed, DeadlinePassed
from batching.former import BatchFormer
from batching.policy import BatchPolicy
from batching.queue import RUNNING, Pending, RequestQueue, leave, settle

RunBatch = Callable[[Tensors], Awaitable[Tensors]]


@dataclass(frozen=True, slots=True)
class BatchTimings:
    """Seconds one batch spent in each stage, as Triton's statistics split them: assembling its
    inputs (concatenating and padding the requests' arrays), running the model, and cutting the
    outputs back per request."""

    input_s: float
    infer_s: float
    output_s: float


class BatchObserver(Protocol):
    """Receives the timings the statistics need."""

    def batch_done(self, rows: int, requests: int, timings: BatchTimings, ok: bool) -> None: ...

    def request_dequeued(self, queue_s: float) -> None: ...


class _NoObserver:
    def batch_done(self, rows: int, requests: int, timings: BatchTimings, ok: bool) -> None:
        pass

    def request_dequeued(self, queue_s: float) -> None:
        pass


class Batcher:
    """Owns one RequestQueue; `submit` is the only way in."""

    def __init__(
        self,
        run_batch: RunBatch,
        policy: BatchPolicy,
        observer: BatchObserver | None = None,
        tenant_share: Callable[[str], float] | None = None,
        label: str = "model",
    ) -> None:
        self.policy = policy
        self.label = label
        self._run_batch = run_batch
        self._observer = observer or _NoObserver()
        self.queue = RequestQueue(policy.priority_levels, policy.max_queue_size, tenant_share)
        self._slots = asyncio.Semaphore(policy.instances)
        self._running: set[asyncio.Task[None]] = set()
        self._closing = False  # close(): new requests are refused
        self.cost = BatchCost()
        """What a batch costs here, fitted from the batches this batcher ran."""
        self.deadlines = Deadlines(self.queue, self.cost, policy.max_batch_size, label)
        self._former = BatchFormer(self.queue, policy, self.cost, self.deadlines, self._running)
        # Kept: Python 3.11 makes a getpid() system call each time the running loop is asked for.
        self._loop = asyncio.get_running_loop()
        self._owner = self._loop.create_task(self._own(), name=f"batcher:{label}")

    @property
    def shed(self) -> int:
        """Requests answered DeadlinePassed unrun because their batch could not meet it."""
        return self.deadlines.shed

    async def submit(
        self,
        inputs: Tensors,
        rows: int,
        priority: int = 1,
        tenant: str = "",
        deadline: float | None = None,
        arrived: float | None = None,
        on_run: Callable[[], None] | None = None,
        on_leave: Callable[[], None] | None = None,
    ) -> Tensors:
        """Queue one request and wait for its outputs. `priority` is a level from 1 (highest) to
        `policy.priority_levels`; `deadline` and `arrived` (when the server took the request,
        where a latency target counts from; default now) are on time.monotonic(). `on_run` is
        called when its batch starts; `on_leave` once the batcher is done with it: refused,
        answered, withdrawn unrun, or its batch over, which for a caller who left while it ran
        is after this returns (what the caller holds for the request, such as a concurrency
        slot, is held until then)."""
        now = time.monotonic()
        start = now if arrived is None else arrived
        limit = "timeout"
        if deadline is None and self.policy.auto and self.policy.latency_target_s is not None:
            deadline, limit = start + self.policy.latency_target_s, "latency target"
        try:
            if self._closing:
                raise BatcherClosed()
            if deadline is not None and deadline <= now:
                raise DeadlinePassed(
                    f"request reached {self.label} past its {limit}; it was not run"
                )
            group = group_key(inputs, self.policy.padding, self.policy.pad_bucket_ratio)
            item = Pending(
                inputs,
                rows,
                priority,
                tenant,
                group,
                now,
                self._loop.create_future(),
                deadline,
                on_run=on_run,
                on_leave=on_leave,
            )
            self.queue.put(item)
        except BaseException:
            if on_leave is not None:
                on_leave()
            raise
        if deadline is not None:
            self.deadlines.add(item, deadline)
        self._former.queued(item)
        try:
            if deadline is None:
                return await item.future
            return await self._within(item, deadline, start, limit)
        except asyncio.CancelledError:
            # The client left: a queued request is withdrawn and never computed (a running one
            # leaves the batcher with its batch).
            self._former.withdraw(item)
            item.future.cancel()
            if item.state != RUNNING:
                leave(item)
            raise
        finally:
            # An error raised from the future keeps this frame in its traceback: not the item,
            # whose future holds the error (a cycle only the collector would break).
            del item

    async def _within(self, item: Pending, deadline: float, start: float, limit: str) -> Tensors:
        """The answer of a queued request with a deadline: past it while the request still
        waits, DeadlinePassed, and it is withdrawn unrun (one already running is waited for).
        `start` is where its `limit` (its timeout, or the latency target) counts from."""
        try:
            try:
                async with asyncio.timeout(deadline - time.monotonic()):
                    return await asyncio.shield(item.future)
            except TimeoutError:
                pass
            # Past the deadline, and out of the handler: a CancelledError raised in it would carry
            # the TimeoutError as its context, whose traceback holds the Timeout, which holds this
            # task, which keeps its CancelledError until someone asks for it (a server's request
            # task, nobody): a cycle only the collector frees, and the inputs with it.
            if item.state == RUNNING:
                return await asyncio.shield(item.future)
            self._former.withdraw(item)
            leave(item)
            waited = time.monotonic() - item.enqueued
            raise DeadlinePassed(
                f"request waited {waited:.3f} s in the queue of {self.label}, "
                f"past its {limit} of {deadline - start:.3f} s; it was not run"
            )
        finally:
            del item  # as in submit: not in the traceback of the future's error

    def pause(self) -> None:
        """Test hook: stop forming batches (queued requests wait) until resume()."""
        self._former.pause()

    def resume(self) -> None:
        self._former.resume()

    async def drain(self) -> None:
        """Send everything queued at once, without waiting for batch windows, and wait for it.
        Requests still arriving (already accepted upstream) are served the same way."""
        self._former.flush()
        while self.queue.requests or self._running:
            if self._running:
                await asyncio.wait(set(self._running))
            else:
                await asyncio.sleep(0.001)  # the owner is forming the next batch

    async def close(self) -> None:
        """Stop at once: queued and running requests are answered BatcherClosed."""
        self._closing = True
        self._owner.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._owner
        for task in list(self._running):
            task.cancel()
        await asyncio.gather(*self._running, return_exceptions=True)
        for item in self.queue.withdraw_all():
            settle(item, exc=BatcherClosed("server shut down before this request ran"))

    async def _own(self) -> None:
        while True:
            await self._slots.acquire()
            try:
                batch = await self._former.next_batch()
            except BaseException:
                self._slots.release()
                raise
            task = self._loop.create_task(self._execute(batch))
            del batch  # else this loop holds the batch's inputs until the next batch forms
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def _execute(self, batch: list[Pending]) -> None:
        try:
            now = time.monotonic()
            for item in batch:
                self._observer.request_dequeued(now - item.enqueued)
                started, item.on_run = item.on_run, None
                if started is not None:
                    started()
            await self._run(batch)
        finally:
            self._slots.release()
            self._running.discard(asyncio.current_task(self._loop))
            self._former.wake()  # a model that went idle may send its next batch at once
            for item in batch:  # cancelled by close() mid-run: every caller still gets an answer
                if not item.future.done():
                    settle(item, exc=BatcherClosed("server shut down while this request ran"))
                leave(item)  # one whose caller left while it ran, or skipped by the reruns

    async def _run(self, batch: list[Pending]) -> None:
        rows = sum(item.rows for item in batch)
        started = assembled = ran = time.monotonic()
        try:
            if self.policy.batched:
                inputs, layout = concat([item.inputs for item in batch], self.policy.padding)
            else:
                inputs, layout = batch[0].inputs, None
            assembled = time.monotonic()
            outputs = await self._run_batch(inputs)
            ran = time.monotonic()
            parts = [outputs] if layout is None else split(outputs, layout)
        except Exception as exc:
            failed = BatchTimings(assembled - started, ran - assembled, 0.0)
            self._observer.batch_done(rows, len(batch), failed, ok=False)
            if len(batch) == 1:
                settle(batch[0], exc=self._backend_error(exc))
                return
            parts = None
        if parts is None:
            # Find the request that broke the batch: each one alone, so the others still pass.
            # Outside the handler, so their errors do not chain to this one, whose traceback
            # holds this frame and so the whole batch.
            for item in batch:
                if not item.future.done():  # not one whose caller left (or was answered) since
                    await self._run([item])
            return
        finished = time.monotonic()
        timings = BatchTimings(assembled - started, ran - assembled, finished - ran)
        self.cost.observe(rows, finished - started)
        self.deadlines.last_ran = finished
        self._observer.batch_done(rows, len(batch), timings, ok=True)
        for item, outputs in zip(batch, parts, strict=True):
            settle(item, result=outputs)

    def _backend_error(self, exc: Exception) -> BatchFailed:
        if isinstance(exc, SplitError):
            message = f"{self.label} returned outputs that do not match its batch: {exc}"
        else:
            message = f"{self.label} failed: {type(exc).__name__}: {exc}"
        # Its traceback, less _run's frame (where it was caught): that frame holds the batch, so
        # this request's future, so this error; a cycle that only the collector breaks (and the
        # server runs it seldom), keeping the inputs (under --workers, an arena slot) meanwhile.
        below = exc.__traceback__.tb_next if exc.__traceback__ is not None else None
        return BatchFailed(message, exc.with_traceback(below))
