"""What the two kinds of shared-memory region share (engine/regions.py: files in /dev/shm;
engine/cuda_regions.py: CUDA IPC handles): each kind keeps its tenants' regions by (tenant,
name) under one lock, leases a region to a tensor's read or write (its bounds checked, its use
counted), lists a tenant's regions as Triton does, and drops regions on unregister, on a revoked
key and at shutdown. How a region is dropped (a file closed, a mapping given back once unused)
is each kind's own `_drop`, called outside the lock."""

from __future__ import annotations

import threading
from collections.abc import Collection, Mapping
from typing import Any, Generic, Protocol, TypeVar

from engine.errors import InvalidInput, RegionNotFound
from engine.types import SharedTensor


class Leased(Protocol):
    """What a region of either kind holds that this module reads."""

    byte_size: int
    users: int
    key_name: str | None

    def status(self) -> dict[str, Any]:
        """The region as Triton's status lists it."""
        ...


R = TypeVar("R", bound=Leased)


def lease(
    lock: threading.Lock,
    regions: Mapping[tuple[str, str], R],
    tenant: str,
    ref: SharedTensor,
    nbytes: int,
    what: str,
) -> R:
    """The tenant's region `ref` names, its use counted, once `nbytes` from `ref.offset` lie
    within the region as registered (system and CUDA regions alike)."""
    with lock:
        region = regions.get((tenant, ref.region))
        if region is None:
            raise RegionNotFound(ref.region)
        if ref.offset + nbytes > region.byte_size:
            raise InvalidInput(
                f"{what}: {nbytes} bytes at shared_memory_offset {ref.offset} pass the end "
                f"of region '{ref.region}' ({region.byte_size} bytes)"
            )
        region.users += 1
        return region


class RegionTable(Generic[R]):
    """The regions of one kind by (tenant, name), under `_lock` (see the module docstring)."""

    _lock: threading.Lock
    _regions: dict[tuple[str, str], R]

    def require_enabled(self) -> None:
        """Raise while the extension is off."""
        raise NotImplementedError

    def _drop(self, regions: list[R]) -> None:
        """Give back what `regions`, taken out of the table, hold (outside the lock)."""
        raise NotImplementedError

    async def unregister(self, tenant: str, name: str | None) -> None:
        """Drop `tenant`'s region `name`, or all its regions when `name` is None or empty."""
        self.require_enabled()
        with self._lock:
            if name:
                region = self._regions.pop((tenant, name), None)
                if region is None:
                    raise RegionNotFound(name)
                gone = [region]
            else:
                gone = [self._regions.pop(key) for key in list(self._regions) if key[0] == tenant]
        self._drop(gone)

    async def status(self, tenant: str, name: str | None) -> list[dict[str, Any]]:
        """`tenant`'s regions (its region `name` only, when given), as Triton lists them."""
        self.require_enabled()
        with self._lock:
            if name:
                region = self._regions.get((tenant, name))
                if region is None:
                    raise RegionNotFound(name)
                return [region.status()]
            return [r.status() for (owner, _), r in self._regions.items() if owner == tenant]

    def keep_keys(self, key_names: Collection[str | None]) -> None:
        """Drop the regions registered by a key not in `key_names` (it was revoked)."""
        with self._lock:
            keys = [k for k, r in self._regions.items() if r.key_name not in key_names]
            gone = [self._regions.pop(key) for key in keys]
        self._drop(gone)

    def close(self) -> None:
        """Drop every region (at shutdown)."""
        with self._lock:
            gone = list(self._regions.values())
            self._regions.clear()
        self._drop(gone)

    def count(self, tenant: str | None = None) -> int:
        """Regions registered (by `tenant`, when given)."""
        with self._lock:
            return sum(1 for owner, _ in self._regions if tenant in (None, owner))

    def _lease(self, tenant: str, ref: SharedTensor, nbytes: int, what: str) -> R:
        """The region `ref` names, its use counted, once `nbytes` from `ref.offset` lie within
        the region as registered."""
        self.require_enabled()
        return lease(self._lock, self._regions, tenant, ref, nbytes, what)
