"""An arena: one anonymous memory file (memfd) mapped read-write, shared by the processes
forked after it was made; the buffers over its slots, and the watcher that says when no array
views a slot any more."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import mmap
import os
import threading
import weakref
from collections.abc import Callable


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
