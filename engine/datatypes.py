"""Open Inference Protocol datatypes and their numpy and ONNX counterparts."""

from __future__ import annotations

from typing import TypeGuard

import numpy as np

from engine.errors import InvalidInput

# v2 datatype -> numpy dtype. BYTES tensors are numpy object arrays holding `bytes`.
NUMPY_DTYPES: dict[str, np.dtype[np.generic]] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
    "BYTES": np.dtype(np.object_),
}

# ONNX Runtime's type strings ("tensor(float)") -> v2 datatype.
_ONNX_TO_V2 = {
    "tensor(bool)": "BOOL",
    "tensor(uint8)": "UINT8",
    "tensor(uint16)": "UINT16",
    "tensor(uint32)": "UINT32",
    "tensor(uint64)": "UINT64",
    "tensor(int8)": "INT8",
    "tensor(int16)": "INT16",
    "tensor(int32)": "INT32",
    "tensor(int64)": "INT64",
    "tensor(float16)": "FP16",
    "tensor(float)": "FP32",
    "tensor(double)": "FP64",
    "tensor(string)": "BYTES",
}

_NUMPY_TO_V2 = {dtype: name for name, dtype in NUMPY_DTYPES.items()}

ALLOWED = ", ".join(NUMPY_DTYPES)

UINT64_MAX = 2**64 - 1
"""The largest value of an integer parameter (timeout, priority, binary_data_size): Triton's
uint64, as gRPC's uint64_param holds them."""


def past_64_bits(value: object) -> TypeGuard[float]:
    """Whether `value` is an integer past 64 bits as a JSON parser hands one over: orjson and
    simdjson read it as the nearest double (one just past rounds to -2^63 or 2^64 themselves).
    A check that wants an integer calls it out of range, never a fraction or a wrong kind."""
    return type(value) is float and not -(2**63) < value < 2**64


def shown(value: object) -> str:
    """A number for a message. An integer past 64 bits is named by the side it passed: its
    digits are lost, and the double's would misstate it (1.84467e+19 reads as less than
    UINT64_MAX; -9.22337e+18 as inside INT64)."""
    if past_64_bits(value):
        return "2^64 or more" if value > 0 else "below -2^63"
    return str(value)


def received(value: object, room: int = 100) -> str:
    """A value a client sent as JSON, for a message saying what was received: null, true and
    false in JSON's words (Python's None and True are not what the client wrote), a string
    quoted as messages quote names ('user'), an integer past 64 bits by its side (shown) at any
    depth, and an array or object cut with '...' once about `room` characters are spent. Each
    level of nesting spends room too, so a deeply nested body cannot exhaust the stack."""
    if value is None or isinstance(value, bool):
        return "null" if value is None else "true" if value else "false"
    if isinstance(value, list | dict):
        is_object = isinstance(value, dict)
        items = value.items() if isinstance(value, dict) else value
        room -= 2  # the brackets
        parts: list[str] = []
        for item in items:
            if room <= 0:
                parts.append("...")
                break
            part = f"{item[0]!r}: {received(item[1], room)}" if is_object else received(item, room)
            parts.append(part)
            room -= len(part) + 2
        joined = ", ".join(parts)
        return f"{{{joined}}}" if is_object else f"[{joined}]"
    text = shown(value) if past_64_bits(value) else repr(value)
    return text if len(text) <= room else text[: max(room, 0)] + "..."


def numpy_dtype(datatype: str) -> np.dtype[np.generic]:
    """The numpy dtype for a v2 datatype; InvalidInput names the allowed ones."""
    try:
        return NUMPY_DTYPES[datatype]
    except KeyError:
        raise InvalidInput(f"unknown datatype '{datatype}'; allowed: {ALLOWED}") from None


def from_onnx(type_str: str) -> str:
    """The v2 datatype for an ONNX Runtime type string such as 'tensor(float)'."""
    try:
        return _ONNX_TO_V2[type_str]
    except KeyError:
        raise ValueError(f"ONNX type {type_str} has no Open Inference Protocol datatype") from None


def from_numpy(dtype: np.dtype[np.generic]) -> str:
    """The v2 datatype of a numpy dtype (str/bytes/object arrays are BYTES)."""
    if dtype.kind in "OSU":
        return "BYTES"
    try:
        return _NUMPY_TO_V2[dtype]
    except KeyError:
        raise ValueError(f"numpy dtype {dtype} has no Open Inference Protocol datatype") from None


def itemsize(datatype: str) -> int:
    """Bytes per element of a fixed-size datatype (BYTES has none: -1)."""
    return -1 if datatype == "BYTES" else NUMPY_DTYPES[datatype].itemsize


MAX_DIMS = 64
# numpy refuses a shape whose non-zero dimensions, times the item size, pass the largest intp
# (even when another dimension is 0 and the array is empty); 8 bytes is the widest item here.
MAX_ELEMENTS = (2**63 - 1) // 8


def check_shape(name: str, shape: tuple[int, ...] | list[int]) -> tuple[int, ...]:
    """A tensor shape a client sent, checked: non-negative whole numbers, at most MAX_DIMS of
    them, and non-zero dimensions multiplying to at most MAX_ELEMENTS, so that numpy can
    represent it for every datatype (a 0 in the shape does not lift the bound). The count comes
    first: the others take a Python step a dimension (a million took 98 ms)."""
    if len(shape) > MAX_DIMS:
        raise InvalidInput(f"input '{name}': shape has {len(shape)} dimensions; at most {MAX_DIMS}")
    for index, dim in enumerate(shape):
        # As JSON hands one over: out of range, never a wrong kind showing the double's digits
        # (checked first: the wrong-kind message echoes the whole shape).
        if past_64_bits(dim):
            raise InvalidInput(
                f"input '{name}': shape[{index}] is out of range (0 to {MAX_ELEMENTS}), "
                f"got {shown(dim)}"
            )
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise InvalidInput(
            f"input '{name}': shape must be a list of non-negative integers, got {shape!r:.80}"
        )
    nonzero = 1
    for dim in shape:
        nonzero *= max(dim, 1)
        if nonzero > MAX_ELEMENTS:
            raise InvalidInput(
                f"input '{name}': shape {list(shape)} is too large for any array (its non-zero "
                f"dimensions multiply past {MAX_ELEMENTS})"
            )
    return tuple(shape)
