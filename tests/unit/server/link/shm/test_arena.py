"""server.link.shm.arena: one memfd mapped by two processes (here: two mappings of one file), its
slots, and the watcher that says when no array views a slot any more."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from server.link.shm.arena import Arena, SlotWatcher


def view(slot: object, dtype: type[np.generic]) -> np.ndarray:
    """An array over a slot, as the link's layout makes them (the slot stays its base)."""
    array: np.ndarray = np.frombuffer(slot, dtype)  # type: ignore[call-overload]
    return array


@pytest.fixture
def arenas() -> Iterator[tuple[Arena, Arena]]:
    writer = Arena(1 << 12)
    reader = Arena(1 << 12, fd=os.dup(writer.fd))  # what a forked process maps
    yield writer, reader
    reader.close()
    writer.close()


def test_a_slot_written_in_one_mapping_is_read_in_the_other(arenas: tuple[Arena, Arena]) -> None:
    writer, reader = arenas
    values = np.arange(16, dtype=np.float32)
    view(writer.slot(256, values.nbytes), np.float32)[:] = values
    read = view(reader.slot(256, values.nbytes), np.float32)
    np.testing.assert_array_equal(read, values)
    assert bytes(reader.buf[256 : 256 + values.nbytes]) == values.tobytes()
    del read


@pytest.mark.parametrize(("offset", "size"), [(-1, 4), (0, -1), (4090, 7), (1 << 12, 1)])
def test_a_slot_outside_the_arena_is_refused(
    arenas: tuple[Arena, Arena], offset: int, size: int
) -> None:
    with pytest.raises(ValueError, match=rf"^slot {offset}\+{size} lies outside the 4096 byte"):
        arenas[0].slot(offset, size)


def test_a_slot_at_the_very_end_is_allowed(arenas: tuple[Arena, Arena]) -> None:
    assert len(arenas[0].slot(4092, 4)) == 4


async def test_the_slot_is_released_once_the_last_array_viewing_it_is_gone(
    arenas: tuple[Arena, Arena],
) -> None:
    released: list[int] = []
    watcher = SlotWatcher(asyncio.get_running_loop(), released.append)
    slot = arenas[0].slot(64, 32)
    watcher.watch(slot, 64)
    first = view(slot, np.float32)
    second = first[2:]  # a view of the view keeps the slot too
    del slot
    del first
    assert released == []
    del second
    assert released == [64]  # in the loop's own thread: at once, no wake-up


async def test_a_slot_dropped_in_another_thread_is_released_on_the_loop(
    arenas: tuple[Arena, Arena],
) -> None:
    loop = asyncio.get_running_loop()
    released: list[tuple[int, int]] = []
    done = asyncio.Event()

    def release(offset: int) -> None:
        released.append((offset, threading.get_ident()))
        done.set()

    watcher = SlotWatcher(loop, release)
    slot = arenas[0].slot(128, 16)
    watcher.watch(slot, 128)
    holder = [view(slot, np.uint8)]
    del slot
    thread = threading.Thread(target=holder.clear)  # a backend's thread drops the last view
    thread.start()
    thread.join()
    await asyncio.wait_for(done.wait(), 5)
    assert released == [(128, threading.get_ident())]
