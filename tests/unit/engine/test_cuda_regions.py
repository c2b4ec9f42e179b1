"""CUDA shared-memory regions (engine/cuda_regions.py) against the fake cuda-python runtime: the
server's runtime installed through the import seam, a second fake runtime standing in for the
client process that allocates device memory and exports its IPC handle (the two share it
through a file, as two processes share device memory)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from engine.cuda_regions import NO_CUDA
from engine.errors import Forbidden, InvalidInput, RegionNotFound
from engine.regions import SystemRegions
from engine.settings import SharedMemorySettings
from engine.types import SharedTensor
from tests.fakes.cuda_client import IpcClient
from tests.fakes.cuda_runtime import FakeCudaRuntime
from tests.fakes.install import hide_package, install_cuda


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> FakeCudaRuntime:
    """The server process's runtime: two fake GPUs, found by `import cuda.bindings.runtime`."""
    runtime = FakeCudaRuntime(devices=[FakeCudaRuntime().devices[0]] * 2)
    install_cuda(monkeypatch, runtime)
    return runtime


@pytest.fixture
def client() -> Iterator[IpcClient]:
    made = IpcClient()
    yield made
    made.free()


def registry(tmp_path: Path, **settings: int) -> SystemRegions:
    return SystemRegions(SharedMemorySettings(enabled=True, **settings), tmp_path)


async def test_a_region_reads_and_writes_device_memory(
    tmp_path: Path, server: FakeCudaRuntime, client: IpcClient
) -> None:
    x = np.arange(16, dtype=np.float32)
    ptr, handle = client.allocate(x.tobytes() + bytes(64))
    regions = registry(tmp_path)
    await regions.cuda.register("a", "k", "r", handle, 1, 128)
    assert await regions.cuda.status("a", None) == [{"name": "r", "device_id": 1, "byte_size": 128}]
    got = regions.read("a", SharedTensor("r", 16, 32), "input 'x'")  # through SystemRegions
    np.testing.assert_array_equal(np.frombuffer(got, np.float32), x[4:12])
    regions.write("a", SharedTensor("r", 64, 64), memoryview(b"ABCDEFGH"), "output 'y'")
    assert client.get(ptr + 64, 8) == b"ABCDEFGH"
    assert server.open_ipc_mappings == 1
    await regions.cuda.unregister("a", "r")
    assert server.open_ipc_mappings == 0
    assert server.calls.count("cudaIpcCloseMemHandle") == 1


@pytest.mark.parametrize(
    ("handle", "device", "size", "message"),
    [
        (b"x" * 63, 0, 8, "raw_handle must be the 64 bytes of a cudaIpcMemHandle_t, got 63"),
        (b"x" * 65, 0, 8, "got 65"),
        ("x" * 64, 0, 8, "got str"),
        (b"x" * 64, -1, 8, "device_id must be an integer >= 0, got -1"),
        (b"x" * 64, 0, 0, "byte_size must be an integer >= 1, got 0"),
        (b"x" * 64, 0, True, "byte_size must be an integer >= 1, got True"),
    ],
    ids=["short", "long", "text", "negative-device", "empty", "bool-size"],
)
async def test_malformed_registrations_are_refused_before_any_cuda_call(
    tmp_path: Path,
    server: FakeCudaRuntime,
    handle: object,
    device: object,
    size: object,
    message: str,
) -> None:
    with pytest.raises(InvalidInput, match=message):
        await registry(tmp_path).cuda.register("a", "k", "r", handle, device, size)
    assert server.calls == []


async def test_a_wrong_device_a_bad_handle_or_a_size_past_the_allocation_is_refused(
    tmp_path: Path, server: FakeCudaRuntime, client: IpcClient
) -> None:
    _, handle = client.allocate(bytes(256))
    regions = registry(tmp_path)
    with pytest.raises(InvalidInput, match=r"device_id 2 is not a CUDA device of this server \("):
        await regions.cuda.register("a", "k", "r", handle, 2, 256)
    with pytest.raises(
        InvalidInput,
        match=r"on device 0: cudaIpcOpenMemHandle failed: cudaErrorInvalidValue \(invalid",
    ):
        await regions.cuda.register("a", "k", "r", bytes(64), 0, 256)
    with pytest.raises(InvalidInput, match=r"byte_size 257 passes the end of the device alloc"):
        await regions.cuda.register("a", "k", "r", handle, 0, 257)
    assert server.open_ipc_mappings == 0  # the refused registration's mapping was closed
    assert regions.cuda.count() == 0


async def test_a_tensor_past_its_region_is_refused_before_any_copy(
    tmp_path: Path, server: FakeCudaRuntime, client: IpcClient
) -> None:
    _, handle = client.allocate(bytes(128))
    regions = registry(tmp_path)
    await regions.cuda.register("a", "k", "r", handle, 0, 64)  # less than the allocation
    copies = server.sync_copies
    with pytest.raises(InvalidInput, match="32 bytes at shared_memory_offset 40 pass the end"):
        regions.read("a", SharedTensor("r", 40, 32), "input 'x'")
    with pytest.raises(InvalidInput, match="takes 16 bytes; shared_memory_byte_size is 8"):
        regions.write("a", SharedTensor("r", 0, 8), memoryview(bytes(16)), "output 'y'")
    with pytest.raises(InvalidInput, match="16 bytes at shared_memory_offset 56 pass the end"):
        regions.write("a", SharedTensor("r", 56, 16), memoryview(bytes(16)), "output 'y'")
    assert server.sync_copies == copies


async def test_another_tenants_region_is_unknown_and_its_handle_not_registrable(
    tmp_path: Path, server: FakeCudaRuntime, client: IpcClient
) -> None:
    _, handle = client.allocate(b"s" * 64)
    regions = registry(tmp_path)
    await regions.cuda.register("a", "k", "r", handle, 0, 64)
    with pytest.raises(RegionNotFound, match="no shared memory region 'r'"):
        regions.read("b", SharedTensor("r", 0, 8), "input 'x'")
    with pytest.raises(RegionNotFound):
        await regions.cuda.status("b", "r")
    with pytest.raises(RegionNotFound):
        await regions.cuda.unregister("b", "r")
    assert await regions.cuda.status("b", None) == []
    for device in (0, 1):  # on another device the same handle maps the same memory
        with pytest.raises(InvalidInput, match="raw_handle is registered by another tenant"):
            await regions.cuda.register("b", "kb", "mine", handle, device, 64)
    # The same tenant may name it twice: one mapping, closed with the last region.
    await regions.cuda.register("a", "k", "again", handle, 0, 32)
    assert server.open_ipc_mappings == 1
    await regions.cuda.unregister("a", "r")
    assert server.open_ipc_mappings == 1
    await regions.cuda.unregister("a", None)
    assert server.open_ipc_mappings == 0


async def test_unregistered_while_in_use_it_closes_after_the_copy(
    tmp_path: Path, server: FakeCudaRuntime, client: IpcClient
) -> None:
    _, handle = client.allocate(b"a" * 64)
    regions = registry(tmp_path)
    await regions.cuda.register("a", "k", "r", handle, 0, 64)
    region = regions.cuda._lease("a", SharedTensor("r", 0, 64), 64, "x")  # a copy under way
    await regions.cuda.unregister("a", "r")
    assert server.open_ipc_mappings == 1  # not under the copy
    regions.cuda._release(region)
    assert server.open_ipc_mappings == 0
    with pytest.raises(RegionNotFound):
        regions.read("a", SharedTensor("r", 0, 8), "x")


async def test_both_kinds_share_names_and_bounds(
    tmp_path: Path, server: FakeCudaRuntime, client: IpcClient
) -> None:
    (tmp_path / "in").write_bytes(bytes(64))
    regions = registry(tmp_path, max_regions_per_tenant=2, max_bytes_per_tenant=100)
    await regions.register("a", "k", "sys", "/in", 0, 64)
    _, handle = client.allocate(bytes(64))
    with pytest.raises(InvalidInput, match="region 'sys' is already registered"):
        await regions.cuda.register("a", "k", "sys", handle, 0, 8)
    with pytest.raises(InvalidInput, match=r"has regions of 64 bytes; 64 more passes"):
        await regions.cuda.register("a", "k", "gpu", handle, 0, 64)
    await regions.cuda.register("a", "k", "gpu", handle, 0, 36)
    with pytest.raises(InvalidInput, match="region 'gpu' is already registered"):
        await regions.register("a", "k", "gpu", "/in", 0, 8)
    with pytest.raises(InvalidInput, match="holds 2 regions"):
        await regions.register("a", "k", "third", "/in", 0, 1)
    assert server.open_ipc_mappings == 1
    regions.keep_keys(frozenset())  # the key is revoked: both kinds go
    assert (regions.count(), regions.cuda.count(), server.open_ipc_mappings) == (0, 0, 0)


async def test_without_cuda_python_or_a_device_registering_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hide_package(monkeypatch, "cuda")
    regions = registry(tmp_path)
    with pytest.raises(InvalidInput, match=f"^{NO_CUDA}: cuda-python is not installed"):
        await regions.cuda.register("a", "k", "r", bytes(64), 0, 64)
    assert await regions.cuda.status("a", None) == []
    with pytest.raises(RegionNotFound, match="no shared memory region 'r'"):
        await regions.cuda.unregister("a", "r")
    await regions.cuda.unregister("a", None)
    install_cuda(monkeypatch, FakeCudaRuntime(devices=[]))
    with pytest.raises(InvalidInput, match=f"^{NO_CUDA}: cudaGetDeviceCount"):
        await registry(tmp_path).cuda.register("a", "k", "r", bytes(64), 0, 64)


async def test_off_every_call_says_how_to_enable_it(tmp_path: Path) -> None:
    regions = SystemRegions(SharedMemorySettings(), tmp_path)
    for call in (
        regions.cuda.register("a", "k", "r", bytes(64), 0, 64),
        regions.cuda.status("a", None),
        regions.cuda.unregister("a", None),
    ):
        with pytest.raises(Forbidden, match="SLUICE_SHARED_MEMORY__ENABLED=true"):
            await call
