"""engine.region_table: the table both kinds of shared-memory region build on, over fake
regions (the kinds themselves: test_regions.py, test_cuda_regions.py)."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from engine.errors import InvalidInput, RegionNotFound
from engine.region_table import RegionTable
from engine.types import SharedTensor


class FakeRegion:
    def __init__(self, name: str, key_name: str | None, byte_size: int = 64) -> None:
        self.name, self.key_name, self.byte_size = name, key_name, byte_size
        self.users = 0

    def status(self) -> dict[str, Any]:
        return {"name": self.name, "byte_size": self.byte_size}


class FakeTable(RegionTable[FakeRegion]):
    """Regions of two tenants; `dropped` records each `_drop`, and whether the lock was free."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._regions = {
            ("acme", "a"): FakeRegion("a", "k1"),
            ("acme", "b"): FakeRegion("b", "k2"),
            ("zeta", "a"): FakeRegion("a", "k1"),
        }
        self.dropped: list[tuple[list[str], bool]] = []

    def require_enabled(self) -> None:
        pass

    def _drop(self, regions: list[FakeRegion]) -> None:
        self.dropped.append(([r.name for r in regions], not self._lock.locked()))


async def test_a_tenant_sees_only_its_own_regions() -> None:
    table = FakeTable()
    assert [r["name"] for r in await table.status("acme", None)] == ["a", "b"]
    assert await table.status("zeta", "a") == [{"name": "a", "byte_size": 64}]
    with pytest.raises(RegionNotFound):
        await table.status("zeta", "b")  # acme's, as if absent
    assert (table.count(), table.count("acme"), table.count("nobody")) == (3, 2, 0)


async def test_unregister_drops_one_or_all_of_a_tenant_outside_the_lock() -> None:
    table = FakeTable()
    await table.unregister("acme", "b")
    with pytest.raises(RegionNotFound):
        await table.unregister("acme", "b")
    await table.unregister("acme", None)
    assert table.dropped == [(["b"], True), (["a"], True)]
    assert table.count() == 1


def test_a_revoked_key_and_shutdown_drop_their_regions() -> None:
    table = FakeTable()
    table.keep_keys({"k2"})
    assert table.dropped == [(["a", "a"], True)]
    table.close()
    assert table.dropped[-1] == (["b"], True)
    assert table.count() == 0


def test_a_lease_counts_a_use_within_the_regions_bounds() -> None:
    table = FakeTable()
    region = table._lease("acme", SharedTensor("a", 16, 48), 48, "input 'x'")
    assert region.users == 1
    with pytest.raises(InvalidInput, match="48 bytes at shared_memory_offset 17 pass the end"):
        table._lease("acme", SharedTensor("a", 17, 48), 48, "input 'x'")
    with pytest.raises(RegionNotFound):
        table._lease("zeta", SharedTensor("b", 4, 0), 4, "input 'x'")
    assert region.users == 1
