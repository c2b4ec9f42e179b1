"""The registry of client shared-memory regions (engine/regions.py), on files in a temporary
folder standing in for /dev/shm."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from engine.errors import Forbidden, InvalidInput, RegionNotFound
from engine.regions import SystemRegions, shared_tensor
from engine.settings import SharedMemorySettings
from engine.types import SharedTensor

ON = SharedMemorySettings(enabled=True)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    shm = tmp_path / "shm"
    shm.mkdir()
    return shm


def region_file(folder: Path, name: str, data: bytes) -> Path:
    path = folder / name
    path.write_bytes(data)
    return path


def regions(folder: Path, **limits: int) -> SystemRegions:
    return SystemRegions(SharedMemorySettings(enabled=True, **limits), folder)


async def test_a_registered_region_reads_and_writes_its_bytes(folder: Path) -> None:
    payload = np.arange(16, dtype=np.float32)
    region_file(folder, "in", b"\xff" * 8 + payload.tobytes())
    reg = regions(folder)
    await reg.register("a", "k", "r", "/in", 8, payload.nbytes)
    got = reg.read("a", SharedTensor("r", 16, 32), "input 'x'")
    assert np.array_equal(np.frombuffer(got, np.float32), payload[4:12])
    reg.write("a", SharedTensor("r", 0, 8), memoryview(b"ABCDEFGH"), "output 'y'")
    assert (folder / "in").read_bytes()[:16] == b"\xff" * 8 + b"ABCDEFGH"
    assert (await reg.status("a", None)) == [
        {"name": "r", "key": "/in", "offset": 8, "byte_size": 64}
    ]


async def test_off_by_default_every_call_says_how_to_enable_it(folder: Path) -> None:
    region_file(folder, "in", bytes(64))
    reg = SystemRegions(SharedMemorySettings(), folder)
    with pytest.raises(Forbidden, match="SLUICE_SHARED_MEMORY__ENABLED=true"):
        await reg.register("a", "k", "r", "/in", 0, 64)
    with pytest.raises(Forbidden, match="SLUICE_SHARED_MEMORY__ENABLED=true"):
        await reg.status("a", None)
    with pytest.raises(Forbidden, match="SLUICE_SHARED_MEMORY__ENABLED=true"):
        await reg.unregister("a", None)
    with pytest.raises(Forbidden, match="SLUICE_SHARED_MEMORY__ENABLED=true"):
        reg.read("a", SharedTensor("r", 0, 4), "input 'x'")


@pytest.mark.parametrize(
    "key", ["/../in", "sub/in", "/", "", "..", ".", "/in\0", "/" + "a" * 256, "//in"]
)
async def test_keys_that_leave_the_folder_are_refused(folder: Path, key: str) -> None:
    region_file(folder, "in", bytes(64))
    (folder / "sub").mkdir()
    region_file(folder / "sub", "in", bytes(64))
    with pytest.raises(InvalidInput, match="must name a file directly in"):
        await regions(folder).register("a", "k", "r", key, 0, 8)


async def test_a_symlink_is_refused_even_to_a_file_in_the_folder(folder: Path) -> None:
    region_file(folder, "real", bytes(64))
    (folder / "link").symlink_to(folder / "real")
    (folder / "passwd").symlink_to("/etc/passwd")
    reg = regions(folder)
    before = open_fds()
    for key in ("/link", "/passwd"):
        with pytest.raises(InvalidInput, match="not a link"):
            await reg.register("a", "k", key, key, 0, 8)
    assert open_fds() == before
    assert reg.count() == 0


async def test_only_regular_files_are_registered(folder: Path) -> None:
    os.mkfifo(folder / "fifo")  # opening a FIFO to read would block the event loop
    (folder / "dir").mkdir()
    reg = regions(folder)
    before = open_fds()
    with pytest.raises(InvalidInput, match="not a regular file"):
        await reg.register("a", "k", "f", "/fifo", 0, 8)
    with pytest.raises(InvalidInput, match="dir"):
        await reg.register("a", "k", "d", "/dir", 0, 8)
    with pytest.raises(InvalidInput, match="no file 'nope'"):
        await reg.register("a", "k", "n", "/nope", 0, 8)
    assert open_fds() == before


@pytest.mark.parametrize(
    ("offset", "size", "message"),
    [
        (0, 65, "offset 0 \\+ byte_size 65 passes the end of '/in', which holds 64 bytes"),
        (60, 8, "offset 60 \\+ byte_size 8 passes the end"),
        (2**63, 1, "passes the end"),
        (-1, 8, "offset must be an integer >= 0"),
        (0, 0, "byte_size must be at least 1"),
        (0, True, "byte_size must be an integer >= 0"),
    ],
)
async def test_offsets_and_sizes_past_the_file_are_refused(
    folder: Path, offset: int, size: int, message: str
) -> None:
    region_file(folder, "in", bytes(64))
    reg = regions(folder)
    before = open_fds()
    with pytest.raises(InvalidInput, match=message):
        await reg.register("a", "k", "r", "/in", offset, size)
    assert open_fds() == before


async def test_a_tensor_past_its_region_is_refused_before_any_read(folder: Path) -> None:
    region_file(folder, "in", bytes(128))
    reg = regions(folder)
    await reg.register("a", "k", "r", "/in", 0, 64)  # the file holds more than the region
    with pytest.raises(InvalidInput, match="60 bytes at shared_memory_offset 8 pass the end"):
        reg.read("a", SharedTensor("r", 8, 60), "input 'x'")
    with pytest.raises(InvalidInput, match="pass the end"):
        reg.write("a", SharedTensor("r", 64, 8), memoryview(bytes(8)), "output 'y'")
    with pytest.raises(InvalidInput, match="takes 9 bytes; shared_memory_byte_size is 8"):
        reg.write("a", SharedTensor("r", 0, 8), memoryview(bytes(9)), "output 'y'")


async def test_another_tenants_region_is_unknown_and_unlisted(folder: Path) -> None:
    region_file(folder, "secret", b"s" * 64)
    region_file(folder, "mine", b"m" * 64)
    reg = regions(folder)
    await reg.register("a", "ka", "r", "/secret", 0, 64)
    with pytest.raises(RegionNotFound, match="no shared memory region 'r'"):
        reg.read("b", SharedTensor("r", 0, 8), "input 'x'")
    with pytest.raises(RegionNotFound):
        await reg.status("b", "r")
    with pytest.raises(RegionNotFound):
        await reg.unregister("b", "r")
    assert (await reg.status("b", None)) == []
    await reg.unregister("b", None)  # all of b's: none of a's
    assert reg.count("a") == 1
    # b may use the same name for its own region, but not a's file under any name.
    await reg.register("b", "kb", "r", "/mine", 0, 64)
    with pytest.raises(InvalidInput, match="registered by another tenant"):
        await reg.register("b", "kb", "other", "/secret", 0, 64)
    assert bytes(reg.read("b", SharedTensor("r", 0, 4), "x")) == b"mmmm"
    assert bytes(reg.read("a", SharedTensor("r", 0, 4), "x")) == b"ssss"


async def test_thousands_of_registrations_are_bounded_and_leak_no_file(folder: Path) -> None:
    region_file(folder, "in", bytes(64))
    reg = regions(folder, max_regions_per_tenant=16)
    before = open_fds()
    refusals: set[str] = set()
    for index in range(2000):
        try:
            await reg.register("a", "k", f"r{index}", "/in", 0, 64)
        except InvalidInput as exc:
            refusals.add(exc.message)
    assert reg.count("a") == 16
    assert refusals == {
        "tenant 'a' holds 16 regions, the most shared_memory.max_regions_per_tenant allows; "
        "unregister one first"
    }
    assert open_fds() == before + 16
    await reg.unregister("a", None)
    assert open_fds() == before


async def test_bytes_per_tenant_are_bounded(folder: Path) -> None:
    region_file(folder, "in", bytes(64))
    reg = regions(folder, max_bytes_per_tenant=100)
    await reg.register("a", "k", "r1", "/in", 0, 64)
    with pytest.raises(InvalidInput, match=r"passes shared_memory.max_bytes_per_tenant \(100\)"):
        await reg.register("a", "k", "r2", "/in", 0, 64)
    await reg.register("a", "k", "r3", "/in", 0, 36)
    assert reg.count("a") == 2


async def test_a_name_is_registered_once(folder: Path) -> None:
    region_file(folder, "in", bytes(64))
    reg = regions(folder)
    await reg.register("a", "k", "r", "/in", 0, 64)
    with pytest.raises(InvalidInput, match="already registered"):
        await reg.register("a", "k", "r", "/in", 0, 8)
    await reg.unregister("a", "r")
    await reg.register("a", "k", "r", "/in", 0, 8)
    assert (await reg.status("a", "r"))[0]["byte_size"] == 8


async def test_a_truncated_file_is_refused_without_a_fault(folder: Path) -> None:
    path = region_file(folder, "in", bytes(4096))
    reg = regions(folder)
    await reg.register("a", "k", "r", "/in", 0, 4096)
    os.truncate(path, 100)  # the client shrinks its file under a registered region
    with pytest.raises(InvalidInput, match=r"ends after 100 of its 4096 bytes.*was truncated"):
        reg.read("a", SharedTensor("r", 0, 4096), "input 'x'")
    with pytest.raises(InvalidInput, match="was truncated below its registered size"):
        reg.write("a", SharedTensor("r", 0, 4096), memoryview(bytes(4096)), "output 'y'")
    assert path.stat().st_size == 100  # never grown back by a write
    path.unlink()  # unlinked: the open file still reads what it holds
    assert bytes(reg.read("a", SharedTensor("r", 0, 100), "x")) == bytes(100)


async def test_a_region_unregistered_during_a_read_keeps_its_file_until_the_read_ends(
    folder: Path,
) -> None:
    region_file(folder, "in", b"a" * 64)
    reg = regions(folder)
    await reg.register("a", "k", "r", "/in", 0, 64)
    region = reg._lease("a", SharedTensor("r", 0, 64), 64, "x")  # a read under way
    await reg.unregister("a", "r")
    os.fstat(region.fd)  # still open: its number cannot be reused for another file yet
    region_file(folder, "other", b"b" * 64)
    await reg.register("a", "k", "r2", "/other", 0, 64)
    assert bytes(os.pread(region.fd, 4, 0)) == b"aaaa"
    reg._release(region)  # the last use: now the file closes
    with pytest.raises(OSError, match="Bad file descriptor"):
        os.fstat(region.fd)


async def test_regions_of_a_revoked_key_are_dropped(folder: Path) -> None:
    region_file(folder, "in", bytes(64))
    reg = regions(folder)
    await reg.register("a", "old", "r1", "/in", 0, 64)
    await reg.register("a", "kept", "r2", "/in", 0, 64)
    before = open_fds()
    reg.keep_keys(frozenset({"kept"}))
    assert [row["name"] for row in await reg.status("a", None)] == ["r2"]
    assert open_fds() == before - 1


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ({}, None),
        ({"binary_data_size": 4}, None),
        ({"shared_memory_region": "r", "shared_memory_byte_size": 8}, SharedTensor("r", 0, 8)),
        (
            {"shared_memory_region": "r", "shared_memory_byte_size": 8, "shared_memory_offset": 4},
            SharedTensor("r", 4, 8),
        ),
    ],
)
def test_tensor_parameters_name_a_region(params: dict[str, object], expected: object) -> None:
    assert shared_tensor(params, "input 'x'") == expected


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"shared_memory_region": "r"}, "needs shared_memory_byte_size"),
        ({"shared_memory_byte_size": 8}, "need shared_memory_region"),
        ({"shared_memory_region": 3, "shared_memory_byte_size": 8}, "non-empty string"),
        ({"shared_memory_region": "r", "shared_memory_byte_size": -1}, "integer >= 0"),
        ({"shared_memory_region": "r", "shared_memory_byte_size": 1.5}, "integer >= 0"),
        (
            {
                "shared_memory_region": "r",
                "shared_memory_byte_size": 8,
                "shared_memory_offset": "4",
            },
            "shared_memory_offset must be an integer >= 0",
        ),
    ],
)
def test_malformed_region_parameters_are_refused(params: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        shared_tensor(params, "input 'x'")
