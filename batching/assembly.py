"""Batch assembly: which requests may share a batch, concatenation on dim 0 (with optional padding
of variable-length axes), and splitting outputs back per request."""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

Tensors = dict[str, np.ndarray]


@dataclass(frozen=True, slots=True)
class Padding:
    """An input whose `axis` may be padded with `value` so that lengths can differ in one batch.

    `outputs` maps each output with axes that follow the padded one to those axes: they are cut
    back to each request's own length. Any other output is split along the batch axis only, even
    when one of its axes happens to be as long as the padded length."""

    axis: int
    value: float
    outputs: Mapping[str, tuple[int, ...]] = field(default_factory=dict)


class SplitError(ValueError):
    """The model's outputs do not have the rows the batch put in."""


def bucket(length: int, ratio: float) -> int:
    """Length bucket: lengths in one bucket are within `ratio` of each other (ratio 1: exact)."""
    if ratio <= 1:
        return length
    if length <= 1:
        return length - 1  # 0 and 1 get buckets of their own, below log(2)'s
    return int(math.log(length) / math.log(ratio))


def group_key(
    inputs: Mapping[str, np.ndarray], padding: Mapping[str, Padding], ratio: float
) -> Hashable:
    """Requests with equal keys can be concatenated: same non-batch dims, except on paddable axes
    where only the length bucket must match."""
    key = []
    for name in sorted(inputs) if len(inputs) > 1 else inputs:
        array = inputs[name]
        dims = array.shape[1:]
        pad = padding.get(name)
        if pad is not None and pad.axis < array.ndim:
            padded = list(dims)
            padded[pad.axis - 1] = -1 - bucket(array.shape[pad.axis], ratio)
            dims = tuple(padded)
        key.append((name, array.dtype, dims))
    return tuple(key)


@dataclass(frozen=True, slots=True)
class Layout:
    """How a batch was built: rows per request, and per request the output axes to cut back as
    (output, axis, own length, padded length)."""

    rows: tuple[int, ...]
    cuts: tuple[tuple[tuple[str, int, int, int], ...], ...]


def concat(parts: Sequence[Tensors], padding: Mapping[str, Padding]) -> tuple[Tensors, Layout]:
    """One batch from several requests' inputs, padding paddable axes to the longest."""
    first = next(iter(parts[0]), None)
    rows = tuple(part[first].shape[0] for part in parts) if first is not None else (0,) * len(parts)
    if len(parts) == 1:  # one request: its own arrays, no copy
        return dict(parts[0]), Layout(rows, ((),))
    if not padding:  # the common case: nothing to pad
        batch = {name: np.concatenate([part[name] for part in parts]) for name in parts[0]}
        return batch, Layout(rows, ((),) * len(parts))
    # request -> (output, axis) -> (own length, padded length)
    cuts: list[dict[tuple[str, int], tuple[int, int]]] = [{} for _ in parts]
    batch = {}
    for name in parts[0]:
        arrays = [part[name] for part in parts]
        pad = padding.get(name)
        if pad is not None:
            target = max(a.shape[pad.axis] for a in arrays)
            for index, array in enumerate(arrays):
                own = array.shape[pad.axis]
                if own == target:
                    continue
                for output, axes in pad.outputs.items():
                    for axis in axes:
                        # Two inputs padded into one output axis (ids and mask): keep the longer.
                        kept = cuts[index].get((output, axis), (0, target))[0]
                        cuts[index][(output, axis)] = (max(own, kept), target)
                widths = [(0, 0)] * array.ndim
                widths[pad.axis] = (0, target - own)
                arrays[index] = np.pad(array, widths, constant_values=pad.value)
        batch[name] = np.concatenate(arrays, axis=0)
    layout = tuple(
        tuple(sorted((out, axis, own, target) for (out, axis), (own, target) in part.items()))
        for part in cuts
    )
    return batch, Layout(rows, layout)


def split(outputs: Tensors, layout: Layout) -> list[Tensors]:
    """Each request's slice of the batch outputs; the output axes that follow a padded input axis
    are cut back to the request's own length."""
    total = sum(layout.rows)
    for name, array in outputs.items():
        if array.ndim == 0 or array.shape[0] != total:
            got = "a scalar" if array.ndim == 0 else f"{array.shape[0]} rows"
            raise SplitError(f"output '{name}' has {got}; the batch has {total} rows")
    results: list[Tensors] = []
    start = 0
    for rows, cuts in zip(layout.rows, layout.cuts, strict=True):
        end = start + rows
        part = {name: array[start:end] for name, array in outputs.items()}
        for name, axis, own, target in cuts:
            piece = part.get(name)
            if piece is None:  # not among this batch's outputs: nothing to cut
                continue
            if piece.ndim <= axis:
                raise SplitError(
                    f"output '{name}' has {piece.ndim} dimensions; it has no axis {axis} to cut "
                    "back to the request's length"
                )
            if piece.shape[axis] != target:
                raise SplitError(
                    f"output '{name}' axis {axis} has length {piece.shape[axis]}; the padded "
                    f"length is {target}, so it cannot be cut back to the request's {own}"
                )
            index: list[slice] = [slice(None)] * piece.ndim
            index[axis] = slice(0, own)
            part[name] = piece[tuple(index)]
        results.append(part)
        start = end
    return results
