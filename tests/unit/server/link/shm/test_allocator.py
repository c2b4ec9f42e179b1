"""The arena's allocator: slots aligned, disjoint and bounded, frees coalesced, a double free
refused (server/link/shm/allocator.py)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from server.link.shm.allocator import Allocator
from server.link.shm.layout import ALIGN


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
