"""JSON `data` to arrays: every datatype, every kind of wrong value, shapes against data, and
Hypothesis checks that the vectorized decoder (`decode_data`, `vectorized_data`, `raw_numbers`)
and the reference element walk agree on every input."""

from __future__ import annotations

import json
import tracemalloc
from typing import Any

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from engine.errors import InvalidInput
from server.http import json_arrays
from server.http.codec import json_data
from server.http.json_arrays import decode_data, raw_numbers, vectorized_data, walk_data
from server.http.json_header import RawData
from tests.models import DATATYPES, NUMERIC_DATATYPES, NUMPY_TYPES, sample


def data_rejected(datatype: str, shape: list[int], data: Any) -> str:
    with pytest.raises(InvalidInput) as caught:
        decode_data("x", datatype, shape, data)
    message = caught.value.message
    assert message.startswith("input 'x'")
    return message


def to_json(array: np.ndarray, datatype: str) -> Any:
    """What a client sends: flat JSON values, through a real JSON encoder and parser."""
    data = json_data(array, datatype)
    return orjson.loads(orjson.dumps(data, option=orjson.OPT_SERIALIZE_NUMPY))


# -- every datatype ---------------------------------------------------------------------------


@pytest.mark.parametrize("datatype", DATATYPES)
def test_decode_every_datatype_flat(datatype: str) -> None:
    array = sample(datatype, (3, 4))
    got = decode_data("x", datatype, [3, 4], to_json(array, datatype))
    assert got.shape == (3, 4)
    assert got.dtype == np.dtype(NUMPY_TYPES[datatype])
    assert got.tolist() == array.tolist()


@pytest.mark.parametrize("datatype", DATATYPES)
def test_decode_every_datatype_nested(datatype: str) -> None:
    array = sample(datatype, (2, 3, 2))
    nested = np.array(to_json(array, datatype), dtype=object).reshape(2, 3, 2).tolist()
    got = decode_data("x", datatype, [2, 3, 2], nested)
    assert got.tolist() == array.tolist()


def test_bytes_are_utf8_encoded() -> None:
    got = decode_data("x", "BYTES", [3], ["a", "héllo", ""])
    assert got.tolist() == [b"a", "héllo".encode(), b""]


def test_ints_are_accepted_for_floating_types() -> None:
    assert decode_data("x", "FP32", [2], [1, 2]).tolist() == [1.0, 2.0]
    assert decode_data("x", "FP16", [1], [3]).dtype == np.float16


def test_scalar_data_and_empty_shape() -> None:
    got = decode_data("x", "INT32", [], 7)
    assert (got.shape, got.tolist()) == ((), 7)


def test_zero_sized_tensor() -> None:
    assert decode_data("x", "FP32", [0, 4], []).shape == (0, 4)


def test_nested_data_is_reshaped_to_the_declared_shape() -> None:
    assert decode_data("x", "INT64", [3, 2], [[1, 2, 3], [4, 5, 6]]).tolist() == [
        [1, 2], [3, 4], [5, 6]
    ]  # fmt: skip


# -- wrong JSON types -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("datatype", "data", "fragment"),
    [
        ("FP32", ["1.0", "2.0"], "text"),
        ("FP32", [1, "a"], "text"),
        ("FP64", [None], "FP64"),
        ("FP32", [{"a": 1}], "FP32"),
        ("FP32", [True, False], "FP32 needs numbers"),
        ("INT32", [1.5, 2.0], "INT32"),
        ("INT32", [True, False], "INT32"),
        ("UINT8", ["1"], "text"),
        ("BOOL", [0, 1], "BOOL needs booleans"),
        ("BOOL", ["true"], "BOOL needs booleans"),
        ("BYTES", ["a", 1], "BYTES data must be strings"),
        ("BYTES", [None], "BYTES data must be strings"),
    ],
)
def test_wrong_json_types_are_rejected(datatype: str, data: Any, fragment: str) -> None:
    assert fragment in data_rejected(datatype, [len(data)], data)


def test_floats_for_an_integer_type_say_integers_are_needed() -> None:
    message = data_rejected("INT32", [2], [1.5, 2.0])
    assert "INT32 needs integers" in message


@pytest.mark.parametrize("datatype", ["INT8", "INT32", "UINT16", "FP32", "FP64"])
def test_booleans_mixed_into_numbers_are_rejected(datatype: str) -> None:
    # np.asarray([True, 2]) is an int array: a stray JSON `true` becomes 1 without this check.
    data_rejected(datatype, [2], [True, 2])


@pytest.mark.parametrize(
    ("datatype", "value", "shown"),
    [
        ("INT8", 128, "128"),
        ("INT8", -129, "-129"),
        ("UINT8", 256, "256"),
        ("UINT8", -1, "-1"),
        ("INT16", 40000, "40000"),
        ("UINT32", 2**32, str(2**32)),
        ("INT32", -(2**31) - 1, str(-(2**31) - 1)),
        ("INT64", 2**63, str(2**63)),
    ],
)
def test_out_of_range_integers_name_value_and_range(datatype: str, value: int, shown: str) -> None:
    message = data_rejected(datatype, [2], [0, value])
    assert f"value {shown} is out of range for {datatype}" in message


@pytest.mark.parametrize(("datatype", "value"), [("UINT64", 2**64), ("INT64", -(2**63) - 1)])
def test_integers_beyond_64_bits_are_rejected(datatype: str, value: int) -> None:
    data_rejected(datatype, [1], [value])
    # As JSON sends them: the parser reads them as doubles, which were called "a fraction".
    message = data_rejected(datatype, [1], orjson.loads(f"[{value}]"))
    info = np.iinfo(datatype.lower())
    # Not the double's digits: 1.84467e+19 reads as less than UINT64's maximum.
    shown = "2^64 or more" if value > 0 else "below -2^63"
    assert message == (
        f"input 'x': value {shown} is out of range for {datatype} ({info.min} to {info.max})"
    )


@pytest.mark.parametrize(("datatype", "value"), [("FP16", 1e6), ("FP32", 1e300)])
def test_floats_beyond_the_type_range_are_rejected(datatype: str, value: float) -> None:
    # Casting would silently give inf (and a RuntimeWarning on the server's stderr).
    data_rejected(datatype, [1], [value])


def test_integer_extremes_are_accepted() -> None:
    assert decode_data("x", "INT8", [2], [-128, 127]).tolist() == [-128, 127]
    assert decode_data("x", "UINT64", [2], [0, 2**64 - 1]).tolist() == [0, 2**64 - 1]
    assert decode_data("x", "INT64", [2], [-(2**63), 2**63 - 1]).tolist() == [-(2**63), 2**63 - 1]


# -- shapes -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("shape", "data", "count", "size"),
    [([2, 2], [1, 2, 3], 4, 3), ([3], [1, 2, 3, 4], 3, 4), ([0], [1], 0, 1), ([], [1, 2], 1, 2)],
)
def test_shape_and_data_count_must_agree(
    shape: list[int], data: list[int], count: int, size: int
) -> None:
    message = data_rejected("FP32", shape, data)
    assert message == f"input 'x': shape {shape} needs {count} values, data has {size}"


def test_bytes_count_mismatch() -> None:
    assert "needs 2 values, data has 3" in data_rejected("BYTES", [2], ["a", "b", "c"])


@pytest.mark.parametrize("data", [[[1, 2], [3]], [[1], [2, 3]], [[[1, 2]], [3, 4]]])
def test_ragged_lists_are_rejected(data: Any) -> None:
    assert "ragged" in data_rejected("FP32", [3], data)


def test_the_largest_zero_sized_shape_decodes() -> None:
    for datatype in ("FP64", "BYTES"):
        assert decode_data("x", datatype, [0, 2**60 - 1], []).shape == (0, 2**60 - 1)


@pytest.mark.parametrize("depth", [63, 64, 65, 66])
def test_decoders_agree_at_the_nesting_limit(depth: int) -> None:
    data: Any = [0.5, 1]
    for _ in range(depth - 1):
        data = [data]
    assert_agree("FP32", [2], data)


def test_data_nested_deeper_than_any_shape_is_invalid_input() -> None:
    data: Any = 1.0
    for _ in range(200):
        data = [data]
    assert "nested deeper than 64 levels" in data_rejected("FP32", [1], data)


# -- the vectorized decoder against the reference walk ------------------------------------------


def outcome(decoder: Any, datatype: str, shape: list[int], data: Any) -> Any:
    """What a decoder makes of `data`: its InvalidInput message, or the array's dtype, shape and
    values, bit for bit (so -0.0 and 0.0, or two roundings of one value, differ)."""
    try:
        array = decoder("x", datatype, shape, data)
    except InvalidInput as exc:
        return exc.message
    values = array.tolist() if array.dtype == object else array.tobytes()
    return array.dtype, array.shape, values


def as_raw(data: Any) -> tuple[RawData, Any] | None:
    """`data` as a large body's `data` value still unparsed (its JSON text inside a body), with
    what orjson parses that text to (big integers become floats); None if orjson cannot."""
    text = json.dumps(data).encode()
    try:
        parsed = orjson.loads(text)
    except orjson.JSONDecodeError:
        return None
    head = b'{"inputs": [{"data": '
    return RawData(head + text + b"}]}", len(head), len(head) + len(text)), parsed


def assert_vouched(fast: np.ndarray | None, expected: Any) -> None:
    """A fast path vouches only for what the walk accepts, and decodes it as the walk does."""
    if fast is not None:
        assert not isinstance(expected, str), expected
        assert (fast.dtype, fast.shape, fast.tobytes()) == expected


def assert_agree(datatype: str, shape: list[int], data: Any) -> None:
    expected = outcome(walk_data, datatype, shape, data)
    assert outcome(decode_data, datatype, shape, data) == expected
    if isinstance(data, list):
        assert_vouched(vectorized_data(datatype, shape, data), expected)
    raw = as_raw(data)
    if raw is not None:  # the same data still in the body's text (RawData.numbers)
        expected = outcome(walk_data, datatype, shape, raw[1])
        assert outcome(decode_data, datatype, shape, raw[0]) == expected
        assert_vouched(raw_numbers(datatype, shape, raw[0]), expected)


# Values that numpy reads as numbers of some kind but the walk may refuse, or that sit at a range
# or rounding boundary: each is dropped into otherwise valid data.
POISON: list[Any] = [
    True,
    False,
    None,
    "1",
    "a",
    {},
    [],
    [1],
    0,
    1,
    -1,
    0.0,
    1.0,
    -0.0,
    1.5,
    70000,
    1e300,
    2**31,
    2**53 + 1,
    2**54 + 2**30 + 1,
    2**63,
    2**64 - 1,
    -(2**63) - 1,
    2**64,
    65520.0,
]


def _array_for(datatype: str) -> st.SearchStrategy[np.ndarray]:
    dtype = np.dtype(NUMPY_TYPES[datatype])
    elements = None
    if dtype.kind == "f":
        width = {2: 16, 4: 32, 8: 64}[dtype.itemsize]
        elements = st.floats(allow_nan=False, allow_infinity=False, width=width)  # type: ignore[arg-type]
    shapes = st.one_of(
        hnp.array_shapes(min_dims=1, max_dims=3, min_side=0, max_side=6),
        # past _SCAN_BELOW, flat and nested
        st.tuples(st.integers(128, 400)),
        st.tuples(st.integers(64, 150), st.integers(1, 3)),
    )
    return hnp.arrays(dtype, shapes, elements=elements)


def _poison(data: Any, position: int, value: Any) -> Any:
    """`data` (nested lists) with its value at flat `position` replaced by `value`."""
    if not isinstance(data, list) or not data:
        return data
    if not isinstance(data[0], list):
        return [*data[:position], value, *data[position + 1 :]] if position < len(data) else data
    width = max(1, int(np.prod(np.shape(data[0]))))
    row, rest = divmod(position, width)
    if row >= len(data):
        return data
    return [*data[:row], _poison(data[row], rest, value), *data[row + 1 :]]


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(NUMERIC_DATATYPES).flatmap(_array_for), st.data())
def test_vectorized_decoder_agrees_with_the_walk(array: np.ndarray, draw: st.DataObject) -> None:
    # Valid data of one datatype, sent as another, nested or flat, under its own shape or one
    # that does not fit, with one value poisoned or none.
    datatype = draw.draw(st.sampled_from(NUMERIC_DATATYPES))
    data = array.tolist() if draw.draw(st.booleans()) else array.ravel().tolist()
    if draw.draw(st.booleans()):
        data = _poison(
            data, draw.draw(st.integers(0, array.size)), draw.draw(st.sampled_from(POISON))
        )
    shape = draw.draw(st.sampled_from([list(array.shape), [array.size], [array.size + 1]]))
    assert_agree(datatype, shape, data)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(NUMERIC_DATATYPES).flatmap(_array_for), st.data())
def test_a_bool_anywhere_is_refused_by_both(array: np.ndarray, draw: st.DataObject) -> None:
    datatype = draw.draw(st.sampled_from(NUMERIC_DATATYPES))
    data = array.tolist() if draw.draw(st.booleans()) else array.ravel().tolist()
    data = _poison(
        data, draw.draw(st.integers(0, max(0, array.size - 1))), draw.draw(st.booleans())
    )
    assert_agree(datatype, list(array.shape), data)


_JSON = st.recursive(
    st.one_of(
        st.integers(-(2**65), 2**65), st.floats(allow_nan=False, allow_infinity=False),
        st.booleans(), st.none(), st.text(max_size=3), st.sampled_from(POISON),
    ),
    lambda children: st.lists(children, max_size=4),
    max_leaves=24,
)  # fmt: skip


# Nested numbers only, ragged or not: valid values in every shape of list.
_NESTED_NUMBERS = st.recursive(
    st.one_of(st.integers(-3, 3), st.floats(-2, 2)),
    lambda children: st.lists(children, max_size=3),
    max_leaves=12,
)


def _leaves(data: Any) -> int:
    return sum(map(_leaves, data)) if isinstance(data, list) else 1


@settings(max_examples=400, deadline=None)
@given(
    st.sampled_from(DATATYPES),
    st.one_of(_JSON, _NESTED_NUMBERS),
    st.one_of(st.lists(st.integers(0, 4), max_size=3), st.sampled_from(["own", "leaves"])),
)
def test_decoders_agree_on_any_json(datatype: str, data: Any, shape: list[int] | str) -> None:
    if shape == "own":  # the data's shape, where numpy sees one
        shape = list(np.shape(np.array(data, dtype=object))) if isinstance(data, list) else []
    elif shape == "leaves":  # as many values as the data holds, ragged or not
        shape = [_leaves(data)]
    assert isinstance(shape, list)
    assert_agree(datatype, shape, data)


@pytest.mark.parametrize(
    ("datatype", "shape", "data"),
    [
        ("FP32", [4], [0.5, -1.25, 3.0, 7.5]),
        ("FP32", [2, 2], [[0.5, -1.25], [3, 7.5]]),
        ("FP32", [1, 3], [0.0, 1.0, 1]),  # zeros and ones that are numbers, not bools
        ("FP32", [300], [1.0] * 300),
        ("FP16", [2], [65504.0, -65504]),
        ("FP64", [2, 1, 2], [[[1e300], [-1e-300]], [[0.0], [2**60]]]),
        ("INT64", [3], [-(2**63), 0, 2**63 - 1]),
        ("UINT64", [2], [2**63, 2**64 - 1]),
        ("INT8", [2, 2], [[-128, 127], [0, 1]]),
        ("UINT8", [200], [0, 1, 255, 7] * 50),
        ("FP32", [0, 3], []),
        ("INT32", [2, 0], [[], []]),
    ],
)
def test_the_fast_path_vouches_for_valid_data(datatype: str, shape: list[int], data: Any) -> None:
    walked = walk_data("x", datatype, shape, data)
    raw = as_raw(data)
    assert raw is not None
    for fast in (vectorized_data(datatype, shape, data), raw_numbers(datatype, shape, raw[0])):
        assert fast is not None
        assert fast.flags.writeable
        assert (fast.dtype, fast.shape, fast.tobytes()) == (
            walked.dtype,
            walked.shape,
            walked.tobytes(),
        )


@pytest.mark.parametrize(
    ("datatype", "data"),
    [
        (
            "FP32",
            [0.5] * 150 + [True] + [0.5] * 150,
        ),  # past _SCAN_BELOW: only 0s and 1s are looked at
        ("FP32", [1.0] * 150 + [True]),
        ("INT32", [1] * 500 + [False]),
        ("FP32", [[0.5, 1.0]] * 100 + [[0.5, True]]),
        ("INT64", [[0, 1]] * 100 + [[True, 1]]),
    ],
)
def test_a_bool_among_many_numbers_is_refused(datatype: str, data: list[Any]) -> None:
    shape = list(np.shape(data))
    assert vectorized_data(datatype, shape, data) is None
    assert "data holds a boolean" in data_rejected(datatype, shape, data)


def test_ints_are_rounded_to_floats_as_python_casts_them() -> None:
    # Through a double first: int64 -> float32 directly would round this up to 2**54 + 2**31.
    value = 2**54 + 2**30 + 1
    assert decode_data("x", "FP32", [1], [value]).tolist() == [float(2**54)]
    assert decode_data("x", "FP32", [2], [value, 0.5]).tolist() == [float(2**54), 0.5]


def test_text_among_numbers_costs_no_memory_beyond_the_data() -> None:
    # numpy's own type discovery would make this a text array: 5,001 values of 20,000
    # characters, 400 MB from a 120 kB body.
    data = ["x" * 20_000] + [0.5] * 5_000
    tracemalloc.start()
    try:
        message = data_rejected("FP32", [len(data)], data)
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert message.startswith("input 'x': data holds text; datatype FP32 needs numbers")
    assert peak_bytes < 10_000_000


@pytest.mark.parametrize(
    ("datatype", "data"),
    [
        ("FP32", [0.5, -1.25, 3, 7.5]),
        ("FP64", [1e300, -(2**60), 0.0]),
        ("INT64", [-(2**63), 0, 2**63 - 1]),
        ("UINT64", [2**64 - 1, 0, 1]),
        ("FP32", [0.5, "x", 1.0]),
        ("FP32", [0.5, None, 1.0]),
        ("INT32", [1, 2.5, 3]),
        ("INT64", [1, 2**63, 3]),
        ("UINT64", [1, -1, 3]),
        ("FP32", [1.0, True, 0.0]),
    ],
)
@pytest.mark.parametrize("struct_values", [1 << 16, 2])
def test_both_readers_of_the_values_agree_with_the_walk(
    datatype: str, data: list[Any], struct_values: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # struct reads up to STRUCT_VALUES values, array.array the longer lists: both refuse what
    # the walk refuses, and the walk names the problem.
    monkeypatch.setattr(json_arrays, "STRUCT_VALUES", struct_values)
    assert_agree(datatype, [len(data)], data)
