"""Readiness and model control on a real repository: strict and non-strict readiness when a
model fails at start, and failed reloads that keep the serving version (and readiness)."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engine.demo import write_demo_repository
from engine.engine import Engine
from engine.errors import InvalidInput, ModelNotFound, ModelNotReady
from engine.types import InferRequest
from server.settings import load_settings

X = np.ones((1, 16), np.float32)
StartEngine = Callable[..., Any]


def request(model: str = "demo") -> InferRequest:
    return InferRequest(model, {"x": X}, {"x": "FP32"}, timeout_s=5)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """The demo model, plus `broken`: a folder whose model file is not ONNX."""
    root = write_demo_repository(tmp_path / "models")
    shutil.copytree(root / "demo", root / "broken")
    (root / "broken" / "1" / "model.onnx").write_bytes(b"not an onnx model")
    return root


@pytest.fixture
async def start(repo: Path) -> AsyncIterator[StartEngine]:
    engines: list[Engine] = []

    async def start_engine(**settings: Any) -> Engine:
        engine = Engine(load_settings(model_repository=repo, **settings))
        engines.append(engine)
        await engine.start()
        return engine

    yield start_engine
    for engine in engines:
        await engine.close()


async def test_strict_readiness_is_the_default_one_failed_model_keeps_the_server_unready(
    start: StartEngine,
) -> None:
    engine = await start()
    assert engine.ready is False
    assert await engine.model_ready("demo") is True
    assert await engine.model_ready("broken") is False


async def test_non_strict_readiness_is_ready_with_the_models_that_loaded(
    start: StartEngine,
) -> None:
    engine = await start(strict_readiness=False)
    assert engine.ready is True
    assert await engine.model_ready("demo") is True
    assert await engine.model_ready("broken") is False
    assert (await engine.infer(request())).outputs["probabilities"].shape == (1, 10)
    with pytest.raises(ModelNotReady, match=r"'broken'.*failed to load: .*"):
        await engine.infer(request("broken"))


async def test_strict_readiness_from_the_environment(
    repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLUICE_STRICT_READINESS", "false")
    assert load_settings(model_repository=repo).strict_readiness is False


@pytest.fixture
async def explicit(start: StartEngine, repo: Path) -> Engine:
    shutil.rmtree(repo / "broken")
    engine: Engine = await start(model_control_mode="explicit", load_models=["demo"])
    assert engine.ready is True
    return engine


async def test_a_failed_reload_of_the_serving_version_keeps_readiness(
    explicit: Engine, repo: Path
) -> None:
    (repo / "demo" / "1" / "model.onnx").write_bytes(b"half a model")
    with pytest.raises(InvalidInput, match="failed to load model 'demo'"):
        await explicit.load_model("demo")
    assert explicit.ready is True
    assert await explicit.model_ready("demo") is True


async def test_a_model_unloading_after_a_failed_reload_is_unknown_not_failed(
    explicit: Engine, repo: Path
) -> None:
    """The unload retired the versions before it forgot the failed reload: while its queued
    requests were answered, new ones were told the model had failed to load (503), which it
    had not (its version served until the unload)."""
    (repo / "demo" / "1" / "model.onnx").write_bytes(b"half a model")
    with pytest.raises(InvalidInput, match="failed to load model 'demo'"):
        await explicit.load_model("demo")
    batcher = served(explicit).batcher
    batcher.pause()
    queued = asyncio.create_task(explicit.infer(request()))
    while not batcher.queue.requests:  # noqa: ASYNC110 (the queue has no event)
        await asyncio.sleep(0)
    unloading = asyncio.create_task(explicit.unload_model("demo"))
    while explicit.registry.has("demo"):  # noqa: ASYNC110 (the unload retires the version)
        await asyncio.sleep(0)
    try:
        with pytest.raises(ModelNotFound, match="unknown model 'demo'"):
            explicit.registry.resolve("demo", None)
    finally:
        batcher.resume()
        await unloading
    assert (await queued).model_version == "1"  # the queued request is answered


async def test_a_broken_new_version_keeps_the_old_one_serving(explicit: Engine, repo: Path) -> None:
    (repo / "demo" / "2").mkdir()
    (repo / "demo" / "2" / "model.onnx").write_bytes(b"half a model")
    with pytest.raises(InvalidInput, match="failed to load model 'demo'"):
        await explicit.load_model("demo")
    assert explicit.ready is True
    assert (await explicit.infer(request())).model_version == "1"
    states = {(row["version"], row["state"]) for row in await explicit.repository_index()}
    assert states == {("1", "READY"), ("2", "UNAVAILABLE")}
    with pytest.raises(ModelNotReady, match=r"'demo'.*2.*failed to load: "):  # not "unknown"
        explicit.registry.resolve("demo", "2")


async def test_a_broken_config_on_reload_keeps_the_old_config_serving(
    explicit: Engine, repo: Path
) -> None:
    (repo / "demo" / "config.yaml").write_text("max_batch_size: [unclosed\n")
    with pytest.raises(InvalidInput, match="failed to load model 'demo'"):
        await explicit.load_model("demo")
    assert explicit.ready is True
    assert (await explicit.infer(request())).model_version == "1"


def served(engine: Engine) -> Any:
    return engine.registry.resolve("demo", None)


async def test_a_load_with_a_config_replaces_the_folders_until_a_plain_load(
    explicit: Engine,
) -> None:
    inline = (
        '{"max_batch_size": 8, "instances": 2, "dynamic_batching": {"max_queue_delay_s": "auto"}}'
    )
    await explicit.load_model("demo", {"config": inline})
    model = served(explicit)
    assert (model.max_batch_size, model.config.instance_count) == (8, 2)
    assert model.batcher.policy.max_queue_delay_s == "auto"
    triton = await explicit.model_config("demo", None)
    assert triton["max_batch_size"] == 8
    with pytest.raises(InvalidInput, match="batch size 9 exceeds the maximum of 8"):
        await explicit.infer(
            InferRequest("demo", {"x": np.ones((9, 16), np.float32)}, {"x": "FP32"})
        )
    await explicit.load_model("demo")  # no config: the folder's config.yaml again
    assert served(explicit).max_batch_size == 64
    assert served(explicit).batcher.policy.max_queue_delay_s == 0.002


async def test_an_unload_drops_the_loaded_config(explicit: Engine) -> None:
    await explicit.load_model("demo", {"config": '{"max_batch_size": 8}'})
    await explicit.unload_model("demo")
    await explicit.load_model("demo")
    assert served(explicit).max_batch_size == 64


async def test_a_config_that_fails_to_load_keeps_the_serving_one(explicit: Engine) -> None:
    await explicit.load_model("demo", {"config": '{"max_batch_size": 8}'})
    bad = '{"dynamic_batching": {"pad": {"tokens": {"axis": 1}}}}'  # valid schema, no such input
    with pytest.raises(InvalidInput, match=r"failed to load model 'demo'.*tokens"):
        await explicit.load_model("demo", {"config": bad})
    assert served(explicit).max_batch_size == 8
    assert (await explicit.infer(request())).outputs["probabilities"].shape == (1, 10)
    await explicit.load_model("demo", {"config": '{"max_batch_size": 4}'})
    assert served(explicit).max_batch_size == 4


@pytest.mark.parametrize(
    "config", ['{"version_policy": {"specific": [9]}}', '{"backend": "tensorrt"}']
)
async def test_a_config_that_serves_no_version_keeps_the_serving_one(
    explicit: Engine, config: str
) -> None:
    """A load whose config selects no version in the folder (a version that is not there, a
    backend whose file is not there) answered 400 and took the serving model down."""
    with pytest.raises(InvalidInput, match="failed to load model 'demo'") as refused:
        await explicit.load_model("demo", {"config": config})
    assert await explicit.model_ready("demo") is True
    assert "no version folder holds the backend's model file" in refused.value.message
    assert (await explicit.infer(request())).outputs["probabilities"].shape == (1, 10)


async def test_a_config_yaml_that_is_not_utf8_fails_its_model_alone(
    start: StartEngine, repo: Path
) -> None:
    """It was a UnicodeDecodeError out of the registry's start: the server did not start."""
    shutil.rmtree(repo / "broken")
    shutil.copytree(repo / "demo", repo / "garbled")
    (repo / "garbled" / "config.yaml").write_bytes(b"\xff\xfemax_batch_size: 8\n")
    engine = await start(strict_readiness=False)
    assert await engine.model_ready("demo") is True
    assert await engine.model_ready("garbled") is False
    with pytest.raises(ModelNotReady, match=r"cannot read .*garbled/config.yaml"):
        await engine.infer(request("garbled"))


async def test_a_config_that_does_not_validate_is_refused_before_loading(explicit: Engine) -> None:
    with pytest.raises(InvalidInput, match=r"load parameter 'config'.*\n  instances: "):
        await explicit.load_model("demo", {"config": '{"instances": 0}'})
    with pytest.raises(InvalidInput, match="expected a mapping of keys, got list"):
        await explicit.load_model("demo", {"config": "[1, 2]"})
    assert served(explicit).max_batch_size == 64


async def test_the_triton_config_carries_the_sluice_config_and_its_source(
    explicit: Engine,
) -> None:
    parameters = (await explicit.model_config("demo", None))["parameters"]
    assert parameters["sluice_config_source"] == {"string_value": "repository"}
    written = json.loads(parameters["sluice_config"]["string_value"])
    assert written == {"max_batch_size": 64, "dynamic_batching": {"max_queue_delay_s": 0.002}}
    inline = {"max_batch_size": 8, "dynamic_batching": {"max_queue_delay_s": "auto"}}
    await explicit.load_model("demo", {"config": json.dumps(inline)})
    parameters = (await explicit.model_config("demo", None))["parameters"]
    assert parameters["sluice_config_source"] == {"string_value": "load"}
    assert json.loads(parameters["sluice_config"]["string_value"]) == inline


async def test_one_model_s_failed_reload_does_not_stop_the_poll_of_the_others(
    start: StartEngine, repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reload that raised something unexpected aborted the whole scan, every interval: a
    model added after it in the scan's order was never loaded. (And a folder added before the
    poll task first ran was never seen: its first fingerprints are now taken before the loads.)"""
    shutil.rmtree(repo / "broken")
    engine = await start(model_control_mode="poll", poll_interval_s=0.02)
    load = engine.registry._load

    async def failing(name: str) -> None:
        if name == "a-first":
            raise RuntimeError("unexpected")
        await load(name)

    monkeypatch.setattr(engine.registry, "_load", failing)
    shutil.copytree(repo / "demo", repo / "a-first")
    shutil.copytree(repo / "demo", repo / "z-last")
    for _ in range(500):  # the poll runs every 20 ms
        if await engine.model_ready("z-last"):
            break
        await asyncio.sleep(0.01)
    assert await engine.model_ready("z-last") is True, await engine.repository_index()
    assert any("unexpected" in row["reason"] for row in await engine.repository_index())
