"""The binary value layout of a cached result: a small header, then the raw arrays. Never pickle.

    header   magic b"SLCR" | format u8 | flags u8 | count u16 | crc32 u32 (of the bytes before
             the signature, but for itself)
    count ×  name_len u16 | name utf-8 | datatype code u8 | ndim u8 | dims u64 × ndim | nbytes u64
    count ×  payload (zero-padded to a multiple of 8 so numeric arrays decode aligned)
    signed:  HMAC-SHA256 (32 bytes) of u32 len(key) | key | every byte before it

All integers are little-endian. Numeric payloads are the C-order little-endian array bytes and
decode zero-copy (`np.frombuffer`, read-only). A BYTES payload is, per element, a u32 length and
the element's bytes. `decode` checks every length against the buffer and the checksum, and
raises `CorruptEntry` (never anything else) for data it did not write.

Flags: 0, or 1 (`SIGNED`) when the entry ends with a signature. The CRC catches damage; only the
signature stops a writer who can reach Redis but has no `cache.signing_key`, and because it covers
the Redis key the entry is stored under, a genuine entry moved to another key fails it too. A
reader with a signer refuses unsigned entries; a reader without one reads signed entries as
plain ones (it trusts unsigned entries anyway), so a key can be rolled out replica by replica.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import struct
import zlib
from collections.abc import Iterable

import numpy as np

from engine.cache.contract import CachedResult
from engine.cache.key import element_bytes
from engine.datatypes import NUMPY_DTYPES

MAGIC = b"SLCR"
FORMAT_VERSION = 1
# Fixed codes: the stored format must not depend on the order of a dict elsewhere.
DATATYPE_CODES: dict[str, int] = {
    name: code
    for code, name in enumerate(
        ("BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
         "FP16", "FP32", "FP64", "BYTES"),
        start=1,
    )
}  # fmt: skip
_CODE_DATATYPES = {code: name for name, code in DATATYPE_CODES.items()}

_HEADER = struct.Struct("<4sBBHI")
_PREFIX = struct.Struct("<4sBBH")  # the header before its checksum
_NAME_LEN = struct.Struct("<H")
_TYPE_NDIM = struct.Struct("<BB")
_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")
_MAX_NDIM = 32
SIGNED = 1
"""The flags bit of an entry that ends with a signature."""
SIGNATURE_BYTES = hashlib.sha256().digest_size


class CorruptEntry(ValueError):
    """A stored value that is not a complete entry of this format; treat it as a miss."""


class Signer:
    """HMAC-SHA256 of entries with a secret (`cache.signing_key`), bound to their Redis key."""

    __slots__ = ("_secret",)

    def __init__(self, secret: bytes) -> None:
        self._secret = secret

    def __repr__(self) -> str:
        return "Signer(***)"  # never the secret, not even in a traceback

    def sign(self, key: bytes, parts: Iterable[bytes | memoryview]) -> bytes:
        """The signature of the entry made of `parts`, stored under `key`."""
        mac = hmac.new(self._secret, _U32.pack(len(key)) + key, hashlib.sha256)
        for part in parts:
            mac.update(part)
        return mac.digest()


def encode(result: CachedResult, *, signer: Signer | None = None, key: bytes = b"") -> bytes:
    """The stored form of `result` (its datatypes decide the layout of each output), signed for
    `key` when a `signer` is given."""
    if len(result.outputs) > 0xFFFF:
        raise ValueError(f"{len(result.outputs)} outputs; the format holds at most 65535")
    meta: list[bytes] = []
    payloads: list[bytes | memoryview] = []
    for name, array in result.outputs.items():
        datatype = result.datatypes[name]
        payload = _payload(datatype, array)
        encoded_name = name.encode()
        meta += [
            _NAME_LEN.pack(len(encoded_name)),
            encoded_name,
            _TYPE_NDIM.pack(DATATYPE_CODES[datatype], array.ndim),
            struct.pack(f"<{array.ndim}Q", *array.shape),
            _U64.pack(len(payload)),
        ]
        payloads += [payload, bytes(-len(payload) % 8)]
    # Pad the metadata so the first payload starts 8-byte aligned.
    meta.append(bytes(-(_HEADER.size + sum(map(len, meta))) % 8))
    body = [*meta, *payloads]
    flags = 0 if signer is None else SIGNED
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, flags, len(result.outputs))
    crc = zlib.crc32(prefix)
    for part in body:
        crc = zlib.crc32(part, crc)
    header = prefix + _U32.pack(crc)
    if signer is not None:
        body.append(signer.sign(key, [header, *body]))
    # One copy of the array data, straight into the value (payloads are views until here).
    return b"".join([header, *body])


def decode(data: bytes, *, signer: Signer | None = None, key: bytes = b"") -> CachedResult:
    """The result stored in `data` under `key`; CorruptEntry if it is truncated, altered or
    foreign, and, with a `signer`, if its signature is missing or not this signer's for `key`."""
    try:
        return _decode(data, signer, key)
    except CorruptEntry:
        raise
    except (ValueError, struct.error, OverflowError, MemoryError) as exc:
        # Shapes that numpy refuses and the like: still data we did not write.
        raise CorruptEntry(f"unreadable entry: {exc}") from exc


def _decode(data: bytes, signer: Signer | None, key: bytes) -> CachedResult:
    if len(data) < _HEADER.size:
        raise CorruptEntry(f"entry of {len(data)} bytes is shorter than the header")
    magic, version, flags, count, crc = _HEADER.unpack_from(data)
    if magic != MAGIC or version != FORMAT_VERSION or flags not in (0, SIGNED):
        raise CorruptEntry(f"not a cache entry of format {FORMAT_VERSION} ({magic!r}, {version})")
    view = memoryview(data)
    end = len(data)
    if flags == SIGNED:
        end -= SIGNATURE_BYTES
        if end < _HEADER.size:
            raise CorruptEntry(f"signed entry of {len(data)} bytes is too short for a signature")
    if signer is not None:
        if flags != SIGNED:
            raise CorruptEntry("entry is not signed, and cache.signing_key requires signed entries")
        if not hmac.compare_digest(signer.sign(key, [view[:end]]), view[end:]):
            raise CorruptEntry(
                "signature mismatch: written without this cache.signing_key, altered, or moved "
                "from another key"
            )
    view = view[:end]
    if zlib.crc32(view[_HEADER.size :], zlib.crc32(view[: _PREFIX.size])) != crc:
        raise CorruptEntry("checksum mismatch: the entry was altered or truncated")
    reader = _Reader(view, _HEADER.size)
    specs = [reader.tensor_meta() for _ in range(count)]
    reader.align()
    outputs: dict[str, np.ndarray] = {}
    datatypes: dict[str, str] = {}
    for name, datatype, shape, nbytes in specs:
        start = reader.skip(nbytes)
        outputs[name] = _array(data, start, datatype, shape, nbytes)
        datatypes[name] = datatype
        reader.align()
    if reader.offset != end:
        raise CorruptEntry(f"{end - reader.offset} unexpected bytes after the last tensor")
    if len(outputs) != count:
        raise CorruptEntry(f"header says {count} tensors but only {len(outputs)} names differ")
    return CachedResult(outputs, datatypes)


def _payload(datatype: str, array: np.ndarray) -> bytes | memoryview:
    if datatype == "BYTES":
        parts: list[bytes] = []
        for item in array.ravel(order="C").tolist():
            data = element_bytes(item)
            parts += [_U32.pack(len(data)), data]
        return b"".join(parts)
    dtype = NUMPY_DTYPES[datatype].newbyteorder("<")
    return np.ascontiguousarray(array, dtype=dtype).reshape(-1).view(np.uint8).data


def _array(
    data: bytes, start: int, datatype: str, shape: tuple[int, ...], nbytes: int
) -> np.ndarray:
    count = math.prod(shape)
    if datatype != "BYTES":
        dtype = NUMPY_DTYPES[datatype].newbyteorder("<")
        if count * dtype.itemsize != nbytes:
            raise CorruptEntry(
                f"{datatype} tensor of shape {list(shape)} cannot hold {nbytes} bytes"
            )
        return np.frombuffer(data, dtype=dtype, count=count, offset=start).reshape(shape)
    items: list[bytes] = []
    offset, end = start, start + nbytes
    for _ in range(count):
        if offset + 4 > end:
            raise CorruptEntry(
                f"BYTES tensor of shape {list(shape)} ends after {len(items)} elements"
            )
        (length,) = _U32.unpack_from(data, offset)
        offset += 4
        if offset + length > end:
            raise CorruptEntry(f"BYTES element {len(items)} of {length} bytes runs past its tensor")
        items.append(data[offset : offset + length])
        offset += length
    if offset != end:
        raise CorruptEntry(f"BYTES tensor has {end - offset} bytes beyond its {count} elements")
    flat = np.empty(count, dtype=object)
    flat[:] = items
    # Freeze the owner, not a view of it: a view of a writeable owner could be made writeable.
    flat.setflags(write=False)
    return flat.reshape(shape)


class _Reader:
    """A cursor that refuses to read past the end of the entry."""

    def __init__(self, view: memoryview, offset: int) -> None:
        self.view = view
        self.offset = offset

    def skip(self, size: int) -> int:
        start = self.offset
        if size < 0 or start + size > len(self.view):
            raise CorruptEntry(
                f"entry truncated: {size} bytes needed at {start}, {len(self.view) - start} left"
            )
        self.offset += size
        return start

    def align(self) -> None:
        self.skip(-self.offset % 8)

    def tensor_meta(self) -> tuple[str, str, tuple[int, ...], int]:
        (name_len,) = _NAME_LEN.unpack_from(self.view, self.skip(_NAME_LEN.size))
        try:
            name = bytes(self.view[self.skip(name_len) : self.offset]).decode()
        except UnicodeDecodeError as exc:
            raise CorruptEntry("tensor name is not UTF-8") from exc
        code, ndim = _TYPE_NDIM.unpack_from(self.view, self.skip(_TYPE_NDIM.size))
        if code not in _CODE_DATATYPES or ndim > _MAX_NDIM:
            raise CorruptEntry(f"tensor '{name}': unknown datatype code {code} or {ndim} dims")
        shape = struct.unpack_from(f"<{ndim}Q", self.view, self.skip(8 * ndim))
        (nbytes,) = _U64.unpack_from(self.view, self.skip(_U64.size))
        return name, _CODE_DATATYPES[code], tuple(shape), nbytes
