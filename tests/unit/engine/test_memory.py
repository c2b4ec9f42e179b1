"""engine/memory.py: the allocator's count follows an allocation and its release, and an
unload's free pages go back to the system."""

from __future__ import annotations

import numpy as np

from engine.memory import heap_bytes, map_large_blocks, settled_rss_bytes


def test_heap_bytes_follow_an_allocation_and_its_release() -> None:
    map_large_blocks()
    before = heap_bytes()
    block = np.ones(8 << 20, np.uint8)  # 8 MiB, written
    grown = heap_bytes() - before
    assert 8 << 20 <= grown < (8 << 20) + (1 << 20)
    del block
    assert abs(heap_bytes() - before) < 1 << 20


def test_a_freed_large_block_leaves_the_resident_set() -> None:
    map_large_blocks()
    before = settled_rss_bytes()
    block = np.ones(32 << 20, np.uint8)
    assert settled_rss_bytes() - before >= 30 << 20
    del block
    assert settled_rss_bytes() - before < 4 << 20
