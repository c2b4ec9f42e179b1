"""engine.cache.contract: the cached value, what a result must be to answer a request, the
counters, and the read-only arrays every hit shares."""

from __future__ import annotations

import numpy as np
import pytest

from engine.cache.contract import (
    CachedResult,
    CacheStats,
    Expected,
    array_nbytes,
    copy_result,
    frozen_copy,
    read_only_views,
)
from engine.types import TensorSpec

SPECS = (TensorSpec("y", "FP32", (-1, 4)), TensorSpec("label", "BYTES", (-1,)))


def _result(rows: int = 2) -> CachedResult:
    labels = np.array([b"cat", b"a"][:rows], dtype=object)
    return CachedResult(
        {"y": np.zeros((rows, 4), np.float32), "label": labels}, {"y": "FP32", "label": "BYTES"}
    )


def test_bytes_of_a_result_count_bytes_elements_by_length() -> None:
    assert array_nbytes(np.zeros((2, 4), np.float32)) == 32
    assert array_nbytes(np.array([b"cat", b"a"], dtype=object)) == 4
    assert _result().nbytes == 36


def test_expected_outputs_take_the_requests_rows() -> None:
    assert Expected.for_outputs(SPECS, None, rows=2).outputs == {
        "y": ("FP32", (2, 4)),
        "label": ("BYTES", (2,)),
    }
    assert Expected.for_outputs(SPECS, ["label"], rows=3).outputs == {"label": ("BYTES", (3,))}
    unbatched = Expected.for_outputs((TensorSpec("y", "FP32", (2, -1)),), None, rows=None)
    assert unbatched.outputs == {"y": ("FP32", (2, -1))}


def test_a_result_that_fits_has_no_mismatch() -> None:
    assert Expected.for_outputs(SPECS, None, rows=2).mismatch(_result()) is None
    unbatched = Expected({"y": ("FP32", (2, -1))})
    assert unbatched.mismatch(CachedResult({"y": np.zeros((2, 7))}, {"y": "FP32"})) is None


def test_each_mismatch_says_what_was_held_and_what_was_expected() -> None:
    expected = Expected.for_outputs(SPECS, None, rows=2)
    only_y = CachedResult({"y": np.zeros((2, 4))}, {"y": "FP32"})
    assert expected.mismatch(only_y) == "outputs ['y']; expected ['label', 'y']"
    retyped = CachedResult(_result().outputs, {"y": "FP16", "label": "BYTES"})
    assert expected.mismatch(retyped) == "output 'y' is FP16; expected FP32"
    assert expected.mismatch(_result(rows=1)) == "output 'y' has shape [1, 4]; expected [2, 4]"
    flat = CachedResult(
        {"y": np.zeros(8), "label": _result().outputs["label"]}, _result().datatypes
    )
    assert expected.mismatch(flat) == "output 'y' has shape [8]; expected [2, 4]"


def test_a_frozen_copy_is_private_and_read_only() -> None:
    original = _result()
    frozen = frozen_copy(original)
    original.outputs["y"][0, 0] = 5.0
    assert frozen.outputs["y"][0, 0] == 0.0
    with pytest.raises(ValueError, match="read-only"):
        frozen.outputs["y"][0, 0] = 1.0
    view = read_only_views(frozen).outputs["y"]
    with pytest.raises(ValueError, match="read-only"):
        view[0, 0] = 1.0
    with pytest.raises(ValueError, match="cannot set WRITEABLE flag"):
        view.setflags(write=True)  # a view of a read-only array owned by nobody else


def test_copy_result_gives_writeable_arrays_of_its_own() -> None:
    frozen = frozen_copy(_result())
    copied = copy_result(frozen)
    copied.outputs["y"][0, 0] = 3.0
    assert frozen.outputs["y"][0, 0] == 0.0
    assert copied.datatypes == frozen.datatypes


def test_stats_by_name() -> None:
    stats = CacheStats(hits=3, misses=1)
    assert stats.as_dict() == {
        "hits": 3,
        "misses": 1,
        "errors": 0,
        "evictions": 0,
        "expirations": 0,
        "stores": 0,
        "skipped": 0,
        "rejected": 0,
        "bytes": 0,
        "entries": 0,
    }
