"""What a batcher does about its requests' deadlines: it knows the soonest one queued (a batch
window ends in time to meet it) and, with delay "auto", sheds at formation what a batch can no
longer run in time and tops the batch up with what the deadlines of those left allow.

A deadline is a time.monotonic() by which a request must be answered: its own timeout, or with
delay "auto" the latency target after it was queued. A batch predicted to take p seconds must
start `reserve(p)` before the deadline it is to meet.
"""

from __future__ import annotations

import heapq
import itertools
import time
import weakref

from batching.cost import BatchCost
from batching.errors import DeadlinePassed
from batching.queue import QUEUED, Pending, RequestQueue, settle

SLACK = 0.25
"""Part of the predicted compute kept in reserve when planning against a deadline (the fit is a
mean, and the loop needs time to hand the batch over)..."""
MIN_RESERVE_S = 0.002
"""...and at least this much: a busy event loop wakes a few milliseconds late."""
PROBE_AFTER_S = 1.0
"""With no batch run for this long, the next one runs unshed: shedding on a fit that only runs
could correct (one slow batch, a noisy neighbour) would otherwise shed everything forever."""


def reserve(predicted_s: float) -> float:
    """How long before a deadline a batch predicted to take `predicted_s` must start."""
    return predicted_s + max(predicted_s * SLACK, MIN_RESERVE_S)


class Deadlines:
    """The deadlines of one batcher's queue."""

    def __init__(
        self, queue: RequestQueue, cost: BatchCost, max_batch_size: int, label: str
    ) -> None:
        self.queue = queue
        self.cost = cost
        self.max_batch_size = max_batch_size
        self.label = label
        self.shed = 0
        """Requests answered DeadlinePassed unrun because their batch could not meet it."""
        self.last_ran = time.monotonic()
        """When a batch last finished (or the batcher started); the batcher sets it."""
        # Queued requests' deadlines, soonest first. Entries of those gone are dropped when they
        # come up, or when they outnumber the queue; a weak reference holds no inputs.
        self._due: list[tuple[float, int, weakref.ref[Pending]]] = []
        self._order = itertools.count()

    def add(self, item: Pending, deadline: float) -> None:
        """Count a request just queued with a deadline."""
        due = self._due
        heapq.heappush(due, (deadline, next(self._order), weakref.ref(item)))
        if len(due) > 2 * self.queue.requests + 64:
            self._due = [entry for entry in due if _queued(entry[2]())]
            heapq.heapify(self._due)

    def soonest(self) -> float | None:
        """The earliest deadline of a queued request; None when none has one."""
        due = self._due
        while due and not _queued(due[0][2]()):
            heapq.heappop(due)
        return due[0][0] if due else None

    def meet(self, batch: list[Pending]) -> list[Pending]:
        """Shed what cannot make it, then top the batch up from the queue, and again while that
        sheds more: a batch that shed its late head must not run short while requests wait.

        How far to top up: with a backlog (a full batch still queued behind this one) to the
        full size, and what cannot make it in a full batch is shed; shrinking the batch to save
        its head would only push rows into a next batch that is full already, so lateness moves
        back while every smaller batch costs throughput, which deepens the backlog (the CNN
        offered 1.5x what it serves ran 3.8-row batches and served 0.64x a fixed delay).
        Without one, only with as many rows as the deadlines of those in it still allow: what
        is left fits in the next batch."""
        largest = self.max_batch_size
        while True:
            batch = self._shed(batch)
            if not batch or largest == 0:
                return batch
            rows = sum(item.rows for item in batch)
            room = largest - rows
            backlog = self.queue.group_rows(batch[0].group) >= room + largest
            deadlines = [item.deadline for item in batch if item.deadline is not None]
            if deadlines and room > 0 and not backlog:
                fits = self.cost.rows_within(min(deadlines) - time.monotonic())
                room = room if fits is None else min(room, fits - rows)
            more = self.queue.take(batch[0].group, room) if room > 0 else []
            if not more:
                return batch
            batch += more

    def _shed(self, batch: list[Pending]) -> list[Pending]:
        """Answer DeadlinePassed, without running it, the most urgent request whose deadline
        falls before the batch's earliest end (`BatchCost.fastest`: a shed cannot be undone, so
        not on a fit that still remembers a slower machine); the batch shrinks and its end with
        it, so repeat until every request left can make it."""
        now = time.monotonic()
        if now - self.last_ran > PROBE_AFTER_S:
            return batch  # the fit is stale: this batch runs and refreshes it
        while batch:
            predicted = self.cost.fastest(sum(item.rows for item in batch))
            if predicted is None:
                return batch
            late = [i for i in batch if i.deadline is not None and i.deadline < now + predicted]
            if not late:
                return batch
            item = min(late, key=lambda i: i.deadline or now)
            self.shed += 1
            left_ms = max(0.0, (item.deadline or now) - now) * 1e3
            settle(
                item,
                exc=DeadlinePassed(
                    f"request to {self.label} cannot meet its deadline: {left_ms:.1f} ms left, "
                    f"its batch would take {predicted * 1e3:.1f} ms; it was not run"
                ),
            )
            batch = [other for other in batch if other is not item]
        return batch


def _queued(item: Pending | None) -> bool:
    return item is not None and item.state == QUEUED
