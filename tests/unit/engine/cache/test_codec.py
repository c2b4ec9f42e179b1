from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from engine.cache.codec import DATATYPE_CODES, MAGIC, CorruptEntry, decode, encode
from engine.cache.contract import CachedResult
from engine.datatypes import NUMPY_DTYPES


@st.composite
def outputs(draw: st.DrawFn) -> CachedResult:
    names = draw(st.lists(st.text(max_size=8), min_size=0, max_size=4, unique=True))
    arrays: dict[str, np.ndarray] = {}
    datatypes: dict[str, str] = {}
    for name in names:
        datatype = draw(st.sampled_from(list(NUMPY_DTYPES)))
        shape = draw(hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5))
        if datatype == "BYTES":
            size = int(np.prod(shape))
            items = draw(st.lists(st.binary(max_size=10), min_size=size, max_size=size))
            flat = np.empty(size, dtype=object)
            flat[:] = items
            arrays[name] = flat.reshape(shape)
        else:
            order = draw(st.sampled_from(["<", ">"]))
            dtype = NUMPY_DTYPES[datatype].newbyteorder(order)
            arrays[name] = draw(hnp.arrays(dtype, shape))
        datatypes[name] = datatype
    return CachedResult(arrays, datatypes)


def assert_same(decoded: CachedResult, original: CachedResult) -> None:
    assert dict(decoded.datatypes) == dict(original.datatypes)
    assert list(decoded.outputs) == list(original.outputs)
    for name, array in original.outputs.items():
        got = decoded.outputs[name]
        assert got.shape == array.shape
        assert got.flags.writeable is False
        if original.datatypes[name] == "BYTES":
            assert got.dtype == np.dtype(object)
            assert got.tolist() == array.tolist()
        else:
            assert got.dtype == NUMPY_DTYPES[original.datatypes[name]]
            # Byte-exact equality (NaN payloads and -0.0 included), independent of byte order.
            assert got.tobytes() == array.astype(got.dtype).tobytes()


@settings(max_examples=200, deadline=None)
@given(outputs())
def test_round_trip_over_every_datatype(result: CachedResult) -> None:
    data = encode(result)
    assert data.startswith(MAGIC)
    assert_same(decode(data), result)


@settings(max_examples=60, deadline=None)
@given(outputs(), st.data())
def test_any_truncation_or_single_byte_change_is_corrupt(
    result: CachedResult, data: st.DataObject
) -> None:
    encoded = encode(result)
    cut = data.draw(st.integers(min_value=0, max_value=len(encoded) - 1))
    with pytest.raises(CorruptEntry):
        decode(encoded[:cut])
    index = data.draw(st.integers(min_value=0, max_value=len(encoded) - 1))
    flip = data.draw(st.integers(min_value=1, max_value=255))
    altered = bytearray(encoded)
    altered[index] ^= flip
    with pytest.raises(CorruptEntry):
        decode(bytes(altered))


@pytest.mark.parametrize(
    "data",
    [b"", b"SLCR", b"\x80\x04pickle" * 3, b"SLCR\x02\x00\x00\x00\x00\x00\x00\x00"],
    ids=["empty", "magic only", "foreign", "future format"],
)
def test_foreign_values_are_corrupt(data: bytes) -> None:
    with pytest.raises(CorruptEntry):
        decode(data)


def test_trailing_bytes_are_corrupt_even_with_a_matching_checksum() -> None:
    encoded = encode(CachedResult({"y": np.arange(3, dtype=np.int32)}, {"y": "INT32"}))
    forged = _with_checksum(encoded + bytes(8))
    with pytest.raises(CorruptEntry, match="unexpected bytes"):
        decode(forged)


def test_lying_shape_is_corrupt_even_with_a_matching_checksum() -> None:
    encoded = bytearray(encode(CachedResult({"y": np.arange(4, dtype=np.int32)}, {"y": "INT32"})))
    # Header (12) + name_len (2) + name (1) + code/ndim (2) -> the first dim.
    struct.pack_into("<Q", encoded, 17, 5)
    with pytest.raises(CorruptEntry, match=r"INT32 tensor of shape \[5\] cannot hold 16 bytes"):
        decode(_with_checksum(bytes(encoded)))


def test_layout_is_header_then_aligned_raw_little_endian_arrays() -> None:
    array = np.array([1.5, -2.0], dtype=">f8")  # big-endian input is stored little-endian
    encoded = encode(CachedResult({"y": array}, {"y": "FP64"}))
    magic, version, flags, count = struct.unpack_from("<4sBBH", encoded)
    assert (magic, version, flags, count) == (MAGIC, 1, 0, 1)
    assert encoded[12:15] == b"\x01\x00y"
    assert encoded[15:17] == bytes([DATATYPE_CODES["FP64"], 1])
    assert struct.unpack_from("<QQ", encoded, 17) == (2, 16)
    assert encoded[-16:] == np.array([1.5, -2.0], dtype="<f8").tobytes()
    assert (len(encoded) - 16) % 8 == 0


def test_bytes_tensors_are_length_prefixed() -> None:
    items = np.array([b"ab", b"", b"\x00c"], dtype=object)
    encoded = encode(CachedResult({"s": items}, {"s": "BYTES"}))
    payload = b"\x02\x00\x00\x00ab" + b"\x00\x00\x00\x00" + b"\x02\x00\x00\x00\x00c"
    assert len(payload) == 16  # already a multiple of 8: no padding
    assert encoded.endswith(payload)
    assert decode(encoded).outputs["s"].tolist() == [b"ab", b"", b"\x00c"]


def test_decoded_arrays_cannot_be_made_writeable() -> None:
    encoded = encode(
        CachedResult(
            {"y": np.ones(3, np.float32), "s": np.array([b"a"], dtype=object)},
            {"y": "FP32", "s": "BYTES"},
        )
    )
    for array in decode(encoded).outputs.values():
        with pytest.raises(ValueError, match=r"read-only|WRITEABLE"):
            array[...] = array
        with pytest.raises(ValueError, match="WRITEABLE"):
            array.setflags(write=True)


def _with_checksum(data: bytes) -> bytes:
    import zlib

    crc = zlib.crc32(data[12:], zlib.crc32(data[:8]))
    return data[:8] + struct.pack("<I", crc) + data[12:]
