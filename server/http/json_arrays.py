"""JSON `data` of the Open Inference Protocol as numpy arrays: the vectorized decoder
(`decode_data`, over `raw_numbers` and `vectorized_data`) and the reference walk (`walk_data`) it
is tested against and falls back to.

Apart from `codec`, which reads and writes whole requests and responses, because this is one
concern with its own invariant: every path here makes the same array, or the same InvalidInput,
as the walk (Hypothesis holds them to it), and its speed is measured on its own (`json_cost`'s
decode columns)."""

from __future__ import annotations

import array
import functools
import itertools
import math
import struct
from typing import Any

import numpy as np

from engine import datatypes
from engine.errors import InvalidInput
from server.http.json_header import NumberKind, RawData

# Which numpy kinds a JSON array may decode to for each family of datatypes.
TYPES: dict[str, set[type]] = {"b": {bool}, "u": {int}, "i": {int}, "f": {int, float}}
_KIND_NAMES = {str: "text", bool: "a boolean", float: "a fraction", int: "an integer",
               dict: "an object", type(None): "null"}  # fmt: skip
_NEEDS = {"b": "booleans", "u": "integers", "i": "integers", "f": "numbers"}
_KIND_DTYPES = {"d": np.dtype(np.float64), "i": np.dtype(np.int64), "u": np.dtype(np.uint64)}
"""The numpy dtype of each kind of C number RawData.numbers reads."""
_FLOAT_MAX = {size: float(np.finfo(f"f{size}").max) for size in (2, 4, 8)}
"""The largest finite value of each float width, by its size in bytes."""


def decode_data(name: str, datatype: str, shape: list[int], data: Any) -> np.ndarray:
    """A JSON `data` field (flat or nested, or RawData still to parse) as an array of `shape`;
    every value is type- and range-checked, so nothing is silently coerced (no bools as
    numbers, no overflow to inf).

    The same array, or the same InvalidInput, as `walk_data`, without a Python step per value
    (`vectorized_data`); data those checks cannot vouch for is handed to `walk_data`, which
    names the problem."""
    if isinstance(data, RawData):
        decoded = raw_numbers(datatype, shape, data)
        if decoded is not None:
            return decoded
        data = data.parse()
    decoded = vectorized_data(datatype, shape, data) if isinstance(data, list) else None
    return walk_data(name, datatype, shape, data) if decoded is None else decoded


def raw_numbers(datatype: str, shape: list[int], data: RawData) -> np.ndarray | None:
    """Numeric `data` still in the body's text as `walk_data` decodes it, read straight into C
    numbers (RawData.numbers), or None when only the parsed values can say."""
    target = datatypes.NUMPY_DTYPES.get(datatype)
    if target is None or target.kind not in "iuf":
        return None
    kind: NumberKind = "d" if target.kind == "f" else "u" if target == np.uint64 else "i"
    buffer = data.numbers(kind)
    if buffer is None:
        return None
    values = np.frombuffer(buffer, dtype=_KIND_DTYPES[kind])
    return _narrowed(values, target, shape) if values.size == math.prod(shape) else None


def vectorized_data(datatype: str, shape: list[int], data: list[Any]) -> np.ndarray | None:
    """Numeric `data` as `walk_data` decodes it, or None when only `walk_data` can say.

    Nested lists are checked and flattened a level at a time. The values are read into C 64-bit
    numbers by `struct` (`_packed`), which refuses text, null, objects and lists (and fractions,
    for an integer datatype) and numbers that do not fit. It takes bools as 1 and 0, so only the
    values read as 0 or 1 are looked at again. Ranges and the overflow of a cast to a narrower
    float are checked on the numpy array. BOOL data is left to the walk."""
    target = datatypes.NUMPY_DTYPES.get(datatype)
    if target is None or target.kind not in "iuf":
        return None
    flat = _flat_values(data)
    if flat is None or len(flat) != math.prod(shape):
        return None
    code = "d" if target.kind == "f" else "Q" if target == np.uint64 else "q"
    try:
        values = np.frombuffer(_packed(code, flat), dtype=code)
    except (TypeError, OverflowError, struct.error):
        return None
    if _holds_bool(flat, values):
        return None
    return _narrowed(values, target, shape)


def _narrowed(values: np.ndarray, target: np.dtype[Any], shape: list[int]) -> np.ndarray | None:
    """64-bit `values` cast to `target` in `shape`, or None when one does not fit it."""
    if target.kind in "iu":
        info = np.iinfo(target.str)
        if values.size and (values.min() < info.min or values.max() > info.max):
            return None
        return values.astype(target).reshape(shape)
    # One check covers NaN, inf and a double too large for a narrower type, before the cast, so
    # the cast cannot overflow (numpy's errstate, to silence it, costs more than this check). A
    # NaN is the max (and the min): no comparison holds for it. Two reductions, no abs() array.
    bound = _FLOAT_MAX[target.itemsize]
    if values.size and not (values.max() <= bound and values.min() >= -bound):
        return None
    return values.astype(target).reshape(shape)


STRUCT_VALUES = 1 << 16
"""Up to this many values are read by one `struct.pack` call, past it by `array.array`."""


def _packed(code: str, flat: list[Any]) -> bytes | array.array[Any]:
    """`flat` as C numbers of type `code` ("d", "q" or "Q"). struct reads the values faster than
    array.array, which parses each one as a call's argument (`json_cost`'s `decode_data` column
    for the CNN's 12,288 values: 143 µs with array, the run before struct; 68-72 µs since), but
    it takes the values as the call's arguments: past STRUCT_VALUES, array."""
    if len(flat) > STRUCT_VALUES:
        return array.array(code, flat)
    return _struct(code, len(flat)).pack(*flat)


@functools.lru_cache(maxsize=256)
def _struct(code: str, count: int) -> struct.Struct:
    return struct.Struct(f"={count}{code}")


def _flat_values(data: list[Any]) -> list[Any] | None:
    """The values of regularly nested lists in row-major order; None when the lists at one
    depth differ in length or mix with values, or nest deeper than any shape."""
    items = data
    for _ in range(datatypes.MAX_DIMS):
        if not items or type(items[0]) is not list:
            return items  # a list among these values is refused by array.array
        if set(map(type, items)) != {list} or len(set(map(len, items))) != 1:
            return None
        items = list(itertools.chain.from_iterable(items))
    return None


_SCAN_BELOW = 128
"""Fewer values than this are scanned for bools one by one: cheaper than numpy's calls."""


def _holds_bool(flat: list[Any], values: np.ndarray) -> bool:
    """Whether a JSON `true` or `false` is among the values, read as 1 and 0 in `values`."""
    if len(flat) < _SCAN_BELOW:
        return bool in set(map(type, flat))
    suspects = np.flatnonzero((values == 0) | (values == 1)).tolist()
    return bool in set(map(type, map(flat.__getitem__, suspects)))


def walk_data(name: str, datatype: str, shape: list[int], data: Any) -> np.ndarray:
    """`decode_data` by a walk over every value in Python: the reference that `decode_data` is
    tested against, and the decoder of the data its checks cannot vouch for, whose InvalidInput
    names the problem (the first value of a wrong kind or out of range, the raggedness, the
    count against the shape)."""
    where = f"input '{name}'"
    flat = _flatten(where, data) if isinstance(data, list) else [data]
    count = math.prod(shape)
    if len(flat) != count:
        raise InvalidInput(f"{where}: shape {shape} needs {count} values, data has {len(flat)}")
    if datatype == "BYTES":
        if not all(isinstance(v, str) for v in flat):
            bad = next(v for v in flat if not isinstance(v, str))
            raise InvalidInput(f"{where}: BYTES data must be strings, got {bad!r:.40}")
        array = np.empty(count, dtype=object)
        array[:] = [v.encode("utf-8") for v in flat]
    else:
        array = _numbers(where, datatype, flat)
    return array.reshape(shape)


def _numbers(where: str, datatype: str, flat: list[Any]) -> np.ndarray:
    target = datatypes.numpy_dtype(datatype)
    allowed = TYPES[target.kind]
    if not set(map(type, flat)) <= allowed:
        bad = next(v for v in flat if type(v) not in allowed)
        if target.kind in "iu" and datatypes.past_64_bits(bad):  # out of range, not a fraction
            info = np.iinfo(target.str)
            raise InvalidInput(
                f"{where}: value {datatypes.shown(bad)} is out of range for {datatype} "
                f"({info.min} to {info.max})"
            )
        raise InvalidInput(
            f"{where}: data holds {_KIND_NAMES.get(type(bad), type(bad).__name__)}; datatype "
            f"{datatype} needs {_NEEDS[target.kind]} (got {bad!r:.40})"
        )
    try:
        if target.kind == "f" and target.itemsize < 8:  # a double may not fit: inf, checked below
            with np.errstate(over="ignore"):
                array = np.array(flat, dtype=target)
        else:
            array = np.array(flat, dtype=target)
    except OverflowError:
        info = np.iinfo(target.str)
        bad = next(v for v in flat if not info.min <= v <= info.max)
        raise InvalidInput(
            f"{where}: value {bad} is out of range for {datatype} ({info.min} to {info.max})"
        ) from None
    # JSON has no inf or NaN, so a non-finite value here is an overflow of the cast.
    if target.kind == "f" and array.size and not np.isfinite(array).all():
        bad = flat[int(np.flatnonzero(~np.isfinite(array))[0])]
        limit = float(np.finfo(target.str).max)
        raise InvalidInput(
            f"{where}: value {bad} is out of range for {datatype} (magnitude at most {limit:.6g})"
        )
    return array


def _flatten(where: str, data: list[Any], depth: int = 0) -> list[Any]:
    """Nested lists flattened in row-major order; InvalidInput if they are ragged (lists of
    different lengths, or lists and values mixed, at one depth) or deeper than any shape."""
    if depth > datatypes.MAX_DIMS:
        raise InvalidInput(f"{where}: data is nested deeper than {datatypes.MAX_DIMS} levels")
    if not data or not isinstance(data[0], list):
        if list in set(map(type, data)):
            raise InvalidInput(f"{where}: data is a ragged nested list")
        return data
    out: list[Any] = []
    for item in data:
        if not isinstance(item, list) or len(item) != len(data[0]):
            raise InvalidInput(f"{where}: data is a ragged nested list")
        out.extend(_flatten(where, item, depth + 1))
    return out
