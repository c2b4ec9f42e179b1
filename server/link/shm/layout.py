"""How tensors lie in a slot: back to back, each at a 64-byte aligned offset, a numeric tensor as
its C-contiguous bytes and a BYTES tensor in Triton's length-prefixed layout; `write_tensors`
writes them once, and `view_tensors` checks the descriptors a peer sent and views the tensors
in place."""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Mapping

import numpy as np

from engine.datatypes import MAX_DIMS

ALIGN = 64
"""Every tensor starts at a multiple of this many bytes (cache lines; SIMD loads)."""

NUMERIC_KINDS = frozenset("biuf")
"""dtype kinds a descriptor may name: bool, signed and unsigned ints, floats."""

_LENGTH = struct.Struct("<I")

Buffer = memoryview | bytearray | ctypes.Array[ctypes.c_char]


def aligned(nbytes: int) -> int:
    """`nbytes` rounded up to a multiple of ALIGN."""
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


Descriptor = list[object]
"""Where one tensor lies inside a slot, as it travels in a control frame:
`[name, dtype, shape, offset, nbytes]`, `dtype` a numpy dtype string ("<f4") or "BYTES" for
Triton's length-prefixed layout, `offset` relative to the slot's start. A plain list, built and
read in place: a NamedTuple and its conversions cost ~2 µs per tensor on each side."""


def _bytes_layout(array: np.ndarray) -> list[bytes]:
    parts: list[bytes] = []
    for item in array.reshape(-1):
        data = item if isinstance(item, bytes) else str(item).encode()
        parts += (_LENGTH.pack(len(data)), data)
    return parts


def slot_bytes(arrays: Mapping[str, np.ndarray]) -> int:
    """The size of a slot holding `arrays` (aligned offsets included)."""
    total = 0
    for array in arrays.values():
        if array.dtype.kind == "O":
            total += aligned(sum(4 + len(b) for b in _bytes_layout(array)[1::2]))
        else:
            total += (array.nbytes + ALIGN - 1) // ALIGN * ALIGN  # aligned, without its call
    return total


SMALL_COPY_BYTES = 8 << 10
"""Tensors up to this size are copied as `tobytes()`: a second copy of a few kilobytes costs less
than the memoryview and cast that spare it (0.2 µs less a small tensor, 1.3 µs more at 64 KiB)."""


def write_tensors(
    buf: memoryview, start: int, arrays: Mapping[str, np.ndarray]
) -> list[Descriptor]:
    """Write each array once into the slot at `start`; the descriptors say where."""
    described: list[Descriptor] = []
    at = 0
    for name, array in arrays.items():
        dtype = array.dtype
        if dtype.kind == "O":
            data = b"".join(_bytes_layout(array))
            buf[start + at : start + at + len(data)] = data
            described.append([name, "BYTES", array.shape, at, len(data)])
            at += aligned(len(data))
            continue
        nbytes = array.nbytes
        if nbytes > SMALL_COPY_BYTES:  # a byte view of the array: no ndarray or ufunc setup
            flat = memoryview(np.ascontiguousarray(array))  # type: ignore[arg-type]
            buf[start + at : start + at + nbytes] = flat.cast("B")
        elif nbytes:
            buf[start + at : start + at + nbytes] = array.tobytes()  # C order, as the view
        # The shape goes as the tuple it is: orjson writes it as the list a descriptor holds.
        described.append([name, dtype.str, array.shape, at, nbytes])
        at += (nbytes + ALIGN - 1) // ALIGN * ALIGN
    return described


def view_tensors(slot: Buffer, descriptors: object) -> dict[str, np.ndarray]:
    """Arrays over `slot` (see Arena.slot), one per descriptor of the list `descriptors` (as
    read from a control frame). Each is checked: its form, its bounds in the slot, and that its
    dtype and shape fill its bytes; anything else is a ValueError."""
    if type(descriptors) is not list:
        raise ValueError(f"tensor descriptors must be a list, got {descriptors!r:.200}")
    arrays: dict[str, np.ndarray] = {}
    end = len(slot)
    for item in descriptors:
        # _checked, inline (a call per tensor less), and the element count with the dimensions.
        if type(item) is not list or len(item) != 5:
            raise ValueError(f"tensor descriptor must be a list of 5 items, got {item!r:.200}")
        name, dtype_name, shape, offset, nbytes = item
        if (
            type(name) is not str
            or type(dtype_name) is not str
            or type(shape) is not list
            or type(offset) is not int
            or type(nbytes) is not int
        ):
            raise ValueError(f"malformed tensor descriptor {item!r:.200}")
        if len(shape) > MAX_DIMS:  # before a Python step per dimension
            raise ValueError(f"tensor '{name}' has {len(shape)} dimensions, past {MAX_DIMS}")
        count = 1
        for dim in shape:
            if type(dim) is not int or dim < 0:
                raise ValueError(f"malformed tensor descriptor {item!r:.200}")
            count *= dim
        if offset < 0 or nbytes < 0 or offset + nbytes > end:
            raise ValueError(f"tensor '{name}' lies outside its slot")
        if dtype_name == "BYTES":
            if count * _LENGTH.size > nbytes:  # each element has its length: bounds the array
                raise ValueError(
                    f"BYTES tensor '{name}' of {count} elements cannot fit in {nbytes} bytes"
                )
            arrays[name] = _read_bytes(slot, name, tuple(shape), offset, nbytes, count)
            continue
        dtype = _DTYPES.get(dtype_name)  # not `or`: a dtype without fields is falsy
        if dtype is None:
            dtype = _numeric_dtype(dtype_name)
        if dtype is None or count * dtype.itemsize != nbytes:
            raise ValueError(f"tensor '{name}': {dtype_name} {shape} does not fill {nbytes} bytes")
        # The array keeps `slot` as its base, as the weakref on it needs. Positional: with
        # keywords np.ndarray costs twice as much.
        arrays[name] = np.ndarray(shape, dtype, slot, offset)  # type: ignore[arg-type]
    return arrays


_DTYPES: dict[str, np.dtype | None] = {}


def _numeric_dtype(name: str) -> np.dtype | None:
    """The numeric dtype a descriptor names in numpy's canonical form (`dtype.str`, which is
    what write_tensors sends), or None for anything else. Cached: one lookup per tensor per
    request; only canonical names are kept, so the peer cannot grow the cache."""
    dtype = _DTYPES.get(name)
    if dtype is None:
        try:
            dtype = np.dtype(name)
        except (TypeError, ValueError):
            return None
        if dtype.kind not in NUMERIC_KINDS or dtype.str != name:
            return None
        _DTYPES[name] = dtype
    return dtype


def _read_bytes(
    slot: Buffer, name: str, shape: tuple[int, ...], offset: int, nbytes: int, count: int
) -> np.ndarray:
    out = np.empty(count, dtype=object)
    at, end = offset, offset + nbytes
    for index in range(count):
        if at + 4 > end:
            raise ValueError(f"BYTES tensor '{name}' ends inside element {index}")
        (length,) = _LENGTH.unpack_from(slot, at)
        if at + 4 + length > end:
            raise ValueError(f"BYTES tensor '{name}' element {index} passes its end")
        out[index] = bytes(memoryview(slot)[at + 4 : at + 4 + length])
        at += 4 + length
    return out.reshape(shape)
