"""Placing tensors in an arena slot: a copy made off the event loop keeps its slot until it
ends (server/link/shm/placement.py)."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

import server.link.shm.placement
from server.link.shm.allocator import Allocator
from server.link.shm.arena import Arena
from server.link.shm.layout import write_tensors
from server.link.shm.placement import WRITE_OFF_LOOP_BYTES, place_tensors


async def test_a_slot_being_written_off_the_loop_is_not_freed_under_the_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A large request cancelled (its client left) while a thread copies it into its slot: the
    slot stays taken until the copy ends. It was freed at once, the next request was given it
    and the copy overwrote that request's inputs with the departed client's bytes."""
    entered, go = threading.Event(), threading.Event()

    def slow_write(*args: object) -> object:
        entered.set()
        go.wait(10)
        return write_tensors(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(server.link.shm.placement, "write_tensors", slow_write)
    arena = Arena(4 * WRITE_OFF_LOOP_BYTES)
    allocator = Allocator(arena.size_bytes)
    try:
        big = {"x": np.ones(WRITE_OFF_LOOP_BYTES + 1, np.uint8)}  # copied in a thread
        placing = asyncio.ensure_future(place_tensors(allocator, arena, big, "the arena"))
        assert await asyncio.to_thread(entered.wait, 10)
        placing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await placing
        assert allocator.slots == 1  # the thread still writes into it
        go.set()
        for _ in range(1000):  # the copy ends in its thread, then its callback runs on the loop
            if allocator.slots == 0:
                break
            await asyncio.sleep(0.01)
        assert allocator.slots == 0
    finally:
        go.set()
        arena.close()
