"""In-flight coalescing: identical requests that arrive while one is being computed wait for that
computation instead of starting their own.

Decisions:
- The computation runs as its own task and each caller awaits it through `asyncio.shield`, so a
  caller that is cancelled (client gone, deadline) never cancels it while anyone else waits.
- When the last waiter leaves, the computation is cancelled (nobody wants the result, and the
  batcher drops a request whose future was cancelled before it runs). Its key is forgotten at
  that moment, so a caller arriving later starts afresh instead of joining a dying task.
- An exception from the computation is raised in every waiter. A computation cancelled from the
  inside (not by its waiters) is reported to them as BackendError, not as their own cancellation.
- The entry is removed as soon as the computation finishes: a later identical request is a cache
  lookup (the computation is expected to `put` its result before returning), not a join.
- Copies: the first waiter to collect the result gets the original object; every other waiter
  gets `clone(result)`, so each caller owns what it receives. `clone=None` shares one object
  (fine when results are immutable). Copying happens here, not in the engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from engine.errors import BackendError

T = TypeVar("T")


@dataclass(slots=True)
class _Flight(Generic[T]):
    task: asyncio.Task[T]
    waiters: int = 0
    original_taken: bool = False


class Coalescer(Generic[T]):
    """Runs at most one computation per key at a time; see the module docstring for semantics."""

    def __init__(self, clone: Callable[[T], T] | None = None) -> None:
        self._clone = clone
        self._flights: dict[bytes, _Flight[T]] = {}
        self.coalesced = 0
        """Callers that joined a computation already in flight (a counter for metrics)."""

    def __len__(self) -> int:
        """Computations in flight."""
        return len(self._flights)

    def waiters(self, key: bytes) -> int:
        """Callers currently waiting on `key` (0 when nothing is in flight)."""
        flight = self._flights.get(key)
        return 0 if flight is None else flight.waiters

    async def run(self, key: bytes, compute: Callable[[], Awaitable[T]]) -> T:
        """`await compute()`, or the result of the identical computation already in flight."""
        flight = self._flights.get(key)
        if flight is None:
            flight = _Flight(asyncio.get_running_loop().create_task(_await(compute())))
            self._flights[key] = flight
            flight.task.add_done_callback(lambda task: self._finished(key, task))
        else:
            self.coalesced += 1
        flight.waiters += 1
        try:
            value = await asyncio.shield(flight.task)
        except asyncio.CancelledError:
            if flight.task.cancelled() and not _cancelling():
                raise BackendError("the shared computation was cancelled") from None
            raise
        finally:
            flight.waiters -= 1
            if flight.waiters == 0 and not flight.task.done():
                flight.task.cancel()
                self._forget(key, flight)
        if self._clone is None or not flight.original_taken:
            flight.original_taken = True
            return value
        return self._clone(value)

    def _finished(self, key: bytes, task: asyncio.Task[T]) -> None:
        flight = self._flights.get(key)
        if flight is not None and flight.task is task:
            self._forget(key, flight)
        if not task.cancelled():
            task.exception()  # retrieved: waiters re-raise it; no "never retrieved" warning

    def _forget(self, key: bytes, flight: _Flight[T]) -> None:
        if self._flights.get(key) is flight:
            del self._flights[key]


def _cancelling() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


async def _await(awaitable: Awaitable[T]) -> T:
    return await awaitable
