"""The shared-memory arena: the allocator's bounds and the tensor layout written once, viewed in
place (engine/shm.py)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import engine.shm
from engine.shm import (
    ALIGN,
    WRITE_OFF_LOOP_BYTES,
    Allocator,
    Arena,
    place_tensors,
    slot_bytes,
    view_tensors,
    write_tensors,
)
from tests.bytecodes import bytecodes_run


def test_allocations_are_aligned_disjoint_and_bounded() -> None:
    allocator = Allocator(4 * ALIGN)
    first, second = allocator.alloc(1), allocator.alloc(ALIGN + 1)
    assert (first, second) == (0, ALIGN)
    assert allocator.used_bytes == 3 * ALIGN
    assert allocator.alloc(2 * ALIGN) is None  # one block left: full means None, at once
    assert allocator.alloc(ALIGN) == 3 * ALIGN


def test_frees_coalesce_so_a_large_slot_fits_again() -> None:
    allocator = Allocator(4 * ALIGN)
    offsets = [allocator.alloc(ALIGN) for _ in range(4)]
    for offset in (offsets[1], offsets[3], offsets[2], offsets[0]):
        assert offset is not None
        allocator.free(offset)
    assert allocator.used_bytes == 0
    assert allocator.alloc(4 * ALIGN) == 0


def test_a_double_free_is_refused() -> None:
    allocator = Allocator(4 * ALIGN)
    offset = allocator.alloc(10)
    assert offset is not None
    allocator.free(offset)
    with pytest.raises(ValueError, match="no slot is allocated at offset 0"):
        allocator.free(offset)


def test_reserve_takes_a_slot_out_of_the_middle() -> None:
    allocator = Allocator(4 * ALIGN)
    allocator.reserve(ALIGN, ALIGN)
    assert [allocator.alloc(ALIGN) for _ in range(3)] == [0, 2 * ALIGN, 3 * ALIGN]
    allocator.free(ALIGN)
    assert allocator.alloc(ALIGN) == ALIGN


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 300)), max_size=40))
def test_random_alloc_free_never_overlaps(ops: list[tuple[bool, int]]) -> None:
    allocator = Allocator(16 * ALIGN)
    live: dict[int, int] = {}
    for is_free, size in ops:
        if is_free and live:
            offset = sorted(live)[size % len(live)]
            allocator.free(offset)
            del live[offset]
            continue
        offset = allocator.alloc(size)
        if offset is None:
            assert max((free for _, free in allocator._free), default=0) < size
            continue
        assert offset % ALIGN == 0
        assert offset + size <= 16 * ALIGN
        assert all(offset + size <= o or o + s <= offset for o, s in live.items())
        live[offset] = size
    for offset in list(live):
        allocator.free(offset)
    assert allocator.alloc(16 * ALIGN) == 0


def test_tensors_are_written_once_and_viewed_in_place_from_another_mapping() -> None:
    writer = Arena(1 << 16)
    reader = Arena(1 << 16, fd=os.dup(writer.fd))  # what the other process maps
    try:
        rng = np.random.default_rng(0)
        arrays = {
            "x": rng.standard_normal((3, 5)).astype(np.float32),
            "ids": np.arange(7, dtype=np.int64)[::2],  # not contiguous: written contiguous
            "flag": np.array([True, False]),
            "text": np.array([b"a", b"", "h\u00e9".encode()], dtype=object),
        }
        start = 2 * ALIGN
        described = write_tensors(writer.buf, start, arrays)
        size = slot_bytes(arrays)
        slot = reader.slot(start, size)
        views = view_tensors(slot, orjson.loads(orjson.dumps(described)))  # as a frame carries it
        whole = np.frombuffer(reader.buf, np.uint8)
        for name in ("x", "ids", "flag"):
            np.testing.assert_array_equal(views[name], arrays[name])
            assert np.shares_memory(views[name], whole)  # a view, not a copy
        assert views["text"].tolist() == [b"a", b"", "h\u00e9".encode()]
        assert all(t[3] % ALIGN == 0 for t in described)
        # The writer's later change shows through: the reader holds no copy.
        writer.buf[start] = 0xFF
        assert views["x"].view(np.uint8).reshape(-1)[0] == 0xFF
        del views, slot, whole
    finally:
        reader.close()
        writer.close()


@pytest.mark.parametrize(
    ("item", "problem"),
    [
        (["x", "<f4", [16], 8, 16 * 4], "outside its slot"),
        (["x", "<f4", [4], 0, 15], "does not fill 15 bytes"),
        (["x", "|O", [1], 0, 8], "does not fill"),
        (["x", "BYTES", [2], 0, 8], "ends inside element 1"),
    ],
)
def test_bad_descriptors_are_refused(item: list[object], problem: str) -> None:
    buf = memoryview(bytearray(64))
    buf[0:6] = b"\x02\x00\x00\x00ab"
    with pytest.raises(ValueError, match=problem):
        view_tensors(buf, [item])


def test_malformed_descriptor_lists_are_refused() -> None:
    buf = memoryview(bytearray(64))
    for item in ("x", ["x", "<f4", [-1], 0, 0], ["x", "<f4", [1], "0", 4], ["x", "<f4", [1]]):
        with pytest.raises(ValueError, match="descriptor"):
            view_tensors(buf, [item])
    with pytest.raises(ValueError, match="descriptors must be a list"):
        view_tensors(buf, {"x": 1})


@pytest.mark.parametrize(
    ("item", "problem"),
    [
        # Each element carries a 4-byte length, so 2**40 elements cannot lie in 8 bytes; the
        # count was allocated first (8 TiB of object pointers: a MemoryError in the engine).
        (["x", "BYTES", [2**40], 0, 8], "of 1099511627776 elements cannot fit in 8 bytes"),
        (["x", "float32", [1], 0, 4], "float32 \\[1\\] does not fill"),  # not numpy's str
        (["x", "not a dtype", [1], 0, 4], "does not fill"),
        (["x", "<f4", [0, 2**70], 0, 0], "dimension"),
    ],
)
def test_descriptors_from_the_peer_cannot_allocate_or_crash(
    item: list[object], problem: str
) -> None:
    buf = memoryview(bytearray(64))
    with pytest.raises(ValueError, match=problem):
        view_tensors(buf, [item])


def test_a_descriptor_with_too_many_dimensions_is_refused_before_any_is_looked_at() -> None:
    # A frame of 64 MiB holds some 30 million dimensions: each was checked by a Python step on
    # the engine's event loop before numpy refused more than 64.
    buf = memoryview(bytearray(64))
    item = ["x", "<f4", [1] * 1_000_000, 0, 4]
    with pytest.raises(ValueError, match="1000000 dimensions, past 64"):
        view_tensors(buf, [item])

    def refused() -> None:
        with contextlib.suppress(ValueError):
            view_tensors(buf, [item])

    assert bytecodes_run(refused) < 500  # 18 million before


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

    monkeypatch.setattr(engine.shm, "write_tensors", slow_write)
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
