"""The binary tensor data extension of the HTTP protocol. The raw tensor layout it shares with
gRPC's `raw_input_contents` / `raw_output_contents` is server/raw_tensors.py.

A binary request body is a JSON inference header of `Inference-Header-Content-Length` bytes
followed by the data of every input whose `parameters.binary_data_size` is set, in input order.
Fixed-size tensors are their little-endian elements in row-major order; BYTES tensors are each
element as a 4-byte little-endian length followed by its bytes (server/raw_tensors.py).
Responses put outputs asked for with `binary_data` (per output) or `binary_data_output`
(request default) after the JSON header the same way, each with `parameters.binary_data_size`.

Decoding never copies fixed-size tensor data (`np.frombuffer` on the body); the arrays are
read-only views. Everything here is synchronous: callers run bodies and outputs larger than
raw_tensors.OFFLOAD_BYTES in a worker thread so the event loop keeps serving.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, overload

import numpy as np
import orjson

from engine.datatypes import UINT64_MAX, check_shape, past_64_bits, shown
from engine.errors import InvalidInput, PayloadTooLarge
from engine.types import InferResponse
from server.http import json_header
from server.raw_tensors import tensor_buffer, tensor_from_buffer

HEADER_LENGTH = "Inference-Header-Content-Length"
JsonEncoder = Callable[[np.ndarray, str], Any]
"""Turns an output array and its datatype into the `data` value of a JSON output tensor."""

_ENCODINGS = {"gzip": 31, "deflate": 15}  # zlib wbits: 31 = gzip framing, 15 = zlib framing
INFLATE_STEP_BYTES = 1 << 20
"""A compressed body is inflated this much at a time. zlib runs without the GIL and Python holds
it only between steps, so an inflating thread never stalls the event loop for long, and a bomb
is given up one step past its limit. (One call inflating up to the limit holds the GIL while it
copies everything it inflated into one bytes object, touching that much memory again: two
200 MiB bombs stalled the loop for about a second.)"""


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


def split_request(
    body: bytes,
    headers: Mapping[str, str],
    check_header: Callable[[dict[str, Any]], None] | None = None,
    parsed: dict[str, Any] | None = None,
) -> BinaryRequest:
    """Split a (decompressed) request body into the JSON header and the binary inputs, and read
    which outputs the client wants as binary (bad output parameters fail here, before any
    inference is run). `check_header` sees the parsed header before any tensor is decoded; in
    a large JSON body, inputs' `data` values are still json_header.RawData then. `parsed`: the
    body parsed already, when it is all JSON (it is not parsed again)."""
    raw_length = _header(headers, HEADER_LENGTH)
    view = memoryview(body)
    if raw_length is None:
        json_size = len(body)
    else:
        if not (raw_length.isascii() and raw_length.isdigit()):  # int() takes " +1_0" too
            raise InvalidInput(
                f"{HEADER_LENGTH} is {raw_length!r:.40}; expected a whole number of bytes"
            )
        # No header is longer than the body's own length in digits (int() refuses past 4300).
        if len(raw_length.lstrip("0")) > len(str(len(body))):
            raise InvalidInput(
                f"{HEADER_LENGTH} is {raw_length[:40]}{'...' if len(raw_length) > 40 else ''} "
                f"but the body has {len(body)} bytes"
            )
        json_size = int(raw_length.lstrip("0") or "0")
        if not 0 <= json_size <= len(body):
            raise InvalidInput(f"{HEADER_LENGTH} is {json_size} but the body has {len(body)} bytes")
    try:
        header = (
            parsed
            if parsed is not None and raw_length is None
            else json_header.loads(body if raw_length is None else view[:json_size])
        )
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
            raise InvalidInput(
                f"input '{name}' names a shared memory region and has binary_data_size; send one"
            )
        size = params["binary_data_size"]
        if past_64_bits(size):
            raise InvalidInput(
                f"input '{name}': binary_data_size is out of range (0 to {UINT64_MAX}), "
                f"got {shown(size)}"
            )
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
    shared = response.shared_outputs or {}
    for name, array in response.outputs.items():
        datatype = response.datatypes[name]
        tensor: dict[str, Any] = {"name": name, "datatype": datatype, "shape": list(array.shape)}
        # An output written into the client's region goes without data or parameters, as Triton
        # answers it (tritonclient's C++ client, perf_analyzer's, takes a `parameters` object for
        # binary data and fails without its binary_data_size).
        if name in shared:
            pass
        elif name in binary:
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
    if not accept_encoding:
        return None
    for token in accept_encoding.split(","):
        coding, _, params = token.strip().partition(";")
        coding = coding.strip().lower()
        if coding in _ENCODINGS and not _refused(params):
            return coding
    return None


def _refused(params: str) -> bool:
    """Whether an Accept-Encoding entry's parameters say q=0 (in any of its spellings: q=0.000,
    Q=0; RFC 9110 qvalues have at most three decimals)."""
    name, _, value = params.replace(" ", "").partition("=")
    if name.lower() != "q":
        return False
    try:
        return float(value) == 0.0
    except ValueError:
        return False


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
    parts: list[bytes] = []
    view = memoryview(body)
    size, fed = 0, 0
    pending: bytes | memoryview = b""
    try:
        while size <= cap and not inflater.eof:  # never more than cap + 1 bytes inflated
            # The input goes in a step at a time too: zlib copies what a call leaves unread
            # (unconsumed_tail), so the whole body handed to each step made a body that
            # inflates little (random data, 80 MB) copy the rest of itself at every step.
            if not pending:
                pending = view[fed : fed + INFLATE_STEP_BYTES]
                fed += len(pending)
            part = inflater.decompress(pending, min(INFLATE_STEP_BYTES, cap + 1 - size))
            if not part and not pending:
                break  # the input is used up before the end of the stream: truncated
            parts.append(part)
            size += len(part)
            pending = inflater.unconsumed_tail
    except zlib.error as exc:
        raise InvalidInput(f"body is not valid {coding} data: {exc}") from None
    if size > cap:
        if cap < limit_bytes:
            return None
        raise PayloadTooLarge(None, limit_bytes, coding)
    if not inflater.eof:
        raise InvalidInput(f"body is truncated {coding} data ({len(body)} bytes)")
    trailing = len(inflater.unused_data) + len(body) - fed
    if trailing:
        raise InvalidInput(f"body has {trailing} bytes after the end of its {coding} data")
    return b"".join(parts)  # a single part is returned as it is, not copied
