"""Cache keys: a blake2b digest over everything that can change a result, and the namespace that
scopes it to one model version and its content fingerprint.

Two requests share an entry only when the model, version, fingerprint, every input (name,
datatype, numpy dtype, shape, bytes), the requested outputs and every result-changing parameter
are equal. Every field is framed (tagged and length-prefixed) so that no two different requests
can produce the same byte stream before hashing.
"""

from __future__ import annotations

import asyncio
import hashlib
import struct
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import quote

import numpy as np

from engine.errors import InvalidInput

KEY_FORMAT = b"sluice-cache-key/1"

TRANSPORT_PARAMETERS: frozenset[str] = frozenset(
    {
        "binary_data_output",  # how outputs are encoded on the wire, not their values
        "binary_data",  # per-output flavour of the same
        "binary_data_size",  # per-input framing of the binary extension
        "cache",  # the opt-out switch itself
        "timeout",  # a deadline changes whether we answer, never what we answer
        "priority",  # queue order only
    }
)
"""Request parameters that never change a result and so are left out of the key. Every other
parameter is part of it: an unknown parameter costs a cache miss, never a wrong answer."""

# Inputs above this many bytes are hashed off the event loop by `cache_key_async`.
OFFLOAD_INPUT_BYTES = 256 * 1024

_U64 = struct.Struct("<Q")


def request_key(
    model: str,
    version: str,
    fingerprint: int | str,
    inputs: Mapping[str, np.ndarray],
    datatypes: Mapping[str, str],
    outputs: Sequence[str] | None,
    parameters: Mapping[str, Any],
) -> bytes:
    """The 32-byte blake2b digest of a validated request.

    `datatypes` holds the v2 datatype of each input; BYTES inputs are numpy object arrays of
    `bytes` (str elements are hashed as UTF-8). `outputs` None means "all outputs" and differs
    from any explicit list. Parameters in TRANSPORT_PARAMETERS are ignored.
    """
    h = hashlib.blake2b(KEY_FORMAT, digest_size=32)
    _text(h, model)
    _text(h, version)
    _text(h, str(fingerprint))
    h.update(_U64.pack(len(inputs)))
    for name in sorted(inputs):
        _text(h, name)
        _tensor(h, datatypes[name], inputs[name])
    if outputs is None:
        h.update(b"A")
    else:
        names = sorted(outputs)
        h.update(b"O" + _U64.pack(len(names)))
        for name in names:
            _text(h, name)
    kept = {k: v for k, v in parameters.items() if k not in TRANSPORT_PARAMETERS}
    h.update(canonical(kept))
    return h.digest()


def namespace(prefix: str, model: str, version: str, fingerprint: int | str) -> bytes:
    """`prefix:model:version:fingerprint:` with each part escaped so ':' cannot be ambiguous.

    A new version or fingerprint gives new keys, so entries of a replaced model are never read
    again (they expire by TTL). The fingerprint must be the same on every replica serving the same
    files (derive it from the model's content, not from a local load counter), or replicas will
    not share entries.
    """
    parts = (prefix, model, version, str(fingerprint))
    return (":".join(quote(part, safe="") for part in parts) + ":").encode()


def cache_key(
    prefix: str,
    model: str,
    version: str,
    fingerprint: int | str,
    inputs: Mapping[str, np.ndarray],
    datatypes: Mapping[str, str],
    outputs: Sequence[str] | None,
    parameters: Mapping[str, Any],
) -> bytes:
    """The key every backend stores under: namespace plus the hex request digest."""
    digest = request_key(model, version, fingerprint, inputs, datatypes, outputs, parameters)
    return namespace(prefix, model, version, fingerprint) + digest.hex().encode()


async def cache_key_async(
    prefix: str,
    model: str,
    version: str,
    fingerprint: int | str,
    inputs: Mapping[str, np.ndarray],
    datatypes: Mapping[str, str],
    outputs: Sequence[str] | None,
    parameters: Mapping[str, Any],
) -> bytes:
    """`cache_key`, hashed in a worker thread when the inputs are large.

    blake2b runs at roughly 0.5-1 GB/s, so a 600 kB image costs about a millisecond: too long
    for the event loop. hashlib releases the GIL on large updates, so the thread really helps.
    """
    args = (prefix, model, version, fingerprint, inputs, datatypes, outputs, parameters)
    if sum(array.nbytes for array in inputs.values()) > OFFLOAD_INPUT_BYTES:
        return await asyncio.to_thread(cache_key, *args)
    return cache_key(*args)


def cache_requested(parameters: Mapping[str, Any]) -> bool:
    """False when the request opts out with `"cache": false`; InvalidInput for a non-boolean."""
    value = parameters.get("cache", True)
    if not isinstance(value, bool):
        raise InvalidInput(f"parameter 'cache' must be a boolean (true or false), got {value!r}")
    return value


def element_bytes(value: object) -> bytes:
    """One element of a BYTES tensor as bytes (str as UTF-8); TypeError for anything else."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, bytearray | memoryview):
        return bytes(value)
    raise TypeError(f"BYTES element must be bytes or str, got {type(value).__name__}")


class _Encoded(bytes):
    """Bytes already encoded by `canonical`, waiting on its stack (not a value to encode)."""


def canonical(value: Any) -> bytes:
    """A deterministic, type-tagged encoding of a JSON-like value (True, 1, 1.0 and "1" differ).

    Iterative, with an explicit stack: parameters nested past Python's recursion limit encode
    like any others (the front-ends bound nesting too, but the key must never be what fails)."""
    out: list[bytes] = []
    stack: list[Any] = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, _Encoded):
            out.append(item)
        elif isinstance(item, Mapping):
            items = sorted((str(k), v) for k, v in item.items())
            out.append(b"d" + _U64.pack(len(items)))
            for key, child in reversed(items):  # reversed: the stack pops the first one first
                stack += (child, _Encoded(_framed(key.encode())))
        elif isinstance(item, list | tuple):
            out.append(b"l" + _U64.pack(len(item)))
            stack.extend(reversed(item))
        else:
            out.append(_scalar(item))
    return b"".join(out)


def _scalar(value: Any) -> bytes:
    if value is None:
        return b"N"
    if isinstance(value, bool | np.bool_):
        return b"T" if value else b"F"
    if isinstance(value, int | np.integer):
        return b"i" + _framed(str(int(value)).encode())
    if isinstance(value, float | np.floating):
        return b"f" + _framed(float(value).hex().encode())
    if isinstance(value, str):
        return b"s" + _framed(value.encode())
    if isinstance(value, bytes):
        return b"b" + _framed(value)
    # Not a protocol value; still deterministic for the types that reach here in practice.
    return b"r" + _framed(f"{type(value).__qualname__}:{value!r}".encode())


def _framed(data: bytes) -> bytes:
    return _U64.pack(len(data)) + data


def _text(h: Any, text: str) -> None:
    h.update(_framed(text.encode()))


def _tensor(h: Any, datatype: str, array: np.ndarray) -> None:
    _text(h, datatype)
    h.update(_U64.pack(array.ndim))
    h.update(struct.pack(f"<{array.ndim}Q", *array.shape))
    if datatype == "BYTES" or array.dtype.kind in "OSU":
        items = [element_bytes(x) for x in array.ravel(order="C").tolist()]
        _text(h, "bytes")
        h.update(np.fromiter(map(len, items), dtype="<u8", count=len(items)).tobytes())
        h.update(b"".join(items))
        return
    data = np.ascontiguousarray(array)
    if data.dtype.byteorder == ">":
        data = data.astype(data.dtype.newbyteorder("<"))
    _text(h, data.dtype.str)
    h.update(_U64.pack(data.nbytes))
    h.update(data.reshape(-1).view(np.uint8).data if data.size else b"")
