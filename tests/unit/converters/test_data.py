from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from converters.data import load_npz, random_batches, split_rows
from converters.errors import ConversionError
from converters.spec import parse_input

SPECS = [parse_input("ids:INT64:-1,sequence=6"), parse_input("x:FP32:-1,3")]


def write(path: Path, **arrays: np.ndarray) -> Path:
    np.savez(path, **arrays)  # type: ignore[arg-type]
    return path


def test_load_npz_casts_within_kind_and_checks_rows(tmp_path: Path) -> None:
    path = write(
        tmp_path / "data.npz",
        ids=np.arange(60, dtype=np.int32).reshape(10, 6),
        x=np.ones((10, 3), dtype=np.float64),
        extra=np.zeros(2),
    )
    arrays = load_npz(path, SPECS, batched=True)
    assert set(arrays) == {"ids", "x"}
    assert arrays["ids"].dtype == np.int64
    assert arrays["x"].dtype == np.float32
    assert arrays["ids"][9, 5] == 59


@pytest.mark.parametrize(
    ("arrays", "message"),
    [
        ({"ids": np.zeros((4, 6), np.int64)}, r"no array for input\(s\) x; it holds ids"),
        (
            {"ids": np.zeros((4, 6), np.float32), "x": np.zeros((4, 3), np.float32)},
            "array 'ids' is float32; input 'ids' is INT64",
        ),
        (
            {"ids": np.zeros((4, 6), np.int64), "x": np.zeros((4, 5), np.float32)},
            r"array 'x' has shape \[4, 5\]; expected \['batch', 3\]",
        ),
        (
            {"ids": np.zeros((4, 6), np.int64), "x": np.zeros((5, 3), np.float32)},
            "arrays must share a non-zero first axis",
        ),
    ],
)
def test_load_npz_errors_name_the_array(
    tmp_path: Path, arrays: dict[str, np.ndarray], message: str
) -> None:
    path = write(tmp_path / "bad.npz", **arrays)
    with pytest.raises(ConversionError, match=message):
        load_npz(path, SPECS, batched=True)


def test_load_npz_refuses_pickled_arrays(tmp_path: Path) -> None:
    path = write(tmp_path / "objects.npz", ids=np.array([{"a": 1}], dtype=object))
    with pytest.raises(ConversionError, match="cannot read"):
        load_npz(path, SPECS, batched=True)


def test_unbatched_arrays_count_samples_on_an_extra_axis(tmp_path: Path) -> None:
    specs = [parse_input("x:FP32:1,3")]
    path = write(tmp_path / "samples.npz", x=np.zeros((5, 1, 3), np.float32))
    arrays = load_npz(path, specs, batched=False)
    feeds = split_rows(arrays, 4, batched=False)
    assert len(feeds) == 5
    assert feeds[0]["x"].shape == (1, 3)


def test_split_rows_makes_batches_of_at_most_the_batch_size() -> None:
    arrays = {"x": np.arange(10).reshape(10, 1)}
    sizes = [len(batch["x"]) for batch in split_rows(arrays, 4, batched=True)]
    assert sizes == [4, 4, 2]


def test_random_batches_start_with_one_row_then_fill_batches() -> None:
    batches = random_batches(SPECS, samples=20, batch_size=8, batched=True, seed=1)
    assert [len(batch["ids"]) for batch in batches] == [1, 8, 8, 3]
    assert batches[1]["x"].shape == (8, 3)
    unbatched = random_batches([parse_input("x:FP32:2,3")], 3, 8, batched=False, seed=1)
    assert [batch["x"].shape for batch in unbatched] == [(2, 3)] * 3
