"""The raw tensor layout shared by HTTP binary data and gRPC raw contents."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.errors import InvalidInput
from server import raw_tensors


def test_bytes_tensor_layout_is_length_prefixed() -> None:
    array = np.array([b"ab", b"", "é"], dtype=object)
    encoded = raw_tensors.encode_bytes(array)
    assert encoded == b"\x02\x00\x00\x00ab\x00\x00\x00\x00\x02\x00\x00\x00\xc3\xa9"
    decoded = raw_tensors.decode_bytes(memoryview(encoded), 3, "x")
    assert list(decoded) == [b"ab", b"", "é".encode()]


@given(st.lists(st.binary(max_size=40), max_size=20))
def test_bytes_layout_round_trip(items: list[bytes]) -> None:
    array = np.empty(len(items), dtype=object)
    array[:] = items
    encoded = raw_tensors.encode_bytes(array)
    assert len(encoded) == sum(4 + len(item) for item in items)
    assert list(raw_tensors.decode_bytes(memoryview(encoded), len(items), "x")) == items


def test_a_huge_bytes_shape_is_refused_before_any_allocation() -> None:
    with pytest.raises(InvalidInput, match="1099511627776 BYTES elements need at least"):
        raw_tensors.decode_bytes(memoryview(b""), 2**40, "x")


@pytest.mark.parametrize("datatype", ["FP64", "INT8", "BYTES"])
def test_zero_sized_shapes_too_large_for_numpy_are_invalid_input(datatype: str) -> None:
    with pytest.raises(InvalidInput, match=r"input 'x': shape \[0, 2305843009213693952\] "):
        raw_tensors.tensor_from_buffer(memoryview(b""), datatype, (0, 2**61), "x")


def test_a_fixed_size_buffer_is_a_zero_copy_view_and_round_trips() -> None:
    array = np.arange(6, dtype=np.float32).reshape(2, 3)
    body = bytes(raw_tensors.tensor_buffer(array, "FP32"))  # as a request body holds it
    decoded = raw_tensors.tensor_from_buffer(memoryview(body), "FP32", (2, 3), "x")
    assert np.array_equal(decoded, array)
    assert not decoded.flags.writeable
    assert np.shares_memory(decoded, np.frombuffer(body, np.uint8))


def test_a_buffer_of_the_wrong_size_names_the_input_shape_and_sizes() -> None:
    with pytest.raises(InvalidInput) as caught:
        raw_tensors.tensor_from_buffer(memoryview(b"\0" * 20), "FP32", (2, 3), "x")
    assert caught.value.message == (
        "input 'x' has shape [2, 3] of FP32, which is 24 bytes; received 20 bytes"
    )


def test_bool_holds_only_zero_and_one() -> None:
    with pytest.raises(InvalidInput, match="input 'b' is BOOL but holds bytes other than 0 and 1"):
        raw_tensors.tensor_from_buffer(memoryview(b"\x00\x02"), "BOOL", (2,), "b")


async def test_off_loop_runs_large_work_in_a_worker_thread_only() -> None:
    loop_thread = threading.get_ident()
    small = await raw_tensors.off_loop(raw_tensors.OFFLOAD_BYTES, threading.get_ident)
    large = await raw_tensors.off_loop(raw_tensors.OFFLOAD_BYTES + 1, threading.get_ident)
    assert small == loop_thread
    assert large != loop_thread
