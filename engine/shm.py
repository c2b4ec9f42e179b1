"""The shared-memory arena that carries tensors between a worker process and the engine process.

Each worker has two arenas, anonymous memory files (memfd) created by the supervisor before it
forks the engine and the workers, so both sides map the same pages and nothing is left behind in
/dev/shm when a process dies:

    in-arena   the worker allocates a slot per request and writes the decoded inputs into it once;
               the engine views them in place (np.ndarray over the mapping) and the batcher's
               concatenation reads them from there. The engine says when a slot is free again:
               when the last array viewing it is gone, not when the answer is sent (a batch
               still running may read a cancelled request's inputs).
    out-arena  the engine allocates a slot per answer and writes the outputs into it once; the
               worker views them in place while it encodes the response, then frees the slot.

A slot holds its tensors back to back, each at a 64-byte aligned offset. A numeric tensor is its
C-contiguous bytes; a BYTES tensor is Triton's layout (a 4-byte little-endian length before each
element), decoded back into a numpy object array on the other side (the only copy: Python bytes
objects cannot live in shared memory). The descriptors that say where each tensor lies travel in
the control message (engine/wire.py), never the data.

Bounds: an arena is `workers_arena_bytes` (per worker, per direction). A request whose inputs do
not fit in the free space is answered Overloaded (503 with Retry-After) at once; one that could
never fit is PayloadTooLarge (413); no request ever waits for space."""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import ctypes
import mmap
import os
import struct
import threading
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from engine import errors
from engine.datatypes import MAX_DIMS

ALIGN = 64
"""Every tensor starts at a multiple of this many bytes (cache lines; SIMD loads)."""

NUMERIC_KINDS = frozenset("biuf")
"""dtype kinds a descriptor may name: bool, signed and unsigned ints, floats."""

_LENGTH = struct.Struct("<I")

Buffer = memoryview | bytearray | ctypes.Array[ctypes.c_char]


def _aligned(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


class Arena:
    """One shared region: a memfd mapped read-write. `fd` is inherited by forked processes."""

    def __init__(self, size_bytes: int, fd: int | None = None) -> None:
        if fd is None:
            fd = os.memfd_create("sluice-arena", os.MFD_CLOEXEC)
            os.ftruncate(fd, size_bytes)
        self.fd = fd
        self.size_bytes = size_bytes
        self._map = mmap.mmap(fd, size_bytes)
        self.buf = memoryview(self._map)

    def slot(self, offset: int, size: int) -> ctypes.Array[ctypes.c_char]:
        """A buffer over `[offset, offset + size)` that arrays viewing it keep as their `base`
        (numpy would see through a memoryview to the mapping), so a weakref on it says when the
        last of them is gone."""
        if offset < 0 or size < 0 or offset + size > self.size_bytes:
            raise ValueError(f"slot {offset}+{size} lies outside the {self.size_bytes} byte arena")
        return (ctypes.c_char * size).from_buffer(self._map, offset)

    def close(self) -> None:
        """Unmap (every view into it must be gone) and close the file."""
        self.buf.release()
        self._map.close()
        os.close(self.fd)


class Allocator:
    """First-fit allocation of aligned slots in `[0, size_bytes)`, with coalescing frees. Owned
    by one process; the other side only reads or writes the slots it is told about.

    A freed slot is kept aside by its size and given to the next request of that size (most
    requests of a model take the same size), with no search or coalescing: 0.3 µs less an
    alloc and free. The slots kept aside go back into the free list, coalesced, whenever no
    free slot fits, so a request is refused only when the arena could not hold it."""

    def __init__(self, size_bytes: int) -> None:
        self.size_bytes = size_bytes
        self._free: list[tuple[int, int]] = [(0, size_bytes)]  # (offset, size), sorted, disjoint
        self._used: dict[int, int] = {}  # offset -> size
        self._spare: dict[int, list[int]] = {}  # size -> offsets freed, not in _free yet

    @property
    def used_bytes(self) -> int:
        return sum(self._used.values())

    @property
    def slots(self) -> int:
        return len(self._used)

    def alloc(self, nbytes: int) -> int | None:
        """The offset of a free slot of at least `nbytes`, or None when none is free."""
        size = (nbytes + ALIGN - 1) // ALIGN * ALIGN if nbytes > ALIGN else ALIGN
        spare = self._spare.get(size)
        if spare:
            offset = spare.pop()
            self._used[offset] = size
            return offset
        found = self._first_fit(size)
        if found is None and self._spare:
            self._merge_spares()
            found = self._first_fit(size)
        return found

    def _first_fit(self, size: int) -> int | None:
        for index, (offset, free) in enumerate(self._free):
            if free >= size:
                if free == size:
                    del self._free[index]
                else:
                    self._free[index] = (offset + size, free - size)
                self._used[offset] = size
                return offset
        return None

    def reserve(self, offset: int, nbytes: int) -> None:
        """Mark a slot taken that another process of this arena still holds (a restarted
        worker learns which of its predecessor's slots the engine still reads)."""
        self._merge_spares()
        size = max(_aligned(nbytes), ALIGN)
        for index, (start, free) in enumerate(self._free):
            if start <= offset and offset + size <= start + free:
                pieces = [(start, offset - start), (offset + size, start + free - offset - size)]
                self._free[index : index + 1] = [p for p in pieces if p[1] > 0]
                self._used[offset] = size
                return
        raise ValueError(f"slot at {offset} ({size} bytes) is not free")

    def free(self, offset: int) -> None:
        """Return a slot; an offset that is not allocated is an error (a double free)."""
        size = self._used.pop(offset, None)
        if size is None:
            raise ValueError(f"no slot is allocated at offset {offset}")
        spare = self._spare.get(size)
        if spare is None:
            self._spare[size] = [offset]
        else:
            spare.append(offset)

    def _merge_spares(self) -> None:
        """Put every slot kept aside back into the free list, coalesced."""
        for size, offsets in self._spare.items():
            for offset in offsets:
                self._release(offset, size)
        self._spare.clear()

    def _release(self, offset: int, size: int) -> None:
        index = bisect.bisect(self._free, (offset, size))
        if index < len(self._free) and self._free[index][0] == offset + size:
            size += self._free.pop(index)[1]
        if index > 0 and sum(self._free[index - 1]) == offset:
            index -= 1
            offset, size = self._free[index][0], self._free[index][1] + size
            self._free.pop(index)
        self._free.insert(index, (offset, size))

    def reset(self) -> None:
        """Free everything (the process that read the slots is gone)."""
        self._free = [(0, self.size_bytes)]
        self._used.clear()
        self._spare.clear()


class SlotWatcher:
    """Calls `release(offset)` on the event loop's thread once no array views a slot any more
    (the last one may be dropped in any thread, e.g. a backend's). In the loop's own thread it
    calls at once: `call_soon_threadsafe` would cost a wake-up write per request."""

    def __init__(self, loop: asyncio.AbstractEventLoop, release: Callable[[int], None]) -> None:
        self._loop = loop
        self._thread = threading.get_ident()
        self._release = release
        self._refs: dict[int, weakref.ref[object]] = {}

    def watch(self, slot: object, offset: int) -> None:
        self._refs[offset] = weakref.ref(slot, lambda _: self._gone(offset))

    def _gone(self, offset: int) -> None:
        self._refs.pop(offset, None)
        if self._loop.is_closed():  # the process is exiting: nothing left to tell
            return
        if threading.get_ident() == self._thread:
            self._release(offset)
        else:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: exiting
                self._loop.call_soon_threadsafe(self._release, offset)


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
            total += _aligned(sum(4 + len(b) for b in _bytes_layout(array)[1::2]))
        else:
            total += (array.nbytes + ALIGN - 1) // ALIGN * ALIGN  # _aligned, without its call
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
            at += _aligned(len(data))
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


WRITE_OFF_LOOP_BYTES = 1 << 20
"""Tensors larger than this are copied into an arena in a worker thread, not on the loop."""


def place_now(
    allocator: Allocator, arena: Arena, arrays: Mapping[str, np.ndarray], size: int, what: str
) -> tuple[int, list[Descriptor]]:
    """`place_tensors` without a coroutine (~0.5 µs a side of a request's crossing), for a slot
    of `size` bytes (slot_bytes) of at most WRITE_OFF_LOOP_BYTES: its offset and descriptors."""
    offset = _take(allocator, size, what)
    try:
        described = write_tensors(arena.buf, offset, arrays)
    except BaseException:
        allocator.free(offset)
        raise
    return offset, described


def _take(allocator: Allocator, size: int, what: str) -> int:
    """A slot of `size` bytes, or why none is given: PayloadTooLarge when that exceeds the whole
    arena, Overloaded when it has no room now (a full arena is a quick 503, never a wait)."""
    offset = allocator.alloc(size) if size <= allocator.size_bytes else None
    if offset is not None:
        return offset
    if size > allocator.size_bytes:
        raise errors.PayloadTooLarge(
            size,
            allocator.size_bytes,
            message=f"the tensors take {size} bytes, more than all of {what} holds "
            f"({allocator.size_bytes} bytes, the setting worker_arena_bytes)",
        )
    raise errors.Overloaded(
        f"{what} is full ({allocator.used_bytes} of {allocator.size_bytes} bytes in use); "
        "retry shortly"
    )


async def place_tensors(
    allocator: Allocator,
    arena: Arena,
    arrays: Mapping[str, np.ndarray],
    what: str,
    size: int | None = None,
) -> tuple[int, int, list[Descriptor]]:
    """`arrays` written into a new slot of `arena` (`size` bytes, slot_bytes when not given):
    its offset, size and the tensors' descriptions (see `_take` for the errors). Tensors larger
    than WRITE_OFF_LOOP_BYTES are copied in a worker thread."""
    if size is None:
        size = slot_bytes(arrays)
    if size <= WRITE_OFF_LOOP_BYTES:
        offset, described = place_now(allocator, arena, arrays, size, what)
        return offset, size, described
    offset = _take(allocator, size, what)
    copy = asyncio.ensure_future(asyncio.to_thread(write_tensors, arena.buf, offset, arrays))
    try:
        described = await asyncio.shield(copy)
    except BaseException:
        # Cancelled (the client left) while the thread may still be writing into the slot: it
        # is free once the thread is done, not before (the next request would be given it).
        copy.add_done_callback(lambda done: _free_after(done, allocator, offset))
        raise
    return offset, size, described


def _free_after(copy: asyncio.Future[Any], allocator: Allocator, offset: int) -> None:
    if not copy.cancelled():
        copy.exception()  # a failed copy was raised to the caller already (or nobody is left)
    allocator.free(offset)
