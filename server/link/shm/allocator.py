"""Which slots of an arena are taken: first-fit allocation of aligned byte ranges, with freed
slots kept aside by size for the next request of that size."""

from __future__ import annotations

import bisect

from server.link.shm.layout import ALIGN, aligned


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
        size = max(aligned(nbytes), ALIGN)
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
