"""Poll mode against a real `sluice serve`: the repository changes on disk while a client watches
readiness every few milliseconds. A new version is served, a removed one unloaded; a broken
config.yaml and a half-written model file leave the serving versions serving, and readiness never
drops (strict readiness, the default)."""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import onnx
import pytest

from tests.models import identity_model, write_model
from tests.servers import ServerProcess

CONFIG = "max_batch_size: 8\nversion_policy: {all: true}\n"
BODY = {"inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]}
POLL = {"SLUICE_POLL_INTERVAL_S": "0.1"}


async def until(check: Callable[[], Awaitable[bool]], what: str, timeout_s: float = 20) -> None:
    """Poll `check` until it holds (bounded): each change needs a poll interval and a load."""
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        await asyncio.sleep(0.02)


async def test_poll_mode_follows_the_repository_and_readiness_never_drops(
    tmp_path: Path, start_server: Callable[..., ServerProcess]
) -> None:
    repo = tmp_path / "models"
    write_model(repo, "m", identity_model("FP32"), CONFIG)
    server = start_server("--model-repository", str(repo), "--model-control-mode", "poll", env=POLL)
    not_ready: list[int] = []
    stop = asyncio.Event()

    async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:

        async def watch_readiness() -> int:
            probes = 0
            while not stop.is_set():
                status = (await client.get("/v2/health/ready")).status_code
                probes += 1
                if status != 200:
                    not_ready.append(status)
                await asyncio.sleep(0.005)  # pacing, not synchronization
            return probes

        async def served() -> str:
            response = await client.post("/v2/models/m/infer", json=BODY)
            assert response.status_code == 200, response.text
            assert response.json()["outputs"][0]["data"] == [1, 2, 3, 4]
            return str(response.json()["model_version"])

        async def index() -> dict[str, tuple[str, str]]:
            rows = (await client.post("/v2/repository/index", json={})).json()
            return {row["version"]: (row["state"], row["reason"]) for row in rows}

        async def state_is(version: str, state: str) -> bool:
            return (await index()).get(version, ("", ""))[0] == state

        async def version_ready(version: str) -> int:
            return (await client.get(f"/v2/models/m/versions/{version}/ready")).status_code

        watcher = asyncio.create_task(watch_readiness())
        assert await served() == "1"

        # A new version: served (the highest is the default).
        write_model(repo, "m", identity_model("FP32"), version=2)

        async def two_served() -> bool:
            return await served() == "2"

        await until(two_served, "version 2 to be served")
        assert await version_ready("1") == 200

        # A removed version: unloaded; the other keeps serving.
        shutil.rmtree(repo / "m" / "2")

        async def two_gone() -> bool:
            return await version_ready("2") == 404

        await until(two_gone, "version 2 to be unloaded")
        assert await served() == "1"

        # A broken config.yaml: reported, and the loaded version keeps serving.
        (repo / "m" / "config.yaml").write_text("max_batch_size: [8\n")
        await until(lambda: state_is("", "UNAVAILABLE"), "the broken config to be reported")
        assert await served() == "1"
        (repo / "m" / "config.yaml").write_text(CONFIG)
        await until(lambda: state_is("", ""), "the config to be read again")

        # A half-written model file of a new version: it fails, the old version serves; once
        # the file is whole, the new version is served.
        whole = identity_model("FP32").SerializeToString()
        (repo / "m" / "3").mkdir()
        (repo / "m" / "3" / "model.onnx").write_bytes(whole[: len(whole) // 2])
        await until(lambda: state_is("3", "UNAVAILABLE"), "the half-written version to fail")
        assert await served() == "1"
        assert await version_ready("3") == 503  # its folder is there: failed, not unknown
        onnx.save(onnx.load_from_string(whole), repo / "m" / "3" / "model.onnx")

        async def three_served() -> bool:
            return await served() == "3"

        await until(three_served, "version 3 to be served once whole")
        stop.set()
        probes = await watcher

    assert probes > 50, f"readiness was probed only {probes} times"
    assert not_ready == [], f"readiness dropped {len(not_ready)} times: {set(not_ready)}"


@pytest.mark.parametrize(
    ("flags", "env", "expected"),
    [
        ((), {}, 503),  # strict by default
        ((), {"SLUICE_STRICT_READINESS": "false"}, 200),
        (("--no-strict-readiness",), {"SLUICE_STRICT_READINESS": "true"}, 200),  # the flag wins
    ],
    ids=["default", "env-false", "flag-false"],
)
async def test_strict_readiness_with_a_model_that_failed_at_start(
    tmp_path: Path,
    start_server: Callable[..., ServerProcess],
    flags: tuple[str, ...],
    env: dict[str, str],
    expected: int,
) -> None:
    repo = tmp_path / "models"
    write_model(repo, "good", identity_model("FP32"), CONFIG)
    write_model(repo, "bad", identity_model("FP32"), CONFIG).write_bytes(b"not onnx")
    server = start_server("--model-repository", str(repo), *flags, env=env, ready=False)
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
        assert (await client.get("/v2/health/ready")).status_code == expected
        assert (await client.get("/v2/models/good/ready")).status_code == 200
        bad = await client.get("/v2/models/bad/ready")
        assert bad.status_code == 503, bad.text
        assert "failed to load" in bad.json()["error"]
