"""The raw tensor layout that HTTP's binary tensor data extension (server/http/binary.py) and gRPC's
`raw_input_contents` / `raw_output_contents` (server/grpc/tensors.py) share, and where decoding
and encoding run.

Fixed-size tensors are their little-endian elements in row-major order; a buffer becomes a
read-only `np.frombuffer` view (no copy) once its size matches the shape and datatype. BYTES
tensors are each element as a 4-byte little-endian length followed by its bytes. A buffer that
disagrees with its shape is InvalidInput naming the input, what was received and what the shape
needs. Everything here is synchronous; `off_loop` runs work on more than OFFLOAD_BYTES in a
worker thread so the event loop keeps serving.
"""

from __future__ import annotations

import asyncio
import math
import struct
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from engine.datatypes import ALLOWED, NUMPY_DTYPES, check_shape
from engine.errors import InvalidInput

T = TypeVar("T")

OFFLOAD_BYTES = 256 * 1024
"""Bodies and responses larger than this are decoded / encoded off the event loop."""

_LENGTH = struct.Struct("<I")
_WIRE = {name: dtype.newbyteorder("<") for name, dtype in NUMPY_DTYPES.items()}
"""Each datatype's numpy dtype in the wire's byte order (made once: a dtype per call costs)."""


def fixed_bytes(datatype: str, shape: tuple[int, ...]) -> int | None:
    """The bytes a tensor of a fixed-size `datatype` and `shape` takes in the raw layout; None
    for BYTES (each element's length is in the data)."""
    dtype = _WIRE.get(datatype)
    if dtype is None or datatype == "BYTES":
        return None
    return math.prod(shape) * dtype.itemsize


async def off_loop(size: int, func: Callable[..., T], *args: Any) -> T:
    """`func(*args)`, in a worker thread when `size` bytes are involved past OFFLOAD_BYTES."""
    return await asyncio.to_thread(func, *args) if size > OFFLOAD_BYTES else func(*args)


def tensor_from_buffer(
    buffer: memoryview,
    datatype: str,
    shape: tuple[int, ...],
    name: str,
    *,
    shape_checked: bool = False,
) -> np.ndarray:
    """The tensor held by `buffer` in the raw layout; fixed-size types are zero-copy views.
    `shape_checked`: the caller ran engine.datatypes.check_shape on `shape` already (it must,
    so numpy's reshape cannot fail)."""
    dtype = _WIRE.get(datatype)
    if dtype is None:
        raise InvalidInput(f"input '{name}': unknown datatype '{datatype}'; allowed: {ALLOWED}")
    if not shape_checked:
        shape = check_shape(name, shape)
    count = math.prod(shape)
    if datatype == "BYTES":
        return decode_bytes(buffer, count, name).reshape(shape)
    expected = count * dtype.itemsize
    if len(buffer) != expected:
        raise InvalidInput(
            f"input '{name}' has shape {list(shape)} of {datatype}, which is {expected} bytes; "
            f"received {len(buffer)} bytes"
        )
    if datatype == "BOOL" and count and np.frombuffer(buffer, np.uint8).max() > 1:
        raise InvalidInput(f"input '{name}' is BOOL but holds bytes other than 0 and 1")
    return np.frombuffer(buffer, dtype).reshape(shape)


def decode_bytes(buffer: memoryview, count: int, name: str) -> np.ndarray:
    """`count` length-prefixed elements as a 1-D object array of bytes; the buffer must hold
    exactly those elements."""
    size = len(buffer)
    if count > size:  # before allocating: each element takes 4 bytes at least, so a shape this
        # large cannot fit, and must not cost memory (past this check, count <= body size)
        raise InvalidInput(
            f"input '{name}': {count} BYTES elements need at least {count * 4} bytes "
            f"(a 4-byte length each); received {size}"
        )
    out = np.empty(count, dtype=object)
    offset = 0
    for index in range(count):
        if offset + 4 > size:
            raise InvalidInput(
                f"input '{name}': BYTES data ends at byte {size} before element {index} of "
                f"{count} (each element is a 4-byte length and its bytes)"
            )
        (length,) = _LENGTH.unpack_from(buffer, offset)
        offset += 4
        if offset + length > size:
            raise InvalidInput(
                f"input '{name}': BYTES element {index} declares {length} bytes; "
                f"only {size - offset} remain"
            )
        out[index] = bytes(buffer[offset : offset + length])
        offset += length
    if offset != size:
        raise InvalidInput(
            f"input '{name}': {size - offset} bytes left over after the {count} BYTES elements "
            "its shape holds"
        )
    return out


def encode_bytes(array: np.ndarray) -> bytes:
    """A BYTES tensor (object array of bytes or str) in the length-prefixed layout."""
    parts: list[bytes] = []
    for item in array.reshape(-1):
        data = item.encode() if isinstance(item, str) else bytes(item)
        parts += (_LENGTH.pack(len(data)), data)
    return b"".join(parts)


def tensor_buffer(array: np.ndarray, datatype: str) -> bytes | memoryview:
    """The tensor in the raw layout; fixed-size types avoid a copy when already contiguous."""
    if datatype == "BYTES":
        return encode_bytes(array)
    dtype = _WIRE.get(datatype)
    if dtype is None:
        raise InvalidInput(f"unknown datatype '{datatype}'; allowed: {ALLOWED}")
    flat = np.ascontiguousarray(array, dtype=dtype).reshape(-1)
    return flat.view(np.uint8).data
