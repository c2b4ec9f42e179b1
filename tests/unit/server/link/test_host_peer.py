"""What one worker connection holds and sends on the engine's side (server/link/host_peer.py),
through the rig of tests/unit/server/link/rig.py: answers past the frame limit, and cancelled calls
that give their slots back."""

from __future__ import annotations

import asyncio
import gc
import os
from pathlib import Path

import numpy as np
import pytest

import server.link.frames
import server.link.host_peer
from engine.errors import (
    BackendError,
)
from engine.types import InferRequest
from server.settings import load_settings
from tests.models import write_sleeping_model
from tests.unit.server.link.rig import Rig, request, until


async def test_a_call_cancelled_past_its_deadline_frees_its_slot_without_the_collector(
    tmp_path: Path, socket_dir: str
) -> None:
    """A gRPC call whose deadline passed while its batch ran: the engine's timeout fired, then
    the worker's CANCEL cancelled the engine's task inside that TimeoutError's handler. The
    task's CancelledError then led, through asyncio.timeout's frame, back to the task: a cycle
    holding the request's inputs, which the engine process collects seldom (tune_gc). Each such
    call kept its in-arena slot until the arena was full and the worker answered only 503."""
    write_sleeping_model(tmp_path / "models")
    settings = load_settings(model_repository=tmp_path / "models", allow_python_models=True)
    rig = Rig(settings, os.path.join(socket_dir, "engine.sock"), 1, 1 << 20)
    await rig.start()
    gc.disable()  # as rarely as the engine process collects: not within this test
    try:
        remote = await rig.remote()
        x = np.ones((2, 4), np.float32)
        late = InferRequest("slow", {"x": x}, {"x": "FP32"}, timeout_s=0.1)
        call = asyncio.create_task(remote.infer(late))
        await asyncio.sleep(0.2)  # its deadline has passed; its batch runs until 0.4 s
        call.cancel()  # the gRPC deadline: the worker's handler is cancelled
        with pytest.raises(asyncio.CancelledError):
            await call
        await until(lambda: not rig.host.workers[0].held_in, timeout_s=2.0)
        await until(lambda: remote.allocator.used_bytes == 0)
    finally:
        gc.enable()
        await rig.close()


async def test_an_answer_past_the_frame_limit_fails_its_call_not_the_connection(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The worker takes a frame past MAX_FRAME_BYTES for a broken peer and ends the connection
    # every request of the worker shares (a model's config can be that large: it came in a load).
    remote = await rig.remote()
    # A config is more than this, a result less; the worker's limit as the engine's.
    monkeypatch.setattr(server.link.frames, "MAX_FRAME_BYTES", 600)
    monkeypatch.setattr(server.link.host_peer, "MAX_FRAME_BYTES", 600, raising=False)
    with pytest.raises(BackendError, match=r"answer takes \d+ bytes, more than the 600 bytes"):
        await remote.model_config("demo")
    x = np.ones((1, 16), np.float32)
    answer = await remote.infer(request(x))  # the connection serves on
    assert answer.outputs["probabilities"].shape == (1, 10)
    assert remote.live


async def test_an_answer_past_the_frame_limit_gives_its_slot_back(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The engine refuses to send an answer the worker would take for a broken peer, and sends
    # an error instead: the out-slot its outputs were written to stayed taken, the worker never
    # told of it, until the worker's connection ended.
    remote = await rig.remote()
    monkeypatch.setattr(server.link.host_peer, "MAX_FRAME_BYTES", 60)  # an answer takes ~100 bytes
    x = np.ones((1, 16), np.float32)
    with pytest.raises(BackendError, match=r"answer takes \d+ bytes, more than the 60 bytes"):
        await remote.infer(request(x))
    assert rig.host.workers[0].out_allocator.used_bytes == 0
    assert not rig.host.workers[0].peer.out_slots  # type: ignore[union-attr]
    monkeypatch.undo()
    answer = await remote.infer(request(x))  # the connection serves on
    assert answer.outputs["probabilities"].shape == (1, 10)
