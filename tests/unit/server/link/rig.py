"""The rig the tests of the worker/engine-process data plane share (server/link/remote*.py,
server/link/host*.py; its fixtures are in conftest.py): a worker's RemoteEngine against an
EngineHost in front of a real Engine, in one process; each side maps the arenas through its own file
descriptor, as the worker and engine processes do."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from engine.engine import Engine
from engine.types import InferRequest
from server.link.host import EngineHost
from server.link.remote import RemoteEngine
from server.link.shm.arena import Arena
from server.settings import Settings


def request(x: np.ndarray, model: str = "demo") -> InferRequest:
    return InferRequest(model, {"x": x}, {"x": "FP32"})


def infer_request(
    call_id: int, slot: int, size: int, described: list[Any], datatypes: dict[str, str]
) -> list[Any]:
    """A request for the demo model as an INFER frame carries it (server/link/frames.py
    INFER_ITEMS), as a worker sends it with nothing optional set (no input check ran)."""
    unset: list[Any] = [None, None, None, {}, None, None, None, None, None, None]  # version..trace
    return [call_id, slot, size, described, "demo", datatypes, *unset, None, None]


async def until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Poll `condition` until it holds, failing after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


class Rig:
    """One engine, its host, and worker arenas (one pair per worker slot)."""

    def __init__(self, settings: Settings, socket_path: str, workers: int, arena_bytes: int):
        self.settings = settings
        self.path = socket_path
        self.engine = Engine(settings)
        self.worker_arenas = [(Arena(arena_bytes), Arena(arena_bytes)) for _ in range(workers)]
        engine_side = [(Arena(arena_bytes, os.dup(i.fd)), Arena(arena_bytes, os.dup(o.fd)))
                       for i, o in self.worker_arenas]  # fmt: skip
        self.host = EngineHost(self.engine, engine_side)
        self.remotes: list[RemoteEngine] = []

    async def start(self) -> None:
        await self.engine.start()
        await self.host.serve(self.path)

    async def remote(self, index: int = 0) -> RemoteEngine:
        remote = RemoteEngine(self.settings, self.path, index, self.worker_arenas[index])
        await remote.start()
        self.remotes.append(remote)
        return remote

    async def close(self) -> None:
        for remote in self.remotes:
            await remote.close()
        await self.host.close()
        await self.engine.close()
