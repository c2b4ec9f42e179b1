"""Client shared memory: the regions same-host clients register through Triton's system
shared-memory extension, and the reads and writes of tensors that requests name in them.

A region is a file directly in /dev/shm (what POSIX `shm_open(key)` makes, as tritonclient's
`tritonclient.utils.shared_memory` does), opened once at registration:

- only a plain name under the folder is opened (no path separator, not `.` or `..`), relative
  to the folder's own descriptor and with O_NOFOLLOW, so no symlink or path leads elsewhere;
  O_NONBLOCK keeps a FIFO planted there from blocking the open, and fstat then accepts only a
  regular file owned by the server's own user (not another service's files);
- `offset + byte_size` must lie within the file, and a tenant holds at most
  `max_regions_per_tenant` regions spanning at most `max_bytes_per_tenant` bytes;
- each region belongs to the tenant that registered it: names are per tenant, so another
  tenant's region is unknown (RegionNotFound) and never listed; a file one tenant registered
  cannot be registered by another (that would read its tensors);
- a region is dropped when the key that registered it is revoked (`keep_keys`).

Tensors are copied with pread/pwrite on the region's descriptor, never through a mapping: the
client owns the file and may truncate it at any moment, and touching a mapped page past the end
of a truncated file raises SIGBUS, which kills the server. A read of a shrunk file comes up
short and is refused (InvalidInput naming the region); no fault is possible. The descriptor is
reference-counted: unregistering a region while a request reads it closes the file only after
that read, so its number is never reused under the read (which would read another file's bytes).
The one copy replaces the socket read and decode a tensor in the request body costs.

With `--workers N` this registry lives in the engine process and every worker mirrors it
(server/link/remote_regions.py), reading and writing the files itself.

CUDA regions (Triton's CUDA shared-memory extension) are `cuda`, engine/cuda_regions.py: the
same switch, one lock, one namespace of names and one bound per tenant for both kinds; a tensor
naming a CUDA region is read and written there.
"""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from engine.cuda_regions import CudaRegions
from engine.errors import Forbidden, InvalidInput
from engine.region_table import RegionTable
from engine.settings import SharedMemorySettings
from engine.types import SharedTensor

SHM_FOLDER = Path("/dev/shm")
"""Where POSIX shared-memory objects live on Linux: the only folder a key may name a file in."""

MAX_NAME_CHARS = 256
"""The longest region name (a name is the client's label; keys are bounded by NAME_MAX)."""

DISABLED = (
    "system shared memory is off on this server; an operator turns it on with the setting "
    "shared_memory.enabled (SLUICE_SHARED_MEMORY__ENABLED=true)"
)

_OPEN_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY


def shared_tensor(
    parameters: Mapping[str, Any], where: str, shape: tuple[int, ...] = ()
) -> SharedTensor | None:
    """The region a tensor's parameters name, or None when they name none; InvalidInput for a
    malformed one (`where` names the tensor: "input 'x'"; `shape`: an input's declared one)."""
    region = parameters.get("shared_memory_region")
    size = parameters.get("shared_memory_byte_size")
    offset = parameters.get("shared_memory_offset", 0)
    if region is None:
        if size is not None or "shared_memory_offset" in parameters:
            raise InvalidInput(
                f"{where}: shared_memory_byte_size and shared_memory_offset need "
                "shared_memory_region"
            )
        return None
    if not isinstance(region, str) or not region:
        raise InvalidInput(f"{where}: shared_memory_region must be a non-empty string")
    if size is None:
        raise InvalidInput(f"{where}: shared_memory_region needs shared_memory_byte_size")
    for key, value in (("shared_memory_byte_size", size), ("shared_memory_offset", offset)):
        if type(value) is not int or value < 0:
            raise InvalidInput(f"{where}: {key} must be an integer >= 0, got {value!r:.40}")
    return SharedTensor(region, offset, size, shape)


class Region:
    """One registered region: its open file and who registered it. `users` counts the reads
    and writes under way; the file closes when the region is dropped and none is left."""

    def __init__(
        self, name: str, key: str, offset: int, byte_size: int, fd: int, writable: bool
    ) -> None:
        self.name, self.key, self.offset, self.byte_size = name, key, offset, byte_size
        self.fd, self.writable = fd, writable
        info = os.fstat(fd)
        self.identity = info.st_dev, info.st_ino
        self.tenant = ""
        self.key_name: str | None = None
        self.users = 0
        self.dropped = False

    def status(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "key": self.key,
            "offset": self.offset,
            "byte_size": self.byte_size,
        }


class SystemRegions(RegionTable[Region]):
    """The registered regions of every tenant, in this process. Thread-safe: tensors are read
    and written in worker threads when large."""

    def __init__(self, settings: SharedMemorySettings, folder: Path = SHM_FOLDER) -> None:
        self.settings = settings
        self.folder = folder
        self._regions: dict[tuple[str, str], Region] = {}  # (tenant, name) -> region
        self._lock = threading.Lock()
        self.cuda = CudaRegions(self._lock, self._room, self.require_enabled)

    @property
    def enabled(self) -> bool:
        return self.settings.enabled

    def require_enabled(self) -> None:
        """Forbidden, saying how to turn it on, while the extension is off."""
        if not self.settings.enabled:
            raise Forbidden(DISABLED)

    # -- registration ----------------------------------------------------------------------------

    async def register(
        self, tenant: str, key_name: str | None, name: str, key: str, offset: Any, byte_size: Any
    ) -> None:
        """Register file `key` of the folder as region `name` of `tenant` (`key_name`: the API
        key that registers it; the region goes when that key is revoked)."""
        self.require_enabled()
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS:
            raise InvalidInput(f"a region name is 1 to {MAX_NAME_CHARS} characters")
        for field, value in (("offset", offset), ("byte_size", byte_size)):
            if type(value) is not int or value < 0:
                raise InvalidInput(
                    f"region '{name}': {field} must be an integer >= 0, got {value!r:.40}"
                )
        if byte_size == 0:
            raise InvalidInput(f"region '{name}': byte_size must be at least 1")
        fd, writable = self._open(name, key)
        try:
            region = Region(name, key, offset, byte_size, fd, writable)
            size = os.fstat(fd).st_size
            if offset + byte_size > size:
                raise InvalidInput(
                    f"region '{name}': offset {offset} + byte_size {byte_size} passes the end "
                    f"of '{key}', which holds {size} bytes"
                )
            region.tenant, region.key_name = tenant, key_name
            with self._lock:
                self._admit(region)
        except BaseException:
            os.close(fd)
            raise

    def _open(self, name: str, key: str) -> tuple[int, bool]:
        """The file `key` names in the folder, opened read-write (read-only when the server may
        only read it), after every check of the module docstring."""
        if not isinstance(key, str):
            raise InvalidInput(f"region '{name}': key must be a string")
        plain = key[1:] if key.startswith("/") else key
        if not plain or plain in (".", "..") or "/" in plain or "\0" in plain or len(plain) > 255:
            raise InvalidInput(
                f"region '{name}': key {key!r:.80} must name a file directly in {self.folder} "
                "('/name', as shm_open takes it: no other '/', not '.' or '..')"
            )
        folder = os.open(self.folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            try:
                fd, writable = os.open(plain, os.O_RDWR | _OPEN_FLAGS, dir_fd=folder), True
            except PermissionError:
                fd, writable = os.open(plain, os.O_RDONLY | _OPEN_FLAGS, dir_fd=folder), False
        except FileNotFoundError:
            raise InvalidInput(f"region '{name}': no file '{plain}' in {self.folder}") from None
        except OSError as exc:  # ELOOP: a symlink; EACCES; ENXIO: a socket or FIFO
            raise InvalidInput(
                f"region '{name}': cannot open '{plain}' in {self.folder} (a regular file "
                f"owned by the server's user, not a link): {exc.strerror}"
            ) from None
        finally:
            os.close(folder)
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            os.close(fd)
            raise InvalidInput(
                f"region '{name}': '{plain}' in {self.folder} is not a regular file owned by the "
                "server's user"
            )
        return fd, writable

    def _room(self, tenant: str, name: str, byte_size: int) -> None:
        """InvalidInput unless `tenant` may add region `name` of `byte_size` bytes: a name no
        region of either kind holds, within the bounds both kinds count against (under the
        lock)."""
        limits = self.settings
        held = {n: r.byte_size for (owner, n), r in self._regions.items() if owner == tenant}
        held.update(self.cuda.held(tenant))
        if name in held:
            raise InvalidInput(f"region '{name}' is already registered; unregister it first")
        if len(held) >= limits.max_regions_per_tenant:
            raise InvalidInput(
                f"tenant '{tenant}' holds {len(held)} regions, the most "
                "shared_memory.max_regions_per_tenant allows; unregister one first"
            )
        spanned = sum(held.values())
        if spanned + byte_size > limits.max_bytes_per_tenant:
            raise InvalidInput(
                f"tenant '{tenant}' has regions of {spanned} bytes; {byte_size} more "
                f"passes shared_memory.max_bytes_per_tenant ({limits.max_bytes_per_tenant})"
            )

    def _admit(self, region: Region) -> None:
        """Add `region` under the lock, within the tenant's bounds."""
        tenant = region.tenant
        self._room(tenant, region.name, region.byte_size)
        for other in self._regions.values():
            if other.identity == region.identity and other.tenant != tenant:
                raise InvalidInput(
                    f"region '{region.name}': '{region.key}' is registered by another tenant"
                )
        self._regions[tenant, region.name] = region

    def keep_keys(self, key_names: Collection[str | None]) -> None:
        super().keep_keys(key_names)
        self.cuda.keep_keys(key_names)

    def close(self) -> None:
        super().close()
        self.cuda.close()

    def table(self) -> list[list[Any]]:
        """Every region as `[tenant, key_name, name, key, offset, byte_size, device, inode]`:
        what a worker process mirrors (server/link/remote_regions.py)."""
        with self._lock:
            return [
                [r.tenant, r.key_name, r.name, r.key, r.offset, r.byte_size, *r.identity]
                for r in self._regions.values()
            ]

    def _drop(self, regions: list[Region]) -> None:
        with self._lock:  # a read's release may close the file too: one of them does
            for region in regions:
                region.dropped = True
                if region.users == 0:
                    os.close(region.fd)

    def _release(self, region: Region) -> None:
        with self._lock:
            region.users -= 1
            if region.dropped and region.users == 0:
                os.close(region.fd)

    def read(self, tenant: str, ref: SharedTensor, what: str) -> bytearray:
        """`ref.byte_size` bytes of `tenant`'s region, copied out with pread (or from the
        device, for a CUDA region)."""
        if self.cuda.holds(tenant, ref.region):
            return self.cuda.read(tenant, ref, what)
        region = self._lease(tenant, ref, ref.byte_size, what)
        try:
            data = bytearray(ref.byte_size)
            view = memoryview(data)
            start = region.offset + ref.offset
            done = 0
            while done < ref.byte_size:  # pread may return less than asked; 0 at the end
                got = os.preadv(region.fd, [view[done:]], start + done)
                if got == 0:
                    raise InvalidInput(
                        f"{what}: region '{ref.region}' ends after {done} of its {ref.byte_size} "
                        f"bytes at offset {ref.offset}: its file '{region.key}' was truncated"
                    )
                done += got
            return data
        finally:
            self._release(region)

    def write(self, tenant: str, ref: SharedTensor, data: memoryview, what: str) -> None:
        """`data` into `tenant`'s region at `ref.offset`; InvalidInput when it does not fit the
        `ref.byte_size` the request gave, the region, or the file as it is now."""
        if self.cuda.holds(tenant, ref.region):
            return self.cuda.write(tenant, ref, data, what)
        if data.nbytes > ref.byte_size:
            raise InvalidInput(
                f"{what} takes {data.nbytes} bytes; shared_memory_byte_size is {ref.byte_size}"
            )
        region = self._lease(tenant, ref, data.nbytes, what)
        try:
            if not region.writable:
                raise InvalidInput(f"{what}: the server may only read region '{ref.region}'")
            start = region.offset + ref.offset
            if os.fstat(region.fd).st_size < start + data.nbytes:  # never grow the client's file
                raise InvalidInput(
                    f"{what}: region '{ref.region}' was truncated below its registered size"
                )
            done = 0
            flat = data.cast("B") if data.nbytes else data
            while done < data.nbytes:
                done += os.pwritev(region.fd, [flat[done:]], start + done)
        finally:
            self._release(region)
