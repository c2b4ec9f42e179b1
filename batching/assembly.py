"""Batch assembly: which requests may share a batch, concatenation on dim 0 (with optional padding
of variable-length axes), and splitting outputs back per request."""

from __future__ import annotations

import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

Tensors = dict[str, np.ndarray]


@dataclass(frozen=True, slots=True)
class Padding:
    """An input whose `axis` may be padded with `value` so that lengths can differ in one batch."""

    axis: int
    value: float


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
    """How a batch was built: rows per request, and (axis, own length, padded length) per request
    for padded axes, so outputs can be cut back."""

    rows: tuple[int, ...]
    padded: tuple[tuple[tuple[int, int, int], ...], ...]


def concat(parts: Sequence[Tensors], padding: Mapping[str, Padding]) -> tuple[Tensors, Layout]:
    """One batch from several requests' inputs, padding paddable axes to the longest."""
    first = next(iter(parts[0]), None)
    rows = tuple(part[first].shape[0] for part in parts) if first is not None else (0,) * len(parts)
    if len(parts) == 1:  # one request: its own arrays, no copy
        return dict(parts[0]), Layout(rows, ((),))
    if not padding:  # the common case: nothing to pad
        batch = {name: np.concatenate([part[name] for part in parts]) for name in parts[0]}
        return batch, Layout(rows, ((),) * len(parts))
    padded: list[list[tuple[int, int, int]]] = [[] for _ in parts]
    batch = {}
    for name in parts[0]:
        arrays = [part[name] for part in parts]
        pad = padding.get(name)
        if pad is not None:
            target = max(a.shape[pad.axis] for a in arrays)
            for index, array in enumerate(arrays):
                own = array.shape[pad.axis]
                padded[index].append((pad.axis, own, target))
                if own < target:
                    widths = [(0, 0)] * array.ndim
                    widths[pad.axis] = (0, target - own)
                    arrays[index] = np.pad(array, widths, constant_values=pad.value)
        batch[name] = np.concatenate(arrays, axis=0)
    return batch, Layout(rows, tuple(tuple(sorted(set(p))) for p in padded))


def split(outputs: Tensors, layout: Layout) -> list[Tensors]:
    """Each request's slice of the batch outputs; padded axes are cut back to its own length."""
    total = sum(layout.rows)
    for name, array in outputs.items():
        if array.ndim == 0 or array.shape[0] != total:
            got = "a scalar" if array.ndim == 0 else f"{array.shape[0]} rows"
            raise SplitError(f"output '{name}' has {got}; the batch has {total} rows")
    results: list[Tensors] = []
    start = 0
    for rows, padded in zip(layout.rows, layout.padded, strict=True):
        end = start + rows
        if not padded:
            results.append({name: array[start:end] for name, array in outputs.items()})
            start = end
            continue
        part = {}
        for name, array in outputs.items():
            piece = array[start:end]
            for axis, own, target in padded:
                if own < target and piece.ndim > axis and piece.shape[axis] == target:
                    piece = np.take(piece, np.arange(own), axis=axis)
            part[name] = piece
        results.append(part)
        start = end
    return results
