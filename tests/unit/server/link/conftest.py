"""Fixtures of the worker/engine-process rig (tests/unit/server/link/rig.py): a socket folder, a
factory of rigs over the demo repository, and one started rig."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
import uvloop

from engine.demo import write_demo_repository
from server.settings import load_settings
from tests.unit.server.link.rig import Rig


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> dict[str, Callable[[], asyncio.AbstractEventLoop]]:
    """asyncio's loop for each test here; a test marked
    `pytest.mark.asyncio(loop_factories=["asyncio", "uvloop"])` runs on uvloop too."""
    marker = item.get_closest_marker("asyncio")
    if marker is not None and "loop_factories" in marker.kwargs:
        return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}
    return {"asyncio": asyncio.new_event_loop}


@pytest.fixture
def socket_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="sluice-t", dir="/tmp")  # unix socket paths are short
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def make_rig(tmp_path: Path, socket_dir: str) -> Callable[..., Rig]:
    repo = write_demo_repository(tmp_path / "models")

    def make(workers: int = 1, arena_bytes: int = 1 << 20, **overrides: object) -> Rig:
        settings = load_settings(model_repository=repo, **overrides)
        return Rig(settings, os.path.join(socket_dir, "engine.sock"), workers, arena_bytes)

    return make


@pytest.fixture
async def rig(make_rig: Callable[..., Rig]) -> AsyncIterator[Rig]:
    rig = make_rig()
    await rig.start()
    yield rig
    await rig.close()
