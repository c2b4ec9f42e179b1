"""Sample data for calibration, validation and measurement: `.npz` files (one array per model
input, rows along the first axis) or random inputs built from the input specs.

For a batched model the arrays are batches: shape [rows, ...] matching the input. For an unbatched
model (max_batch_size 0) the first axis counts samples, each of the input's full shape."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np

from converters.errors import ConversionError
from converters.spec import InputSpec, random_feeds

Batch = dict[str, np.ndarray]


def load_npz(path: Path, specs: list[InputSpec], batched: bool) -> Batch:
    """The file's arrays for the model's inputs, cast to their dtypes, checked against shapes."""
    try:
        with np.load(path, allow_pickle=False) as data:  # pickled arrays would run code
            arrays = {key: data[key] for key in data.files}
    except (OSError, ValueError) as exc:
        raise ConversionError(f"cannot read '{path}' as an .npz file: {exc}") from exc
    missing = [spec.name for spec in specs if spec.name not in arrays]
    if missing:
        raise ConversionError(
            f"'{path}' has no array for input(s) {', '.join(missing)}; "
            f"it holds {', '.join(sorted(arrays)) or 'no arrays'}"
        )
    result: Batch = {}
    for spec in specs:
        array = arrays[spec.name]
        if not np.can_cast(array.dtype, spec.dtype, casting="same_kind"):
            raise ConversionError(
                f"'{path}': array '{spec.name}' is {array.dtype}; input '{spec.name}' is "
                f"{spec.datatype}"
            )
        axes = spec.axes if batched else (None, *spec.axes)
        fixed_ok = all(
            axis is None or axis.dynamic or axis.size == size
            for axis, size in zip(axes, array.shape, strict=False)
        )
        if array.ndim != len(axes) or not fixed_ok:
            expected = spec.dims() if batched else ["samples", *spec.dims()]
            raise ConversionError(
                f"'{path}': array '{spec.name}' has shape {list(array.shape)}; expected {expected}"
            )
        result[spec.name] = array.astype(spec.dtype, copy=False)
    rows = {name: len(array) for name, array in result.items()}
    if len(set(rows.values())) > 1 or 0 in rows.values():
        raise ConversionError(f"'{path}': arrays must share a non-zero first axis; got {rows}")
    return result


def split_rows(arrays: Mapping[str, np.ndarray], batch_size: int, batched: bool) -> list[Batch]:
    """Batches of at most `batch_size` rows; one sample per feed for an unbatched model."""
    rows = len(next(iter(arrays.values())))
    if not batched:
        return [{name: array[i] for name, array in arrays.items()} for i in range(rows)]
    step = max(1, batch_size)
    return [
        {name: array[start : start + step] for name, array in arrays.items()}
        for start in range(0, rows, step)
    ]


def random_batches(
    specs: list[InputSpec], samples: int, batch_size: int, batched: bool, seed: int
) -> list[Batch]:
    """`samples` random rows: one batch of 1 row (the edge case), then batches of `batch_size`.
    An unbatched model gets `samples` separate feeds."""
    rng = np.random.default_rng(seed)
    if not batched:
        return [random_feeds(specs, None, rng) for _ in range(samples)]
    sizes = [1] if samples >= 1 else []
    left = samples - 1
    while left > 0:
        sizes.append(min(max(1, batch_size), left))
        left -= sizes[-1]
    return [random_feeds(specs, size, rng) for size in sizes]
