"""Forming a batch: the part of the batcher's owner task that picks a queued request to lead the
next batch and waits out its window (`batching.batcher` describes when a batch goes), holding
the state only that wait reads: the company an idle batch waits for, the probes that grow it, and
what the window waited out now lets a newly queued request wake it for.

Apart from `batching.batcher`, which queues requests, runs the batches formed here and answers
their callers: the batcher tells a `BatchFormer` what was queued, withdrawn or finished, and asks
it for the next batch; nothing here runs a batch or settles a request.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable, Collection

from batching.cost import BatchCost
from batching.deadlines import Deadlines, reserve
from batching.policy import BatchPolicy
from batching.queue import QUEUED, Pending, RequestQueue

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


class BatchFormer:
    """Forms the batches of one Batcher's queue, one at a time, for its owner task."""

    def __init__(
        self,
        queue: RequestQueue,
        policy: BatchPolicy,
        cost: BatchCost,
        deadlines: Deadlines,
        running: Collection[asyncio.Task[None]],
    ) -> None:
        self.policy = policy
        self.queue = queue
        self.cost = cost
        self.deadlines = deadlines
        self._running = running  # the batcher's running batches: none means the model is idle
        self._wakeup = asyncio.Event()
        self._gate = asyncio.Event()  # test hook: cleared by pause(), the owner waits on it
        self._gate.set()
        self._flushing = False  # drain(): batches go out without waiting for their window
        self._company = 1  # callers an idle batch waits for: how many the last one gathered
        self._probe_every = 1  # idle batches from one probe for company to the next (_gather)
        self._until_probe = 1
        self._last_put = 0.0  # when the newest request was queued
        # While the owner waits out a window: the batch's head, whether a request queued now
        # lets the batch go, and the deadline before which one must wake the owner.
        self._head: Pending | None = None
        self._ready: Callable[[], bool] | None = None
        self._wake_before = -math.inf

    def queued(self, item: Pending) -> None:
        """Count `item`, just queued, and wake the owner if it may change the batch it forms."""
        self._last_put = item.enqueued
        if self._ready is None or self._wakes(item):
            self._wakeup.set()

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

    def withdraw(self, item: Pending) -> None:
        """Take a request whose caller left (or whose deadline passed) out of the queue; its
        batch goes without it, at once if it was the first."""
        self.queue.cancel(item)
        if item is self._head:
            self._wakeup.set()

    def wake(self) -> None:
        """Wake the owner: a batch ended, so a model that went idle may send its next at once."""
        self._wakeup.set()

    def flush(self) -> None:
        """From now on, send batches without waiting for their windows (a drain)."""
        self._flushing = True
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

    async def next_batch(self) -> list[Pending]:
        policy = self.policy
        while True:
            await self._gate.wait()
            head = self.queue.head()
            if head is None:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            if not policy.batched:
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
