"""Generative models under `on_demand` (engine/kv_budget.py with engine/on_demand.py): they load
on their first generate request, cost their measured session plus the key/value cache their
config allows, are never evicted while a stream runs and are evicted once idle like any model.
Both engines: sluice's own decoder loop (the tiny GPT-2) and onnxruntime-genai (the tiny Llama)."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest

from engine.budget import Cost
from engine.demo import mlp_model
from engine.engine import Engine
from engine.errors import ModelNotFound, ModelNotReady, Overloaded, RateLimited
from engine.generation.genai import sequence_bytes
from engine.generation.service import GenerateRequest, LocalStream
from engine.kv_budget import GenerativeScan, kv_cost, kv_estimate
from engine.repository import ModelEntry, Repository
from engine.types import InferRequest
from server.settings import load_settings
from tests.genai_models import CONTEXT, publish_genai

MiB = 1 << 20
KV_BYTES = 48 * MiB  # far above what the tiny decoder's session measures (about 1 MB)
StartEngine = Callable[..., Awaitable[Engine]]


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory, tiny_gpt2_built: tuple[Path, Path]) -> Path:
    """The tiny GPT-2 as `tiny` (its generative section given a 48 MiB cache) and an MLP `a`."""
    root = tmp_path_factory.mktemp("kv") / "models"
    shutil.copytree(tiny_gpt2_built[1], root)
    config = root / "tiny" / "config.yaml"
    text = config.read_text()
    assert "generative:" in text
    assert "kv_cache_bytes" not in text
    config.write_text(text.replace("generative:", f"generative:\n  kv_cache_bytes: {KV_BYTES}"))
    (root / "a" / "1").mkdir(parents=True)
    onnx.save(mlp_model((64, 256, 4)), root / "a" / "1" / "model.onnx")
    (root / "a" / "config.yaml").write_text("max_batch_size: 8\n")
    return root


@pytest.fixture
async def start(repo: Path) -> AsyncIterator[StartEngine]:
    engines: list[Engine] = []

    async def start_engine(
        root: Path = repo, server: dict[str, Any] | None = None, **memory: Any
    ) -> Engine:
        settings = load_settings(
            model_repository=root,
            model_control_mode="on_demand",
            model_memory=memory,
            **(server or {}),
        )
        engine = Engine(settings)
        engines.append(engine)
        await engine.start()
        return engine

    yield start_engine
    for engine in engines:
        await engine.close()


async def generate(engine: Engine, model: str = "tiny", max_tokens: int = 4) -> LocalStream:
    options = {"max_tokens": max_tokens, "temperature": 0}
    return await engine.generation.generate(GenerateRequest(model, None, [1, 2, 3], None, options))


async def tokens(stream: LocalStream) -> list[int]:
    return [token for chunk in [c async for c in stream.chunks()] for token in chunk.tokens]


async def test_a_generative_model_loads_on_its_first_generate_and_costs_its_kv_budget(
    start: StartEngine,
) -> None:
    engine = await start()
    assert not engine.registry.has("tiny")  # not loaded (nor pinned) at start
    assert engine.generation.generative_models() == ["tiny"]  # listed: a request loads it
    streams = await asyncio.gather(*(generate(engine) for _ in range(3)))
    answers = [await tokens(stream) for stream in streams]
    assert 0 < len(answers[0]) <= 4
    assert answers == [answers[0]] * 3
    usage = engine.registry.budget.of("tiny")
    assert (usage.loads, usage.load_failures) == (1, 0)  # one load, shared
    cost = engine.registry.budget.resident_bytes("tiny", "1")
    # Its session (measured, about 1 MB) plus the 48 MiB its cache may take (computed).
    assert KV_BYTES < cost < KV_BYTES + 16 * MiB, cost
    with pytest.raises(ModelNotFound):  # a tensor model is not loaded for a generate request
        await generate(engine, "a")
    assert engine.registry.budget.of("a").loads == 0


async def test_a_generative_model_whose_kv_budget_cannot_fit_is_refused_before_loading(
    start: StartEngine,
) -> None:
    engine = await start(host_bytes=KV_BYTES // 2)
    with pytest.raises(ModelNotReady, match="cannot fit in the memory budget even alone"):
        await generate(engine)
    assert not engine.registry.has("tiny")
    assert engine.registry.budget.host_used() == 0  # never loaded: refused on its estimate


async def test_a_tenant_over_its_rate_never_loads_a_generative_model(start: StartEngine) -> None:
    engine = await start(server={"rate_limit": {"default": {"rate_per_s": 0.001, "burst": 1}}})
    with pytest.raises(ModelNotFound):  # not generative: refused before any charge
        await generate(engine, "a")
    x = np.ones((1, 64), np.float32)
    await engine.infer(InferRequest("a", {"x": x}, {"x": "FP32"}, timeout_s=10))  # the burst
    with pytest.raises(RateLimited):
        await generate(engine)
    assert not engine.registry.has("tiny")
    assert engine.registry.budget.of("tiny").loads == 0


async def test_a_streaming_model_is_never_evicted_and_an_idle_one_is(start: StartEngine) -> None:
    engine = await start(max_models=1, load_wait_s=0.3)
    stream = await generate(engine, max_tokens=8)  # held until its last chunk is read
    x = np.ones((1, 64), np.float32)
    with pytest.raises(Overloaded, match=r"no room to load model 'a'"):
        await engine.infer(InferRequest("a", {"x": x}, {"x": "FP32"}, timeout_s=10))
    assert engine.registry.has("tiny")
    assert 0 < len(await tokens(stream)) <= 8  # the stream ended: tiny is idle now
    await engine.infer(InferRequest("a", {"x": x}, {"x": "FP32"}, timeout_s=10))
    assert not engine.registry.has("tiny")
    assert engine.registry.budget.of("tiny").evictions == {"budget": 1}
    assert await tokens(await generate(engine))  # loaded again, evicting a
    assert engine.registry.budget.of("tiny").loads == 2
    assert engine.registry.budget.of("a").evictions == {"budget": 1}


async def test_a_generative_models_statistics_outlive_its_eviction(start: StartEngine) -> None:
    """An eviction is not a reload: the version's generation counters carry on, as its
    inference statistics do (ModelStats.generation)."""
    engine = await start(max_models=1)
    first = len(await tokens(await generate(engine, max_tokens=4)))
    x = np.ones((1, 64), np.float32)
    await engine.infer(InferRequest("a", {"x": x}, {"x": "FP32"}, timeout_s=10))
    assert not engine.registry.has("tiny")  # evicted for a
    second = len(await tokens(await generate(engine, max_tokens=3)))
    generator = engine.registry.resolve("tiny", None).generator
    assert generator is not None
    stats = generator.scheduler.stats
    assert stats.generated_tokens == first + second
    assert sum(stats.e2e.counts) == 2  # both sequences' end-to-end times


async def test_an_onnxruntime_genai_model_loads_on_demand_with_its_computed_kv_budget(
    start: StartEngine, tmp_path: Path, tiny_genai_built: tuple[Path, Path]
) -> None:
    root = tmp_path / "models"
    # No generative section needed: the model builder's files make it generative.
    batch = 256  # a cache (16 MiB) well above the session's measured bytes
    publish_genai(
        tiny_genai_built[1], root, "llama", f"generative: {{max_running_sequences: {batch}}}\n"
    )
    folder = root / "llama" / "1"
    layout = json.loads((folder / "genai_config.json").read_text())["model"]
    one = sequence_bytes(folder, layout, CONTEXT)  # layers x kv heads x head size x 2 x float
    engine = await start(root)
    assert not engine.registry.has("llama")
    assert engine.generation.generative_models() == ["llama"]
    entry = engine.registry.repository.entry("llama")
    assert entry is not None
    assert kv_estimate(entry) == batch * one  # before loading: from genai_config.json
    assert await tokens(await generate(engine, "llama"))
    model = engine.registry.resolve("llama", None)
    assert kv_cost(model, folder) == Cost(batch * one)  # the loaded scheduler's, the same
    cost = engine.registry.budget.resident_bytes("llama", "1")
    assert batch * one < cost < batch * one + 16 * MiB, cost


def test_the_generative_scan_reads_again_only_the_folders_that_changed(
    repo: Path, tmp_path: Path
) -> None:
    root = Path(shutil.copytree(repo, tmp_path / "models"))
    repository = Repository(root)
    read: list[str] = []

    def entry(name: str) -> ModelEntry | None:
        read.append(name)
        return repository.entry(name)

    scan = GenerativeScan(repository, entry)
    assert (scan.scan(), sorted(read)) == (frozenset({"tiny"}), ["a", "tiny"])
    read.clear()
    assert (scan.scan(), read) == (
        frozenset({"tiny"}),
        [],
    )  # every check interval: no config re-read
    (root / "a" / "config.yaml").write_text("max_batch_size: 8\ngenerative: {}\n")
    assert (scan.scan(), read) == (frozenset({"a", "tiny"}), ["a"])
