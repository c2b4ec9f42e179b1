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
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal, Protocol

from batching.assembly import Padding, SplitError, Tensors, concat, group_key, split
from batching.cost import BatchCost
from batching.deadlines import Deadlines, reserve
from batching.errors import BatcherClosed, BatchFailed, DeadlinePassed
from batching.queue import QUEUED, RUNNING, Pending, RequestQueue, leave, settle

RunBatch = Callable[[Tensors], Awaitable[Tensors]]

AUTO = "auto"
"""`max_queue_delay_s` that plans each batch window from deadlines and the fitted batch cost."""

GROW_EVERY = 256
"""At most this many batches an idle model sends apart, one waits for one caller more than the
last brought: how it notices that callers come together (see `_gather`). After such a probe
that found its caller the next batch probes again; after one that did not, twice as many
batches later, up to this."""
GROW_WAIT_S = 0.001
"""How long past the newest caller's arrival a probe waits for one more, at most."""
AUTO_GATHER_S = 0.002
"""With delay "auto", how long past its head's arrival an idle batch waits for company at most:
its window runs to the soonest queued deadline, and callers who come together are a few loop turns
apart (without this, a lone caller after a crowd waited most of its latency target)."""


@dataclass(frozen=True, slots=True)
class BatchPolicy:
    """How one model version's requests are batched. `max_batch_size` 0 runs each request alone."""

    max_batch_size: int
    max_queue_delay_s: float | Literal["auto"] = 0.002
    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue_size: int = 4096
    priority_levels: int = 1
    instances: int = 1
    padding: Mapping[str, Padding] = field(default_factory=dict)
    pad_bucket_ratio: float = 1.5
    dispatch_when_idle: bool = True
    latency_target_s: float | None = None
    """With delay "auto": the deadline, counted from arrival, of requests that set no timeout."""

    @property
    def auto(self) -> bool:
        return self.max_queue_delay_s == AUTO


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
        self._wakeup = asyncio.Event()
        self._gate = asyncio.Event()  # test hook: cleared by pause(), the owner waits on it
        self._gate.set()
        self._slots = asyncio.Semaphore(policy.instances)
        self._running: set[asyncio.Task[None]] = set()
        self._closing = False  # close(): new requests are refused
        self._flushing = False  # drain(): batches go out without waiting for their window
        self.cost = BatchCost()
        """What a batch costs here, fitted from the batches this batcher ran."""
        self.deadlines = Deadlines(self.queue, self.cost, policy.max_batch_size, label)
        self._company = 1  # callers an idle batch waits for: how many the last one gathered
        self._probe_every = 1  # idle batches from one probe for company to the next (_gather)
        self._until_probe = 1
        self._last_put = 0.0  # when the newest request was queued
        # While the owner waits out a window: the batch's head, whether a request queued now
        # lets the batch go, and the deadline before which one must wake the owner.
        self._head: Pending | None = None
        self._ready: Callable[[], bool] | None = None
        self._wake_before = -math.inf
        # Kept: Python 3.11 makes a getpid() system call each time the running loop is asked for.
        self._loop = asyncio.get_running_loop()
        self._owner = self._loop.create_task(self._own(), name=f"batcher:{label}")

    @property
    def batched(self) -> bool:
        return self.policy.max_batch_size > 0

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
        try:
            if self._closing:
                raise BatcherClosed()
            if deadline is None and self.policy.auto and self.policy.latency_target_s is not None:
                deadline, limit = start + self.policy.latency_target_s, "latency target"
            if deadline is not None and deadline <= now:
                raise DeadlinePassed(
                    f"request reached {self.label} past its {limit}; it was not run"
                )
            group = group_key(inputs, self.policy.padding, self.policy.pad_bucket_ratio)
            item = Pending(inputs, rows, priority, tenant, group, now,
                           self._loop.create_future(), deadline,
                           on_run=on_run, on_leave=on_leave)  # fmt: skip
            self.queue.put(item)
        except BaseException:
            if on_leave is not None:
                on_leave()
            raise
        self._last_put = now
        if deadline is not None:
            self.deadlines.add(item, deadline)
        if self._ready is None or self._wakes(item):
            self._wakeup.set()
        try:
            if deadline is None:
                return await item.future
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
            self._withdraw(item)
            leave(item)
            raise DeadlinePassed(
                f"request waited {time.monotonic() - now:.3f} s in the queue of {self.label}, "
                f"past its {limit} of {deadline - start:.3f} s; it was not run"
            )
        except asyncio.CancelledError:
            # The client left: a queued request is withdrawn and never computed (a running one
            # leaves the batcher with its batch).
            self._withdraw(item)
            item.future.cancel()
            if item.state != RUNNING:
                leave(item)
            raise
        finally:
            # An error raised from the future keeps this frame in its traceback: not the item,
            # whose future holds the error (a cycle only the collector would break).
            del item

    def _wakes(self, item: Pending) -> bool:
        """Whether `item`, queued while the owner waits out a window, wakes it: unless it leaves
        the window as it was (the batch cannot go yet, `item` is not due before the window ends
        and does not outrank its head in another group)."""
        head, ready = self._head, self._ready
        if head is None or ready is None:
            return True
        return (
            ready()
            or (item.deadline is not None and item.deadline < self._wake_before)
            or (item.priority < head.priority and item.group != head.group)
        )

    def _withdraw(self, item: Pending) -> None:
        """Take a request whose caller left (or whose deadline passed) out of the queue; its
        batch goes without it, at once if it was the first."""
        self.queue.cancel(item)
        if item is self._head:
            self._wakeup.set()

    def _outranked(self, head: Pending) -> bool:
        """Whether a queued request of a higher level than `head`'s is in another group: its
        batch goes first."""
        if head.priority == 1:
            return False  # nothing outranks level 1
        first = self.queue.head()
        return first is not None and first.priority < head.priority and first.group != head.group

    def pause(self) -> None:
        """Test hook: stop forming batches (queued requests wait) until resume()."""
        self._gate.clear()

    def resume(self) -> None:
        self._gate.set()

    async def drain(self) -> None:
        """Send everything queued at once, without waiting for batch windows, and wait for it.
        Requests still arriving (already accepted upstream) are served the same way."""
        self._flushing = True
        self._wakeup.set()
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
                batch = await self._next_batch()
            except BaseException:
                self._slots.release()
                raise
            task = self._loop.create_task(self._execute(batch))
            del batch  # else this loop holds the batch's inputs until the next batch forms
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def _next_batch(self) -> list[Pending]:
        policy = self.policy
        while True:
            await self._gate.wait()
            head = self.queue.head()
            if head is None:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            if not self.batched:
                batch = self.queue.take(head.group, max_rows=head.rows, max_requests=1)
            else:
                if not await self._fill_window(head) or not self._gate.is_set():
                    continue  # paused, or a request that outranks the head came
                batch = self.queue.take(head.group, policy.max_batch_size)
            if policy.auto:
                batch = self.deadlines.meet(batch)
            if batch:
                return batch

    def _window_end(self, head: Pending, rows: int) -> float:
        """When the batch led by `head` must go: at its window's end, or sooner if a queued
        request's deadline comes first: then at the latest start that still meets it after a
        batch of `rows`' predicted compute (`deadlines.reserve`; a window past it would answer
        that request DeadlinePassed unrun on an idle model).
        Fixed: the window is the delay after the head arrived. Auto: it runs to that latest
        start, or with no deadline queued, one such batch's time after the head arrived; while
        the cost is not fitted yet, the batch goes at once (the first batches are what teach
        it)."""
        delay = self.policy.max_queue_delay_s
        predicted = self.cost.predict(rows)
        if not isinstance(delay, str):
            end = head.enqueued + delay
        elif predicted is None:
            return head.enqueued
        else:
            end = head.enqueued + predicted if head.deadline is None else math.inf
        soonest = self.deadlines.soonest()
        if soonest is None:
            return end
        return min(end, soonest - reserve(predicted or 0.0))

    async def _fill_window(self, head: Pending) -> bool:
        """Wait until the head's group can make a full or preferred batch, or its window ends;
        False when a request that outranks the head comes first (see `_outranked`)."""
        policy = self.policy
        largest_preferred = max(policy.preferred_batch_sizes, default=policy.max_batch_size)
        rows = min(largest_preferred, policy.max_batch_size)
        if policy.dispatch_when_idle and not self._running:
            return await self._gather(head, rows)

        def ready() -> bool:
            rows = self.queue.group_rows(head.group)
            return (
                head.state != QUEUED
                or rows >= policy.max_batch_size
                or rows >= largest_preferred
                or rows in policy.preferred_batch_sizes
            )

        while not ready() and not self._flushing and self._gate.is_set():
            if policy.dispatch_when_idle and not self._running:
                return True  # the batch that was running has finished: go now
            if self._outranked(head):
                return False
            end = self._window_end(head, rows)
            if end <= time.monotonic():
                return True
            await self._wait(head, ready, end, rows)
        return True

    async def _gather(self, head: Pending, rows: int) -> bool:
        """An idle model's batch: sent at once, unless callers have been coming together. A
        front-end may hand requests over one at a time, hundreds of µs apart (grpc.aio accepts
        one call per wake of its poller), so a model idle between them would run every request
        alone, each paying the whole batch path. So the batch waits, up to its window, until as
        many callers are queued as the last idle batch gathered; the window ending first lowers
        that to the callers who came. Now and then a batch (a probe) then waits for one caller
        more, while callers keep coming no more than GROW_WAIT_S apart: that is how company is
        noticed and grows, and all a lone caller ever waits. A probe that finds its caller is
        followed by another at the next batch, so company climbs a caller a batch while callers
        keep coming; one that does not doubles the batches to the next, up to GROW_EVERY, so a
        model whose callers are all in its batch seldom waits for one that cannot come.
        False when a request that outranks the head comes first (see `_outranked`)."""
        self._until_probe -= 1
        probing = self._until_probe <= 0
        want = self._company + probing
        if want <= 1:
            return True
        policy = self.policy

        def full() -> bool:
            return self.queue.group_rows(head.group) >= policy.max_batch_size

        def end_now(window_end: float) -> float:
            if policy.auto:
                window_end = min(window_end, head.enqueued + AUTO_GATHER_S)
            # A probe that has its company waits for one caller more only GROW_WAIT_S past the
            # newest's arrival.
            if probing and self.queue.requests >= self._company:
                return min(window_end, self._last_put + GROW_WAIT_S)
            return window_end

        def ready() -> bool:  # or the end came nearer: the caller that completed the company
            return (
                head.state != QUEUED
                or self.queue.requests >= want
                or full()
                or end_now(window_end) < end
            )

        while head.state == QUEUED and not self._flushing and self._gate.is_set():
            if self._outranked(head):
                return False
            callers = self.queue.requests
            full_now = full()
            window_end = self._window_end(head, rows)
            end = end_now(window_end)
            if callers >= want or full_now or end <= time.monotonic():
                if probing:
                    found = callers >= want or full_now
                    self._probe_every = 1 if found else min(2 * self._probe_every, GROW_EVERY)
                    self._until_probe = self._probe_every
                self._company = callers
                return True
            await self._wait(head, ready, end, rows)
        return True

    async def _wait(self, head: Pending, ready: Callable[[], bool], end: float, rows: int) -> None:
        """Wait out the window of the batch led by `head`: until a queued request makes `ready()`
        true or is due before `end` (a batch of `rows`' predicted compute before it), something
        else wakes the owner (a batch ends, a drain, the head leaves), or `end` comes. A request
        that changes none of these does not wake it: grpc.aio hands calls to the loop one loop
        turn apart, and waking the owner for each (a task step and a timer) cost every call
        ~10 µs."""
        self._wakeup.clear()
        self._head, self._ready = head, ready
        self._wake_before = end + reserve(self.cost.predict(rows) or 0.0)
        try:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(end - time.monotonic()):
                    await self._wakeup.wait()
        finally:
            self._head = self._ready = None
            self._wake_before = -math.inf

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
            self._wakeup.set()  # a model that went idle may send its next batch at once
            for item in batch:  # cancelled by close() mid-run: every caller still gets an answer
                if not item.future.done():
                    settle(item, exc=BatcherClosed("server shut down while this request ran"))
                leave(item)  # one whose caller left while it ran, or skipped by the reruns

    async def _run(self, batch: list[Pending]) -> None:
        rows = sum(item.rows for item in batch)
        started = assembled = ran = time.monotonic()
        try:
            if self.batched:
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
