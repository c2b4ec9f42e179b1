"""The binary tensor data extension of the HTTP protocol, and the raw tensor layout it shares with
gRPC's `raw_input_contents` / `raw_output_contents`.

A binary request body is a JSON inference header of `Inference-Header-Content-Length` bytes
followed by the data of every input whose `parameters.binary_data_size` is set, in input order.
Fixed-size tensors are their little-endian elements in row-major order; BYTES tensors are each
element as a 4-byte little-endian length followed by its bytes. Responses put outputs asked for
with `binary_data` (per output) or `binary_data_output` (request default) after the JSON header
the same way, each with `parameters.binary_data_size`.

Decoding never copies fixed-size tensor data (`np.frombuffer` on the body); the arrays are
read-only views. Everything here is synchronous: callers run bodies and outputs larger than
OFFLOAD_BYTES in a worker thread so the event loop keeps serving.
"""

from __future__ import annotations

import asyncio
import math
import struct
import zlib
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar, overload

import numpy as np
import orjson

from engine.datatypes import check_shape, numpy_dtype
from engine.errors import InvalidInput, PayloadTooLarge
from engine.types import InferResponse
from server import json_header

T = TypeVar("T")
HEADER_LENGTH = "Inference-Header-Content-Length"
OFFLOAD_BYTES = 256 * 1024


async def off_loop(size: int, func: Callable[..., T], *args: Any) -> T:
    """`func(*args)`, in a worker thread when `size` bytes are involved past OFFLOAD_BYTES."""
    return await asyncio.to_thread(func, *args) if size > OFFLOAD_BYTES else func(*args)


"""Bodies and responses larger than this should be decoded / encoded off the event loop."""

JsonEncoder = Callable[[np.ndarray, str], Any]
"""Turns an output array and its datatype into the `data` value of a JSON output tensor."""

_LENGTH = struct.Struct("<I")
_ENCODINGS = {"gzip": 31, "deflate": 15}  # zlib wbits: 31 = gzip framing, 15 = zlib framing


@dataclass(slots=True)
class BinaryRequest:
    """A request body split into its JSON inference header and its binary inputs."""

    header: dict[str, Any]
    """The parsed JSON inference header (inputs without binary data keep their `data`)."""
    arrays: dict[str, np.ndarray]
    """Inputs sent as binary data, decoded and shaped; fixed-size ones are views of the body."""
    binary_default: bool = False
    """The request's `binary_data_output` parameter: outputs not listed go back as binary."""
    output_flags: dict[str, bool] = field(default_factory=dict)
    """Each requested output's `binary_data` parameter (the default when it has none)."""

    def binary_outputs(self, names: Collection[str]) -> frozenset[str]:
        """Which of the response's outputs (`names`) go back as binary data."""
        if not self.output_flags:
            return frozenset(names) if self.binary_default else frozenset()
        return frozenset(name for name in names if self.output_flags.get(name, False))


def _header(headers: Mapping[str, str], name: str) -> str | None:
    wanted = name.lower()
    for key, value in headers.items():
        if key.lower() == wanted:
            return value
    return None


def _shape(value: Any, name: str) -> tuple[int, ...]:
    if not isinstance(value, list):
        raise InvalidInput(
            f"input '{name}': shape must be a list of non-negative integers, got {value!r:.80}"
        )
    return check_shape(name, value)


def tensor_from_buffer(
    buffer: memoryview, datatype: str, shape: tuple[int, ...], name: str
) -> np.ndarray:
    """The tensor held by `buffer` in the raw layout; fixed-size types are zero-copy views."""
    try:
        dtype = numpy_dtype(datatype)
    except InvalidInput as exc:
        raise InvalidInput(f"input '{name}': {exc.message}") from None
    shape = check_shape(name, shape)  # every caller's shape, so numpy's reshape cannot fail
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
    return np.frombuffer(buffer, dtype.newbyteorder("<")).reshape(shape)


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
    dtype = numpy_dtype(datatype).newbyteorder("<")
    flat = np.ascontiguousarray(array, dtype=dtype).reshape(-1)
    return flat.view(np.uint8).data


def split_request(
    body: bytes,
    headers: Mapping[str, str],
    check_header: Callable[[dict[str, Any]], None] | None = None,
) -> BinaryRequest:
    """Split a (decompressed) request body into the JSON header and the binary inputs, and read
    which outputs the client wants as binary (bad output parameters fail here, before any
    inference is run). `check_header` sees the parsed header before any tensor is decoded; in
    a large JSON body, inputs' `data` values are still json_header.RawData then."""
    raw_length = _header(headers, HEADER_LENGTH)
    view = memoryview(body)
    if raw_length is None:
        json_size = len(body)
    else:
        if not (raw_length.isascii() and raw_length.isdigit()):  # int() takes " +1_0" too
            raise InvalidInput(
                f"{HEADER_LENGTH} is {raw_length!r}; expected a whole number of bytes"
            )
        json_size = int(raw_length)
        if not 0 <= json_size <= len(body):
            raise InvalidInput(f"{HEADER_LENGTH} is {json_size} but the body has {len(body)} bytes")
    try:
        header = json_header.loads(body if raw_length is None else view[:json_size])
    except orjson.JSONDecodeError as exc:
        what = "inference header" if raw_length is not None else "request body"
        raise InvalidInput(f"{what} is not valid JSON: {exc}") from None
    if not isinstance(header, dict):
        raise InvalidInput(f"inference header must be a JSON object; got {type(header).__name__}")
    if check_header is not None:
        check_header(header)
    arrays = _binary_inputs(header, view[json_size:], raw_length is not None)
    default, flags = _output_flags(header)
    return BinaryRequest(header, arrays, default, flags)


def _binary_inputs(
    header: dict[str, Any], data: memoryview, has_binary: bool
) -> dict[str, np.ndarray]:
    inputs = header.get("inputs", [])
    if not isinstance(inputs, list):
        raise InvalidInput(f"'inputs' must be a list; got {type(inputs).__name__}")
    arrays: dict[str, np.ndarray] = {}
    offset = 0
    for entry in inputs:
        params = entry.get("parameters") if isinstance(entry, dict) else None
        if not isinstance(params, dict) or "binary_data_size" not in params:
            continue
        name = str(entry.get("name"))
        if "shared_memory_region" in params:
            raise InvalidInput(f"input '{name}': shared memory is not supported by this server")
        size = params["binary_data_size"]
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise InvalidInput(
                f"input '{name}' has binary_data_size {size!r}; expected an integer >= 0"
            )
        if not has_binary:
            raise InvalidInput(
                f"input '{name}' has binary_data_size but the request has no {HEADER_LENGTH} header"
            )
        if "data" in entry:
            raise InvalidInput(f"input '{name}' has both 'data' and binary_data_size; send one")
        if offset + size > len(data):
            raise InvalidInput(
                f"input '{name}' declares {size} bytes of binary data at offset {offset}, but "
                f"the body holds {len(data)} bytes after the inference header"
            )
        datatype = entry.get("datatype")
        if not isinstance(datatype, str):
            raise InvalidInput(f"input '{name}' has datatype {datatype!r}; expected a string")
        shape = _shape(entry.get("shape"), name)
        arrays[name] = tensor_from_buffer(data[offset : offset + size], datatype, shape, name)
        offset += size
    if offset != len(data):
        raise InvalidInput(
            f"the body holds {len(data)} bytes after the inference header but the inputs' "
            f"binary_data_size values add up to {offset}"
        )
    return arrays


def _output_flags(header: Mapping[str, Any]) -> tuple[bool, dict[str, bool]]:
    params = header.get("parameters") or {}
    default = params.get("binary_data_output", False) if isinstance(params, dict) else False
    if not isinstance(default, bool):
        raise InvalidInput(f"parameter binary_data_output is {default!r}; expected true or false")
    requested = header.get("outputs") or []
    if not isinstance(requested, list):
        raise InvalidInput(f"'outputs' must be a list; got {type(requested).__name__}")
    flags: dict[str, bool] = {}
    for entry in requested:
        name = entry.get("name") if isinstance(entry, dict) else None
        out_params = (entry.get("parameters") if isinstance(entry, dict) else None) or {}
        if not isinstance(out_params, dict):
            raise InvalidInput(f"output '{name}' has parameters {out_params!r}; expected an object")
        if "classification" in out_params:
            raise InvalidInput(f"output '{name}': the classification extension is not supported")
        if "shared_memory_region" in out_params:
            raise InvalidInput(f"output '{name}': shared memory is not supported by this server")
        flag = out_params.get("binary_data", default)
        if not isinstance(flag, bool):
            raise InvalidInput(f"output '{name}' has binary_data {flag!r}; expected true or false")
        if isinstance(name, str):
            flags[name] = flag
    return default, flags


def encode_response(
    response: InferResponse,
    binary: Collection[str],
    encode_json: JsonEncoder,
    accept_encoding: str | None = None,
) -> tuple[bytes, dict[str, str]]:
    """The response body and its headers: outputs in `binary` as binary data after the JSON
    header, the others as JSON `data` (via `encode_json`); compressed when the client accepts
    gzip or deflate."""
    outputs = []
    chunks: list[bytes | memoryview] = []
    for name, array in response.outputs.items():
        datatype = response.datatypes[name]
        tensor: dict[str, Any] = {"name": name, "datatype": datatype, "shape": list(array.shape)}
        if name in binary:
            chunk = tensor_buffer(array, datatype)
            tensor["parameters"] = {"binary_data_size": len(chunk)}
            chunks.append(chunk)
        else:
            tensor["data"] = encode_json(array, datatype)
        outputs.append(tensor)
    document: dict[str, Any] = {
        "model_name": response.model_name,
        "model_version": response.model_version,
    }
    if response.id is not None:
        document["id"] = response.id
    if response.parameters:
        document["parameters"] = response.parameters
    document["outputs"] = outputs
    json_bytes = orjson.dumps(document, option=orjson.OPT_SERIALIZE_NUMPY)
    headers = {"Content-Type": "application/json"}
    body = json_bytes
    if chunks:
        body = b"".join([json_bytes, *chunks])
        headers = {"Content-Type": "application/octet-stream", HEADER_LENGTH: str(len(json_bytes))}
    encoding = _chosen_encoding(accept_encoding)
    if encoding is not None:
        compressor = zlib.compressobj(wbits=_ENCODINGS[encoding])
        body = compressor.compress(body) + compressor.flush()
        headers["Content-Encoding"] = encoding
    return body, headers


def _chosen_encoding(accept_encoding: str | None) -> str | None:
    # Only an explicit gzip/deflate: tritonclient asks for one at a time, and a body that is
    # mostly float data compresses poorly, so "*" does not opt in.
    for token in (accept_encoding or "").split(","):
        coding, _, params = token.strip().partition(";")
        if coding.strip().lower() in _ENCODINGS and params.replace(" ", "") not in {"q=0", "q=0.0"}:
            return coding.strip().lower()
    return None


@overload
def decompress(body: bytes, content_encoding: str | None, limit_bytes: int) -> bytes: ...
@overload
def decompress(
    body: bytes, content_encoding: str | None, limit_bytes: int, budget_bytes: int
) -> bytes | None: ...
def decompress(
    body: bytes, content_encoding: str | None, limit_bytes: int, budget_bytes: int | None = None
) -> bytes | None:
    """The body without its Content-Encoding (gzip, deflate), inflated only up to `limit_bytes`
    (PayloadTooLarge past it), with nothing allowed after the compressed stream.

    With `budget_bytes`, None when the body inflates past that budget: what it really holds is
    unknown until it is inflated whole, which the caller then does off the event loop."""
    coding = (content_encoding or "identity").strip().lower()
    if coding == "identity":
        return body
    if coding not in _ENCODINGS:
        raise InvalidInput(
            f"unsupported Content-Encoding '{content_encoding}'; supported: gzip, deflate"
        )
    cap = limit_bytes if budget_bytes is None else min(budget_bytes, limit_bytes)
    inflater = zlib.decompressobj(wbits=_ENCODINGS[coding])
    try:
        plain = inflater.decompress(body, cap + 1)  # never more than this is allocated
    except zlib.error as exc:
        raise InvalidInput(f"body is not valid {coding} data: {exc}") from None
    if len(plain) > cap or inflater.unconsumed_tail:
        if cap < limit_bytes:
            return None
        raise PayloadTooLarge(len(plain) + len(inflater.unconsumed_tail), limit_bytes)
    if not inflater.eof:
        raise InvalidInput(f"body is truncated {coding} data ({len(body)} bytes)")
    if inflater.unused_data:
        raise InvalidInput(
            f"body has {len(inflater.unused_data)} bytes after the end of its {coding} data"
        )
    return plain
