"""A worker process's client shared-memory regions (`--workers N`): the engine process holds the
one registry (engine/regions.py), so a region registered through any worker is usable through
all; each worker mirrors it and reads and writes the files itself, in the process that reads
them.

Register, unregister and status are calls to the engine process (it opens and checks the file,
and bounds each tenant); a change is pushed at once to every worker in the engine's state, with
the table of regions (`SystemRegions.table`). Before a read or write, a worker brings its
mirror up to that table: it opens each new region's file by name, under the same checks, and
keeps it only if it is the very file the engine registered (same device and inode: a file
swapped under the name since is refused), and drops the regions that are gone (a read under
way keeps its file open until it ends, as in the engine). A worker's key-file reload passes the
keys it serves now to the engine, which drops what revoked keys registered.

CUDA regions are not served with workers: each worker would open every client's IPC handle
itself, and so hold a CUDA context (hundreds of MiB of device memory) per worker, in processes
meant for parsing. Registering one is refused saying so (WORKERS_NO_CUDA); none is ever listed,
and unregistering a name is RegionNotFound, as for any unknown region."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable, Collection, Coroutine, Mapping
from pathlib import Path
from typing import Any

from engine.cuda_regions import NO_CUDA, CudaRegions
from engine.errors import InvalidInput
from engine.regions import SHM_FOLDER, Region, SystemRegions
from engine.settings import SharedMemorySettings
from engine.types import SharedTensor

WORKERS_NO_CUDA = (
    f"{NO_CUDA} in the process that reads requests, which --workers N > 1 does not give: serve "
    "CUDA shared memory with one worker, or pass tensors through system shared memory"
)
"""Why a `--workers` worker registers no CUDA region (the module docstring says why)."""

Call = Callable[..., Coroutine[Any, Any, Any]]
"""`RemoteControl.call`: the engine's answer to `method(*args)`."""


class WorkerRegions(SystemRegions):
    """The engine process's regions, mirrored in this worker (see the module docstring).
    `call` asks the engine; `state` is the engine's latest pushed state; `adopt` takes a state
    a call answered with (and calls `follow`, as a pushed state does)."""

    def __init__(
        self,
        settings: SharedMemorySettings,
        call: Call,
        state: Callable[[], Mapping[str, Any]],
        adopt: Callable[[dict[str, Any]], None],
        folder: Path = SHM_FOLDER,
    ) -> None:
        super().__init__(settings, folder)
        self.cuda = CudaRegions(self._lock, self._room, self.require_enabled, WORKERS_NO_CUDA)
        self._call, self._state, self._adopt = call, state, adopt
        self._synced: object = None
        self._broken: dict[tuple[str, str], str] = {}  # regions this worker could not open
        self._tasks: set[asyncio.Task[Any]] = set()
        self._following = threading.Lock()  # one thread brings the mirror up at a time

    async def register(
        self, tenant: str, key_name: str | None, name: str, key: str, offset: Any, byte_size: Any
    ) -> None:
        self.require_enabled()
        self._adopt(
            await self._call("shm_register", tenant, key_name, name, key, offset, byte_size)
        )

    async def unregister(self, tenant: str, name: str | None) -> None:
        self.require_enabled()
        self._adopt(await self._call("shm_unregister", tenant, name))

    async def status(self, tenant: str, name: str | None) -> list[dict[str, Any]]:
        self.require_enabled()
        rows: list[dict[str, Any]] = await self._call("shm_status", tenant, name)
        return rows

    def keep_keys(self, key_names: Collection[str | None]) -> None:
        if not self.settings.enabled:
            return
        task = asyncio.get_running_loop().create_task(
            self._call("shm_keep_keys", sorted(n for n in key_names if n is not None))
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _lease(self, tenant: str, ref: SharedTensor, nbytes: int, what: str) -> Region:
        self._follow()
        broken = self._broken.get((tenant, ref.region))
        if broken is not None:
            raise InvalidInput(f"{what}: region '{ref.region}' cannot be read here: {broken}")
        return super()._lease(tenant, ref, nbytes, what)

    def follow(self) -> None:
        """Bring the mirror up to the engine's latest table of regions: when a state arrives
        (so a region dropped in the engine closes here at once) and before each use."""
        self._follow()

    def _follow(self) -> None:
        table = self._state().get("shm_regions")
        if table is self._synced:
            return
        with self._following:
            if table is not self._synced:
                self._follow_table(table or [])

    def _follow_table(self, table: list[list[Any]]) -> None:
        wanted = {(row[0], row[2]): row for row in table}
        with self._lock:
            stale = [k for k, r in self._regions.items() if _record(r) != wanted.get(k)]
            gone = [self._regions.pop(key) for key in stale]
            self._broken = {key: why for key, why in self._broken.items() if key in wanted}
        self._drop(gone)
        for key, row in wanted.items():
            if key not in self._regions and key not in self._broken:
                self._mirror(row)
        self._synced = table

    def _mirror(self, row: list[Any]) -> None:
        tenant, key_name, name, key, offset, byte_size, device, inode = row
        try:
            fd, writable = self._open(name, key)
        except InvalidInput as exc:  # unlinked or replaced since it was registered
            self._broken[tenant, name] = exc.message
            return
        region = Region(name, key, offset, byte_size, fd, writable)
        if region.identity != (device, inode):
            os.close(fd)
            self._broken[tenant, name] = f"'{key}' is no longer the file that was registered"
            return
        region.tenant, region.key_name = tenant, key_name
        with self._lock:
            self._regions[tenant, name] = region


def _record(region: Region) -> list[Any]:
    """A mirrored region as the engine's table lists it."""
    identity = list(region.identity)
    return [
        region.tenant,
        region.key_name,
        region.name,
        region.key,
        region.offset,
        region.byte_size,
        *identity,
    ]
