"""The tensor layout in a slot: written once, viewed in place from another mapping, and every
descriptor a peer sends checked (server/link/shm/layout.py)."""

from __future__ import annotations

import contextlib
import os

import numpy as np
import orjson
import pytest

from server.link.shm.arena import Arena
from server.link.shm.layout import ALIGN, slot_bytes, view_tensors, write_tensors
from tests.bytecodes import bytecodes_run


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
