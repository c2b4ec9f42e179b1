"""A worker's mirror of the engine's client shared-memory regions (server/link/remote_regions.py),
against a real registry standing in for the engine process, reached as HostControl reaches it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from engine.errors import InvalidInput, RegionNotFound
from engine.regions import SystemRegions
from engine.settings import SharedMemorySettings
from engine.types import SharedTensor
from server.link.remote_regions import WorkerRegions

ON = SharedMemorySettings(enabled=True)


class EngineSide:
    """The engine process: its registry, its calls (as server/link/host_control.py answers them) and
    the state it pushes to every worker."""

    def __init__(self, folder: Path) -> None:
        self.regions = SystemRegions(ON, folder)
        self.state: dict[str, Any] = {"shm_regions": []}
        self.kept: list[list[str]] = []

    async def call(self, method: str, *args: Any) -> Any:
        if method == "shm_register":
            await self.regions.register(*args)
        elif method == "shm_unregister":
            await self.regions.unregister(*args)
        elif method == "shm_status":
            return await self.regions.status(*args)
        elif method == "shm_keep_keys":
            self.kept.append(args[0])
            self.regions.keep_keys(frozenset(args[0]))
        self.state = {"shm_regions": self.regions.table()}  # pushed to every worker at once
        return self.state


def worker(engine: EngineSide, folder: Path) -> WorkerRegions:
    adopted: list[dict[str, Any]] = []
    return WorkerRegions(ON, engine.call, lambda: engine.state, adopted.append, folder)


def open_files() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_a_region_registered_through_one_worker_is_read_through_another(
    tmp_path: Path,
) -> None:
    (tmp_path / "in").write_bytes(b"0123456789abcdef")
    engine = EngineSide(tmp_path)
    first, second = worker(engine, tmp_path), worker(engine, tmp_path)
    await first.register("acme", "k", "r", "/in", 4, 8)
    assert await second.status("acme", None) == [
        {"name": "r", "key": "/in", "offset": 4, "byte_size": 8}
    ]
    assert bytes(second.read("acme", SharedTensor("r", 2, 4), "x")) == b"6789"
    with pytest.raises(RegionNotFound):  # another tenant, as in one process
        second.read("beta", SharedTensor("r", 0, 4), "x")
    before = open_files()
    await first.unregister("acme", "r")
    with pytest.raises(RegionNotFound):
        second.read("acme", SharedTensor("r", 0, 4), "x")
    assert open_files() == before - 2  # the engine's file and the second worker's mirror


async def test_a_file_replaced_under_its_name_is_not_read(tmp_path: Path) -> None:
    path = tmp_path / "in"
    path.write_bytes(b"registered bytes")
    engine = EngineSide(tmp_path)
    reader = worker(engine, tmp_path)
    await engine.call("shm_register", "acme", "k", "r", "/in", 0, 16)
    path.unlink()
    path.write_bytes(b"someone else's..")  # a new file of that name, not the registered one
    with pytest.raises(InvalidInput, match="no longer the file that was registered"):
        reader.read("acme", SharedTensor("r", 0, 4), "input 'x'")
    await engine.call("shm_unregister", "acme", "r")
    with pytest.raises(RegionNotFound):
        reader.read("acme", SharedTensor("r", 0, 4), "input 'x'")


async def test_a_workers_key_reload_drops_revoked_keys_regions_in_the_engine(
    tmp_path: Path,
) -> None:
    (tmp_path / "in").write_bytes(bytes(16))
    engine = EngineSide(tmp_path)
    reader = worker(engine, tmp_path)
    await reader.register("acme", "old", "r", "/in", 0, 16)
    reader.keep_keys(frozenset({"new", None}))
    await next(iter(reader._tasks))  # the call to the engine, made in the background
    assert engine.kept == [["new"]]
    assert engine.regions.count() == 0
    with pytest.raises(RegionNotFound):
        reader.read("acme", SharedTensor("r", 0, 4), "x")
