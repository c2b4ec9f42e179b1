"""Client CUDA shared memory: the regions same-host clients register through Triton's CUDA
shared-memory extension (device memory they allocated, passed as the 64-byte CUDA IPC handle
`cudaIpcGetMemHandle` gave, with its device and size), and the copies of the tensors requests
name in them.

Registration checks everything it can before any CUDA call (the name, the handle's length, a
`device_id` and `byte_size` > 0, the tenant's bounds, which count its system regions too, and a
name no region of either kind holds: Triton's two kinds share one namespace). Then it opens the
handle on that device with `cudaIpcOpenMemHandle(cudaIpcMemLazyEnablePeerAccess)` and asks the
driver how large the mapped allocation is (`cuMemGetAddressRange`): a `byte_size` past it is
refused, so every later copy lies within memory the client exported, never in a neighbouring
allocation of the server's. Without cuda-python or a device, registering answers why (nothing is
ever registered, so status lists nothing and unregistering a name is RegionNotFound).

Each region belongs to its tenant, as a system region does: another tenant's is unknown, and a
handle one tenant registered cannot be registered by another, on any device. The same handle
registered under two names by one tenant is opened once per device and shared: the mapping
closes with `cudaIpcCloseMemHandle` when the last region using it is dropped and no copy uses
it any more.

Tensors are copied with `cudaMemcpy`: DeviceToHost into host memory for the CPU backends (a GPU
backend could take the device pointer as it is, without the copy, but no backend here takes
device inputs yet), HostToDevice for outputs. Each offset and size is bounds-checked against the
region first, and the copy is counted, so an unregister under way closes the mapping after it.

With `--workers N` each worker process would have to open every handle itself (a CUDA context
per worker, hundreds of MiB of device memory each): registering is refused there, saying so."""

from __future__ import annotations

import asyncio
import ctypes
import logging
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from engine.backends.cuda import IPC_HANDLE_BYTES, Cuda, allocation_range, load_driver
from engine.backends.cuda import load_runtime as _load_runtime
from engine.errors import BackendError, InvalidInput
from engine.region_table import RegionTable
from engine.types import SharedTensor

log = logging.getLogger("sluice.engine")

NO_CUDA = "CUDA shared memory needs cuda-python and a CUDA device"
"""How every refusal to register for want of CUDA begins."""

MAX_NAME_CHARS = 256

Room = Callable[[str, str, int], None]
"""`(tenant, name, byte_size)`: raises InvalidInput unless the tenant may hold one more region
of that name and size (called under the registry's lock)."""


class _Mapping:
    """One opened IPC handle: its device pointer, and the regions using it."""

    def __init__(self, device: int, handle: bytes, ptr: int, size: int) -> None:
        self.device, self.handle, self.ptr, self.size = device, handle, ptr, size
        self.regions = 0


class CudaRegion:
    """One registered CUDA region; `users` counts the copies under way."""

    def __init__(
        self, name: str, tenant: str, key_name: str | None, byte_size: int, mapping: _Mapping
    ) -> None:
        self.name, self.tenant, self.key_name = name, tenant, key_name
        self.byte_size, self.mapping = byte_size, mapping
        self.users = 0
        self.dropped = False
        self.closed = False  # its share of the mapping given back

    def status(self) -> dict[str, Any]:
        return {"name": self.name, "device_id": self.mapping.device, "byte_size": self.byte_size}


class CudaRegions(RegionTable[CudaRegion]):
    """Every tenant's CUDA regions, in this process. `lock` is the system regions' (one lock
    for both kinds, so their shared names and bounds are checked at once); `room` checks them;
    `require_enabled` raises while the extensions are off (engine/regions.py owns all three).
    `refusal`, when set, is why this process registers none (a `--workers` worker)."""

    def __init__(
        self,
        lock: threading.Lock,
        room: Room,
        require_enabled: Callable[[], None],
        refusal: str | None = None,
        load_runtime: Callable[[], Any] = _load_runtime,
    ) -> None:
        self._lock, self._room, self._refusal = lock, room, refusal
        self._require_enabled = require_enabled
        self._load_runtime = load_runtime
        self._regions: dict[tuple[str, str], CudaRegion] = {}
        self._mappings: dict[tuple[int, bytes], _Mapping] = {}
        self._opening = threading.Lock()  # one registration opens handles at a time
        self._cuda: Cuda | None = None
        self._driver: Any = None
        self._devices = 0

    def require_enabled(self) -> None:
        self._require_enabled()

    # -- registration ----------------------------------------------------------------------------

    async def register(
        self,
        tenant: str,
        key_name: str | None,
        name: str,
        handle: Any,
        device_id: Any,
        byte_size: Any,
    ) -> None:
        """Open `handle` (the raw IPC handle bytes) on device `device_id` as `tenant`'s region
        `name` of `byte_size` bytes (the module docstring lists the checks)."""
        self.require_enabled()
        if self._refusal is not None:
            raise InvalidInput(self._refusal)
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS:
            raise InvalidInput(f"a region name is 1 to {MAX_NAME_CHARS} characters")
        if not isinstance(handle, bytes) or len(handle) != IPC_HANDLE_BYTES:
            got = len(handle) if isinstance(handle, bytes) else type(handle).__name__
            raise InvalidInput(
                f"region '{name}': raw_handle must be the {IPC_HANDLE_BYTES} bytes of a "
                f"cudaIpcMemHandle_t, got {got}"
            )
        for field, value, least in (("device_id", device_id, 0), ("byte_size", byte_size, 1)):
            if type(value) is not int or value < least:
                raise InvalidInput(
                    f"region '{name}': {field} must be an integer >= {least}, got {value!r:.40}"
                )
        with self._lock:
            self._room(tenant, name, byte_size)
        # In a worker thread: loading cuda-python and opening a handle take milliseconds.
        await asyncio.to_thread(self._open, tenant, key_name, name, handle, device_id, byte_size)

    def _runtime(self) -> Cuda:
        """The checked runtime, loaded at the first registration; InvalidInput saying why not."""
        if self._cuda is None:
            try:
                cuda = Cuda(self._load_runtime())
                driver = load_driver()
            except ImportError as exc:
                raise InvalidInput(
                    f"{NO_CUDA}: cuda-python is not installed ({exc}); pass tensors through "
                    "system shared memory (/v2/systemsharedmemory) or in the request"
                ) from None
            devices = cuda.device_count()
            if devices == 0:
                raise InvalidInput(f"{NO_CUDA}: {cuda.no_device}")
            self._cuda, self._driver, self._devices = cuda, driver, devices
        return self._cuda

    def _open(
        self,
        tenant: str,
        key_name: str | None,
        name: str,
        handle: bytes,
        device: int,
        byte_size: int,
    ) -> None:
        """Open (or share) the mapping and add the region; in a worker thread. One registration
        at a time: between the ownership check and the region's adding, no other may come."""
        with self._opening:
            cuda = self._runtime()
            if device >= self._devices:
                raise InvalidInput(
                    f"region '{name}': device_id {device} is not a CUDA device of this server "
                    f"(it has {self._devices}: 0 to {self._devices - 1})"
                )
            with self._lock:
                # On any device: opened on another, the same handle maps the same memory.
                if any(
                    r.mapping.handle == handle and r.tenant != tenant
                    for r in self._regions.values()
                ):
                    raise InvalidInput(
                        f"region '{name}': its raw_handle is registered by another tenant"
                    )
                mapping = self._mappings.get((device, handle))
                if mapping is not None:
                    mapping.regions += 1  # held while this registration finishes
            if mapping is None:
                mapping = self._map(cuda, name, handle, device)
                mapping.regions = 1
                with self._lock:
                    self._mappings[device, handle] = mapping
            region = CudaRegion(name, tenant, key_name, byte_size, mapping)
            try:
                if byte_size > mapping.size:
                    raise InvalidInput(
                        f"region '{name}': byte_size {byte_size} passes the end of the device "
                        f"allocation its raw_handle maps ({mapping.size} bytes)"
                    )
                with self._lock:
                    self._room(tenant, name, byte_size)  # again: one may have come meanwhile
                    self._regions[tenant, name] = region
            except BaseException:
                region.dropped = True
                self._close_unused(region)
                raise

    def _map(self, cuda: Cuda, name: str, handle: bytes, device: int) -> _Mapping:
        """cudaIpcOpenMemHandle on `device`, and the mapped allocation's size from its start."""
        flags = getattr(cuda.rt, "cudaIpcMemLazyEnablePeerAccess", 1)
        try:
            cuda.call("cudaSetDevice", device)
        except BackendError as exc:
            raise InvalidInput(f"region '{name}': {exc.message}") from None
        # Checked here, not through cuda.call: its message would spell out the handle's bytes.
        err, ptr = cuda.rt.cudaIpcOpenMemHandle(cuda.ipc_handle(handle), flags)
        if err != cuda.ok:
            raise InvalidInput(
                f"region '{name}': CUDA cannot open its raw_handle on device {device}: "
                f"cudaIpcOpenMemHandle failed: {cuda.describe(err)}"
            )
        ptr = int(ptr)
        try:
            base, size = allocation_range(self._driver, ptr)
        except BackendError as exc:
            cuda.call("cudaIpcCloseMemHandle", ptr)
            raise InvalidInput(f"region '{name}': {exc.message}") from None
        return _Mapping(device, handle, ptr, base + size - ptr)

    def held(self, tenant: str) -> dict[str, int]:
        """`tenant`'s regions: name -> byte_size (under the lock)."""
        return {n: r.byte_size for (owner, n), r in self._regions.items() if owner == tenant}

    def holds(self, tenant: str, name: str) -> bool:
        with self._lock:
            return (tenant, name) in self._regions

    def _drop(self, regions: list[CudaRegion]) -> None:
        for region in regions:
            region.dropped = True
            self._close_unused(region)

    def _close_unused(self, region: CudaRegion) -> None:
        """Close the region's mapping when it is dropped, unused, and the last on its handle."""
        with self._lock:
            if region.closed or not region.dropped or region.users:
                return
            region.closed = True
            mapping = region.mapping
            mapping.regions -= 1
            if mapping.regions:
                return
            del self._mappings[mapping.device, mapping.handle]
        assert self._cuda is not None
        try:
            self._cuda.call("cudaSetDevice", mapping.device)
            self._cuda.call("cudaIpcCloseMemHandle", mapping.ptr)
        except BackendError as exc:  # nothing the caller can do; the mapping is gone from here
            log.error("closing a CUDA shared-memory mapping failed: %s", exc.message)

    # -- tensors ---------------------------------------------------------------------------------

    def _release(self, region: CudaRegion) -> None:
        with self._lock:
            region.users -= 1
        self._close_unused(region)

    def _copy(
        self, region: CudaRegion, dst: int, src: int, size: int, kind: Any, what: str
    ) -> None:
        assert self._cuda is not None
        try:
            self._cuda.call("cudaSetDevice", region.mapping.device)  # per thread in CUDA
            self._cuda.call("cudaMemcpy", dst, src, size, kind)
        except BackendError as exc:
            raise InvalidInput(
                f"{what}: copying through CUDA region '{region.name}' failed: {exc.message}"
            ) from None

    def read(self, tenant: str, ref: SharedTensor, what: str) -> bytearray:
        """`ref.byte_size` bytes of `tenant`'s region, copied DeviceToHost."""
        region = self._lease(tenant, ref, ref.byte_size, what)
        try:
            data = bytearray(ref.byte_size)
            if ref.byte_size:
                host = ctypes.addressof((ctypes.c_char * ref.byte_size).from_buffer(data))
                src = region.mapping.ptr + ref.offset
                assert self._cuda is not None
                self._copy(region, host, src, ref.byte_size, self._cuda.to_host, what)
            return data
        finally:
            self._release(region)

    def write(self, tenant: str, ref: SharedTensor, data: memoryview, what: str) -> None:
        """`data` into `tenant`'s region at `ref.offset`, copied HostToDevice; InvalidInput when
        it does not fit the `ref.byte_size` the request gave or the region."""
        if data.nbytes > ref.byte_size:
            raise InvalidInput(
                f"{what} takes {data.nbytes} bytes; shared_memory_byte_size is {ref.byte_size}"
            )
        region = self._lease(tenant, ref, data.nbytes, what)
        try:
            if data.nbytes:
                host = np.frombuffer(data.cast("B"), np.uint8)  # no copy, read-only or not
                dst = region.mapping.ptr + ref.offset
                assert self._cuda is not None
                self._copy(region, dst, host.ctypes.data, data.nbytes, self._cuda.to_device, what)
        finally:
            self._release(region)
