"""Placing tensors in an arena: a slot taken from its allocator and written in the layout, or
the reason none is given (a full arena is a quick 503, never a wait); a large copy runs in a
worker thread, not on the event loop."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import numpy as np

from engine import errors
from server.link.shm.allocator import Allocator
from server.link.shm.arena import Arena
from server.link.shm.layout import Descriptor, slot_bytes, write_tensors

WRITE_OFF_LOOP_BYTES = 1 << 20
"""Tensors larger than this are copied into an arena in a worker thread, not on the loop."""


def place_now(
    allocator: Allocator, arena: Arena, arrays: Mapping[str, np.ndarray], size: int, what: str
) -> tuple[int, list[Descriptor]]:
    """`place_tensors` without a coroutine (~0.5 µs a side of a request's crossing), for a slot
    of `size` bytes (slot_bytes) of at most WRITE_OFF_LOOP_BYTES: its offset and descriptors."""
    offset = _take(allocator, size, what)
    try:
        described = write_tensors(arena.buf, offset, arrays)
    except BaseException:
        allocator.free(offset)
        raise
    return offset, described


def _take(allocator: Allocator, size: int, what: str) -> int:
    """A slot of `size` bytes, or why none is given: PayloadTooLarge when that exceeds the whole
    arena, Overloaded when it has no room now (a full arena is a quick 503, never a wait)."""
    offset = allocator.alloc(size) if size <= allocator.size_bytes else None
    if offset is not None:
        return offset
    if size > allocator.size_bytes:
        raise errors.PayloadTooLarge(
            size,
            allocator.size_bytes,
            message=f"the tensors take {size} bytes, more than all of {what} holds "
            f"({allocator.size_bytes} bytes, the setting worker_arena_bytes)",
        )
    raise errors.Overloaded(
        f"{what} is full ({allocator.used_bytes} of {allocator.size_bytes} bytes in use); "
        "retry shortly"
    )


async def place_tensors(
    allocator: Allocator,
    arena: Arena,
    arrays: Mapping[str, np.ndarray],
    what: str,
    size: int | None = None,
) -> tuple[int, int, list[Descriptor]]:
    """`arrays` written into a new slot of `arena` (`size` bytes, slot_bytes when not given):
    its offset, size and the tensors' descriptions (see `_take` for the errors). Tensors larger
    than WRITE_OFF_LOOP_BYTES are copied in a worker thread."""
    if size is None:
        size = slot_bytes(arrays)
    if size <= WRITE_OFF_LOOP_BYTES:
        offset, described = place_now(allocator, arena, arrays, size, what)
        return offset, size, described
    offset = _take(allocator, size, what)
    copy = asyncio.ensure_future(asyncio.to_thread(write_tensors, arena.buf, offset, arrays))
    try:
        described = await asyncio.shield(copy)
    except BaseException:
        # Cancelled (the client left) while the thread may still be writing into the slot: it
        # is free once the thread is done, not before (the next request would be given it).
        copy.add_done_callback(lambda done: _free_after(done, allocator, offset))
        raise
    return offset, size, described


def _free_after(copy: asyncio.Future[Any], allocator: Allocator, offset: int) -> None:
    if not copy.cancelled():
        copy.exception()  # a failed copy was raised to the caller already (or nobody is left)
    allocator.free(offset)
