from __future__ import annotations

import numpy as np
import pytest

from converters.errors import ConversionError
from converters.spec import (
    DEFAULT_AXIS_SIZE,
    Axis,
    InputSpec,
    PadRequest,
    check_pads,
    parse_dtype,
    parse_input,
    parse_pad,
    random_feeds,
    unify_axes,
)


def test_parse_input_with_anonymous_fixed_and_named_axes() -> None:
    spec = parse_input("image:FP32:-1,3,32,32")
    assert spec.name == "image"
    assert spec.dtype == np.float32
    assert spec.axes == (Axis(DEFAULT_AXIS_SIZE, "batch"), Axis(3), Axis(32), Axis(32))
    assert spec.batched
    assert spec.datatype == "FP32"
    assert spec.dims() == ["batch", 3, 32, 32]
    assert spec.shape(5) == (5, 3, 32, 32)


def test_parse_input_named_sizes_and_value_range() -> None:
    spec = parse_input("input_ids:int64:batch,sequence=16:0..1000")
    assert spec.dtype == np.int64
    assert spec.axes == (Axis(DEFAULT_AXIS_SIZE, "batch"), Axis(16, "sequence"))
    assert (spec.low, spec.high) == (0.0, 1000.0)
    assert spec.shape(2) == (2, 16)


def test_anonymous_dynamic_axes_after_the_first_get_their_own_names() -> None:
    spec = parse_input("x:FP16:[-1,-1,4]")
    assert [axis.name for axis in spec.axes] == ["batch", "x_1", None]


def test_unbatched_input_keeps_its_first_axis() -> None:
    spec = parse_input("x:FP32:1,4")
    assert not spec.batched
    assert spec.shape(7) == (1, 4)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("x:FP32", "is not NAME:DTYPE:SHAPE"),
        ("1x:FP32:-1,3", "not a valid tensor name"),
        ("x:COMPLEX:-1,3", "unknown or unsupported dtype 'COMPLEX'; allowed: BOOL"),
        ("x:FP32:-1,0", "axis '0' is not a size above 0"),
        ("x:FP32:-1,seq=0", "axis 'seq=0' needs a size above 0"),
        ("x:FP32:", "the shape has no axes"),
        ("x:FP32:-1,3:5..1", "value range '5..1' is not LOW..HIGH"),
        ("x:FP32:-1,3:abc", "value range 'abc'"),
    ],
)
def test_parse_input_errors_say_what_was_wrong(text: str, message: str) -> None:
    with pytest.raises(ConversionError, match=message.replace("(", r"\(").replace(".", r"\.")):
        parse_input(text)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("FP32", np.float32), ("fp16", np.float16), ("float", np.float32), ("INT8", np.int8),
     ("uint8", np.uint8), ("bool", np.bool_), ("double", np.float64)],
)  # fmt: skip
def test_parse_dtype_accepts_v2_and_numpy_names(text: str, expected: type) -> None:
    assert parse_dtype(text) == np.dtype(expected)


def test_parse_dtype_rejects_strings() -> None:
    with pytest.raises(ConversionError, match="unsupported dtype 'BYTES'"):
        parse_dtype("BYTES")


def test_unify_axes_shares_an_explicit_size_across_inputs() -> None:
    a = parse_input("a:FP32:-1,sequence=12")
    b = parse_input("b:FP32:-1,sequence")
    unified = unify_axes([a, b])
    assert [spec.shape(1) for spec in unified] == [(1, 12), (1, 12)]


def test_unify_axes_rejects_two_sizes_for_one_name() -> None:
    with pytest.raises(ConversionError, match="axis 'sequence' is given sizes 12 and 20"):
        unify_axes([parse_input("a:FP32:-1,sequence=12"), parse_input("b:FP32:-1,sequence=20")])


def test_parse_pad() -> None:
    assert parse_pad("input_ids:1:0") == PadRequest("input_ids", 1, 0.0)
    assert parse_pad("x:2:-1.5") == PadRequest("x", 2, -1.5)
    for bad in ("x:0:1", "x:1", "x:a:1", ":1:0"):
        with pytest.raises(ConversionError, match="is not NAME:AXIS:VALUE"):
            parse_pad(bad)


def test_check_pads_needs_a_dynamic_non_batch_axis() -> None:
    specs = [parse_input("ids:INT64:-1,sequence"), parse_input("mask:INT64:-1,16")]
    check_pads([PadRequest("ids", 1, 0)], specs)
    with pytest.raises(ConversionError, match="inputs are ids, mask"):
        check_pads([PadRequest("nope", 1, 0)], specs)
    with pytest.raises(ConversionError, match=r"input 'mask' has shape \['batch', 16\]"):
        check_pads([PadRequest("mask", 1, 0)], specs)
    with pytest.raises(ConversionError, match="only a dynamic axis"):
        check_pads([PadRequest("ids", 2, 0)], specs)


def test_random_feeds_follow_dtype_shape_and_range() -> None:
    specs = [
        parse_input("ids:INT64:-1,sequence=5:3..7"),
        parse_input("mask:BOOL:-1,5"),
        parse_input("x:FP16:-1,2:-1..1"),
        parse_input("z:FP32:-1,3"),
    ]
    feeds = random_feeds(specs, 64, np.random.default_rng(0))
    assert feeds["ids"].shape == (64, 5)
    assert feeds["ids"].dtype == np.int64
    assert feeds["ids"].min() >= 3
    assert feeds["ids"].max() <= 6
    assert feeds["mask"].dtype == np.bool_
    assert 0 < feeds["mask"].mean() < 1
    assert feeds["x"].dtype == np.float16
    assert np.abs(feeds["x"]).max() <= 1
    assert feeds["z"].dtype == np.float32
    assert feeds["z"].std() > 0.5


def test_random_feeds_are_reproducible_for_a_seed() -> None:
    spec = [InputSpec("x", np.dtype(np.float32), (Axis(8, "batch"), Axis(3)))]
    first = random_feeds(spec, 4, np.random.default_rng(5))["x"]
    again = random_feeds(spec, 4, np.random.default_rng(5))["x"]
    np.testing.assert_array_equal(first, again)
