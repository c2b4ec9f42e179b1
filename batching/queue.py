"""A bounded priority queue of pending requests: levels numbered as in Triton (1 is the highest
and is served first), round-robin across tenants within a level, FIFO within a tenant, bounded in
rows, with a per-tenant share cap."""

from __future__ import annotations

import asyncio
from collections import defaultdict, deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import numpy as np

from batching.errors import QueueFull

QUEUED, RUNNING, CANCELLED = "queued", "running", "cancelled"


@dataclass(eq=False, slots=True, weakref_slot=True)
class Pending:
    """One request waiting for a batch. Its future exists before it is queued."""

    inputs: dict[str, np.ndarray]
    rows: int
    priority: int
    """Level 1 (highest) to the queue's `levels` (lowest)."""
    tenant: str
    group: Hashable
    enqueued: float
    future: asyncio.Future[dict[str, np.ndarray]]
    deadline: float | None = None
    """time.monotonic() by which it must be answered (its timeout or the latency target)."""
    state: str = field(default=QUEUED)
    on_run: Callable[[], None] | None = None
    """Called when its batch starts running."""
    on_leave: Callable[[], None] | None = None
    """Called once the batcher is done with it (see Batcher.submit)."""


class RequestQueue:
    """Not thread-safe: used only from the event loop."""

    def __init__(
        self, levels: int, max_rows: int, tenant_share: Callable[[str], float] | None = None
    ) -> None:
        self.levels = levels
        self.max_rows = max_rows
        self.rows = 0
        self.requests = 0
        self._tenant_share = tenant_share or (lambda _tenant: 1.0)
        self._tenant_rows: dict[str, int] = defaultdict(int)
        self._group_rows: dict[Hashable, int] = defaultdict(int)
        # level - 1 -> tenant -> FIFO, highest level first; dict order is the round-robin order
        # (rotated after each take)
        self._levels: list[dict[str, deque[Pending]]] = [{} for _ in range(levels)]

    def put(self, item: Pending) -> None:
        """Queue `item`; QueueFull at once when the queue or the tenant's share is full."""
        if not 1 <= item.priority <= self.levels:  # the caller checks requests; this is a bug
            raise ValueError(f"priority level {item.priority} is not in 1..{self.levels}")
        if self.rows + item.rows > self.max_rows:
            raise QueueFull(
                f"queue is full: {self.rows} of {self.max_rows} rows queued, "
                f"request has {item.rows}"
            )
        share = int(self._tenant_share(item.tenant) * self.max_rows)
        held = self._tenant_rows[item.tenant]
        if held + item.rows > share:
            raise QueueFull(
                f"tenant '{item.tenant}' holds {held} queued rows of this model; its share is "
                f"{share} of {self.max_rows}"
            )
        self._levels[item.priority - 1].setdefault(item.tenant, deque()).append(item)
        self._count(item, +1)

    def cancel(self, item: Pending) -> None:
        """Withdraw a queued item (its caller left or its deadline passed); it is never run."""
        if item.state == QUEUED:
            item.state = CANCELLED
            self._count(item, -1)

    def group_rows(self, group: Hashable) -> int:
        """Rows queued in one shape group."""
        return self._group_rows.get(group, 0)

    def head(self) -> Pending | None:
        """The next item in serving order, dropping withdrawn ones on the way."""
        for tenants in self._levels:
            for tenant, fifo in list(tenants.items()):
                while fifo and fifo[0].state != QUEUED:
                    fifo.popleft()
                if fifo:
                    return fifo[0]
                del tenants[tenant]
        return None

    def take(
        self, group: Hashable, max_rows: int, max_requests: int | None = None
    ) -> list[Pending]:
        """Items of `group` in serving order, as many as fit in `max_rows` without splitting one;
        they are marked running. Items of other groups keep their places."""
        taken: list[Pending] = []
        rows = 0
        for tenants in self._levels:
            progress = True
            while progress and rows < max_rows:
                progress = False
                for fifo in tenants.values():
                    item = _first_fitting(fifo, group, max_rows - rows)
                    if item is None:
                        continue
                    item.state = RUNNING
                    self._count(item, -1)
                    taken.append(item)
                    rows += item.rows
                    progress = True
                    if max_requests is not None and len(taken) >= max_requests:
                        self._rotate(tenants)
                        return taken
            self._rotate(tenants)
        return taken

    def withdraw_all(self) -> list[Pending]:
        """Every queued item, removed (used when closing)."""
        items = [i for tenants in self._levels for f in tenants.values() for i in f]
        live = [item for item in items if item.state == QUEUED]
        for item in live:
            self.cancel(item)
        for tenants in self._levels:
            tenants.clear()
        return live

    def _count(self, item: Pending, sign: int) -> None:
        self.rows += sign * item.rows
        self.requests += sign
        self._tenant_rows[item.tenant] += sign * item.rows
        self._group_rows[item.group] += sign * item.rows
        if not self._group_rows[item.group]:
            del self._group_rows[item.group]
        if not self._tenant_rows[item.tenant]:
            del self._tenant_rows[item.tenant]

    @staticmethod
    def _rotate(tenants: dict[str, deque[Pending]]) -> None:
        # The tenant served first this time goes last next time.
        if len(tenants) > 1:
            first = next(iter(tenants))
            tenants[first] = tenants.pop(first)


def _first_fitting(fifo: deque[Pending], group: Hashable, room: int) -> Pending | None:
    """Pop the first live item of `group` that fits in `room` rows; withdrawn items are dropped."""
    while fifo and fifo[0].state != QUEUED:
        fifo.popleft()
    for index, item in enumerate(fifo):
        if item.state == QUEUED and item.group == group:
            if item.rows > room:
                return None  # FIFO within a tenant: never jump ahead of an item that did not fit
            del fifo[index]
            return item
    return None


def leave(item: Pending) -> None:
    """Call the item's `on_leave`, once: the batcher is done with it."""
    left, item.on_leave = item.on_leave, None
    if left is not None:
        left()


def settle(
    item: Pending, result: dict[str, np.ndarray] | None = None, exc: Exception | None = None
) -> None:
    """Answer the item's caller with `result` or `exc` (unless it left), and let it leave."""
    leave(item)
    if item.future.done():  # the caller already left
        return
    if exc is not None:
        item.future.set_exception(exc)
    else:
        item.future.set_result(result or {})
