"""`model_control_mode: on_demand` in one process, on real ONNX models written by the tests:
shared loads, the LRU rule by measured bytes, never evicting a model in use or pinned, failed,
slow and too-large loads, idle unload, and what readiness, metadata and the index say."""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest

from engine.demo import mlp_model
from engine.engine import Engine
from engine.errors import InvalidInput, ModelNotReady, Overloaded, RateLimited
from engine.on_demand import EVICTED
from engine.types import InferRequest
from server.settings import load_settings

WIDTH = 16384  # hidden units: ~4 MB of weights a model, ~6 MB measured with ORT's pre-packing
X = np.ones((2, 64), np.float32)
StartEngine = Callable[..., Awaitable[Engine]]

GATED_PY = """
import time
from pathlib import Path


class Gated:
    def load(self, config):
        folder = Path(config["parameters"]["folder"])
        self.started, self.release = folder / "started", folder / "release"
        load_s = float(config["parameters"].get("load_s", 0))
        deadline = time.monotonic() + load_s
        while load_s and not (folder / "release_load").exists() and time.monotonic() < deadline:
            time.sleep(0.005)

    def infer(self, inputs):
        self.started.touch()
        deadline = time.monotonic() + 10
        while not self.release.exists() and time.monotonic() < deadline:
            time.sleep(0.002)
        return {"y": inputs["x"]}
"""


def write_mlp(repo: Path, name: str, width: int = WIDTH, seed: int = 0) -> None:
    (repo / name / "1").mkdir(parents=True)
    onnx.save(mlp_model((64, width, 4), seed=seed), repo / name / "1" / "model.onnx")
    (repo / name / "config.yaml").write_text("max_batch_size: 8\n")


def write_gated(repo: Path, name: str, load_s: float = 0.0) -> Path:
    """A Python model whose batches run until the test creates `<folder>/release` (and touch
    `started` first); with `load_s`, its load takes that long unless `release_load` exists."""
    folder = repo / name
    (folder / "1").mkdir(parents=True)
    (folder / "1" / "model.py").write_text(GATED_PY)
    (folder / "config.yaml").write_text(
        "backend: python\nmax_batch_size: 8\nwarmup: {enabled: false}\n"
        f"python:\n  parameters: {{folder: '{folder}', load_s: {load_s}}}\n"
        "  inputs: [{name: x, datatype: FP32, shape: [-1, 4]}]\n"
        "  outputs: [{name: y, datatype: FP32, shape: [-1, 4]}]\n"
    )
    return folder


def request(model: str, timeout_s: float = 10) -> InferRequest:
    x = np.ones((1, 4), np.float32) if model.startswith("gated") else X
    return InferRequest(model, {"x": x}, {"x": "FP32"}, timeout_s=timeout_s)


async def until(check: Callable[[], bool], what: str, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


@pytest.fixture(scope="module")
def three_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("on-demand") / "models"
    for index, name in enumerate(("a", "b", "c")):
        write_mlp(root, name, seed=index)
    return root


@pytest.fixture
def repo(tmp_path: Path, three_models: Path) -> Path:
    """Models a, b and c for the test to change: a copy (writing them takes 20x longer)."""
    return Path(shutil.copytree(three_models, tmp_path / "models"))


@pytest.fixture
async def start(repo: Path) -> AsyncIterator[StartEngine]:
    engines: list[Engine] = []

    async def start_engine(poll_interval_s: float = 5.0, **memory: Any) -> Engine:
        settings = load_settings(
            model_repository=repo,
            model_control_mode="on_demand",
            model_memory=memory,
            allow_python_models=True,
            poll_interval_s=poll_interval_s,
        )
        engine = Engine(settings)
        engines.append(engine)
        await engine.start()
        return engine

    yield start_engine
    for engine in engines:
        await engine.close()


_MEASURED: list[int] = []


@pytest.fixture
async def model_bytes(start: StartEngine) -> int:
    """What one of the test's MLPs measures here (it differs with the CPU's pre-packing):
    measured once for the module (the same on every load, tests/integration/test_on_demand.py)."""
    if not _MEASURED:
        engine = await start()
        await engine.infer(request("a"))
        cost = engine.registry.budget.resident_bytes("a", "1")
        assert cost > 2 * 64 * WIDTH * 4 // 2  # at least the weights: measured, not a guess
        _MEASURED.append(cost)
    return _MEASURED[0]


def states(engine: Engine) -> dict[str, tuple[str, str]]:
    return {row["name"]: (row["state"], row["reason"]) for row in engine.registry.index()}


async def test_nothing_loads_at_start_and_concurrent_requests_share_one_load(
    start: StartEngine,
) -> None:
    engine = await start()
    assert engine.registry.all() == []
    assert states(engine)["a"][0] == "UNAVAILABLE"
    answers = await asyncio.gather(*(engine.infer(request("a")) for _ in range(20)))
    expected = answers[0].outputs["probabilities"]
    assert expected.shape == (2, 4)
    assert all(np.array_equal(a.outputs["probabilities"], expected) for a in answers)
    usage = engine.registry.budget.of("a")
    assert (usage.loads, usage.load_failures) == (1, 0)
    assert states(engine)["a"][0] == "READY"
    assert engine.registry.budget.cold_start.count == 1


async def test_least_recently_used_idle_model_is_evicted_by_measured_bytes(
    start: StartEngine, model_bytes: int
) -> None:
    engine = await start(host_bytes=int(2.5 * model_bytes))  # two fit, three do not
    for name in ("a", "b", "a", "c"):  # b is then the least recently used
        await engine.infer(request(name))
    assert {m.name for m in engine.registry.all()} == {"a", "c"}
    assert states(engine)["b"] == (
        "UNAVAILABLE",
        "evicted: least recently used, to make room for another load",
    )
    assert engine.registry.budget.of("b").evictions == {"budget": 1}
    assert engine.registry.budget.host_used() <= int(2.5 * model_bytes)
    # Evicted, b still answers: its next request loads it again (evicting a, now the LRU).
    assert (await engine.infer(request("b"))).outputs["probabilities"].shape == (2, 4)
    assert {m.name for m in engine.registry.all()} == {"b", "c"}
    assert engine.registry.budget.of("b").loads == 2
    stats = (await engine.statistics("b"))["model_stats"][0]  # counted across its eviction
    assert (stats["inference_stats"]["success"]["count"], stats["inference_count"]) == (2, 4)


async def test_max_models_evicts_by_count_with_no_byte_budget(start: StartEngine) -> None:
    engine = await start(max_models=2)  # Ray Serve's rule: two models, whatever their bytes
    for name in ("a", "b", "a", "c"):
        await engine.infer(request(name))
    assert {m.name for m in engine.registry.all()} == {"a", "c"}
    assert engine.registry.budget.of("b").evictions == {"budget": 1}


async def test_a_model_with_a_running_batch_is_never_evicted_under_it(
    start: StartEngine, repo: Path, model_bytes: int
) -> None:
    gate = write_gated(repo, "gated")
    engine = await start(host_bytes=int(2.5 * model_bytes))
    running = asyncio.create_task(engine.infer(request("gated")))
    await until((gate / "started").exists, "the gated batch to start")
    await engine.infer(request("a"))
    await engine.infer(request("b"))
    # gated is the least recently used, but its batch runs: c's room comes from a.
    await engine.infer(request("c"))
    assert {m.name for m in engine.registry.all()} >= {"gated", "c"}
    assert "a" not in {m.name for m in engine.registry.all()}
    (gate / "release").touch()
    assert (await running).outputs["y"].tolist() == [[1.0] * 4]
    assert engine.registry.budget.of("gated").evictions == {}


async def test_no_room_while_every_resident_model_is_in_use_is_a_503_with_retry_after(
    start: StartEngine, repo: Path, model_bytes: int
) -> None:
    gate = write_gated(repo, "gated")
    engine = await start(host_bytes=int(1.5 * model_bytes), pinned=["gated"], load_wait_s=0.3)
    running = asyncio.create_task(engine.infer(request("gated")))
    await until((gate / "started").exists, "the gated batch to start")
    await engine.infer(request("a"))
    held = asyncio.create_task(engine.infer(request("gated")))  # queued behind the running one
    on_demand = engine.registry.on_demand
    assert on_demand is not None
    with on_demand.held("a"), pytest.raises(Overloaded, match=r"no room.*'b'.*in use") as caught:
        await engine.infer(request("b"))
    assert caught.value.retry_after_s is not None
    (gate / "release").touch()
    await asyncio.gather(running, held)
    assert {m.name for m in engine.registry.all()} == {"gated", "a"}


async def test_a_load_waits_for_a_model_in_use_to_be_left_and_then_evicts_it(
    start: StartEngine, model_bytes: int
) -> None:
    engine = await start(host_bytes=int(1.5 * model_bytes))
    on_demand = engine.registry.on_demand
    assert on_demand is not None
    await engine.infer(request("a"))
    with on_demand.held("a"):  # a request holds a: b's load may not evict it
        waiting = asyncio.create_task(engine.infer(request("b")))
        await until(lambda: "b" in on_demand.waiting_for_room, "b's load to wait for room")
        assert engine.registry.has("a")
        state, reason = states(engine)["b"]
        assert (state, reason.split(":")[0]) == ("LOADING", "waiting for room")
    assert (await waiting).outputs["probabilities"].shape == (2, 4)
    assert {m.name for m in engine.registry.all()} == {"b"}
    assert engine.registry.budget.of("a").evictions == {"budget": 1}


async def test_pinned_models_load_at_start_and_are_never_evicted(
    start: StartEngine, model_bytes: int
) -> None:
    engine = await start(host_bytes=int(2.5 * model_bytes), pinned=["a"])
    assert {m.name for m in engine.registry.all()} == {"a"}
    for name in ("b", "c", "b", "c"):
        await engine.infer(request(name))
    assert "a" in {m.name for m in engine.registry.all()}
    assert engine.registry.budget.of("a").evictions == {}
    assert engine.registry.budget.of("b").evictions == {"budget": 2}  # by c, twice
    assert engine.registry.budget.of("c").evictions == {"budget": 1}  # by b


async def test_an_explicit_load_pins_the_model_until_it_is_unloaded(
    start: StartEngine, model_bytes: int
) -> None:
    engine = await start(host_bytes=int(2.5 * model_bytes))
    await engine.load_model("a")
    for name in ("b", "c", "b"):
        await engine.infer(request(name))
    assert "a" in {m.name for m in engine.registry.all()}
    await engine.unload_model("a")
    assert engine.registry.budget.host_used() < 2 * model_bytes
    await engine.infer(request("a"))  # unpinned: it loads on demand again
    await engine.infer(request("c"))
    assert "a" in {m.name for m in engine.registry.all()}
    assert engine.registry.budget.of("b").evictions == {"budget": 2}


async def test_a_failed_load_answers_its_requests_and_leaves_other_models_serving(
    start: StartEngine, repo: Path
) -> None:
    (repo / "broken" / "1").mkdir(parents=True)
    (repo / "broken" / "1" / "model.onnx").write_bytes(b"not an onnx model")
    (repo / "broken" / "config.yaml").write_text("max_batch_size: 8\n")
    engine = await start()
    results = await asyncio.gather(
        *(engine.infer(request("broken")) for _ in range(5)),
        engine.infer(request("a")),
        return_exceptions=True,
    )
    assert all(isinstance(r, ModelNotReady) and "failed to load" in str(r) for r in results[:5]), (
        results
    )
    assert not isinstance(results[5], BaseException)
    state, reason = states(engine)["broken"]
    assert (state, reason.split(":")[0]) == ("UNAVAILABLE", "InvalidProtobuf")
    with pytest.raises(ModelNotReady, match="failed to load"):
        await engine.infer(request("broken"))
    # The failure is kept until the files change: not one load per request.
    assert engine.registry.budget.of("broken").load_failures == 1
    assert engine.ready  # a model loaded on demand is not one the server must serve
    assert await engine.model_ready("broken") is False
    (repo / "broken" / "1" / "model.onnx").unlink()
    onnx.save(mlp_model((64, 8, 4)), repo / "broken" / "1" / "model.onnx")
    assert (await engine.infer(request("broken"))).outputs["probabilities"].shape == (2, 4)


async def test_a_request_that_outwaits_its_timeout_is_a_503_and_the_load_goes_on(
    start: StartEngine, repo: Path
) -> None:
    folder = write_gated(repo, "gated", load_s=10)
    engine = await start()
    with pytest.raises(Overloaded, match=r"'gated' is not loaded yet.*0\.2 s") as caught:
        await engine.infer(request("gated", timeout_s=0.2))
    assert caught.value.retry_after_header is not None
    waiting = asyncio.create_task(engine.infer(request("gated")))
    await until(lambda: engine.registry.budget.of("gated").waiting == 1, "the second waiter")
    (folder / "release_load").touch()
    (folder / "release").touch()
    assert (await waiting).outputs["y"].shape == (1, 4)
    assert engine.registry.budget.of("gated").loads == 1  # the first request's load, shared


async def test_the_load_queue_is_bounded_per_model(start: StartEngine, repo: Path) -> None:
    folder = write_gated(repo, "gated", load_s=10)
    engine = await start(load_queue_size=2)
    waiters = [asyncio.create_task(engine.infer(request("gated"))) for _ in range(2)]
    await until(lambda: engine.registry.budget.of("gated").waiting == 2, "two waiters")
    with pytest.raises(Overloaded, match=r"2 requests already wait.*load_queue_size"):
        await engine.infer(request("gated"))
    (folder / "release_load").touch()
    (folder / "release").touch()
    assert [w.outputs["y"].shape for w in await asyncio.gather(*waiters)] == [(1, 4)] * 2


async def test_a_model_larger_than_the_budget_is_refused_saying_so(
    start: StartEngine, repo: Path, model_bytes: int
) -> None:
    write_mlp(repo, "small", width=256)
    engine = await start(host_bytes=model_bytes // 2)
    with pytest.raises(ModelNotReady, match=r"cannot fit in the memory budget even alone"):
        await engine.infer(request("a"))
    assert "a" not in {m.name for m in engine.registry.all()}
    assert engine.registry.budget.host_used() <= model_bytes // 2
    assert "cannot fit" in states(engine)["a"][1]
    assert (await engine.infer(request("small"))).outputs["probabilities"].shape == (2, 4)


async def test_idle_models_are_unloaded_after_idle_unload_s(start: StartEngine) -> None:
    engine = await start(idle_unload_s=0.2)
    await engine.infer(request("a"))
    assert engine.registry.has("a")
    # Out of the index at once, out of the books once its sessions are closed.
    await until(lambda: engine.registry.budget.host_used() == 0, "the idle unload")
    assert states(engine)["a"] == ("UNAVAILABLE", "evicted: idle for idle_unload_s")


async def test_readiness_metadata_and_config_answer_without_loading(start: StartEngine) -> None:
    engine = await start(idle_unload_s=0.2)
    assert await engine.model_ready("a") is True  # ready: a request would load it
    assert await engine.model_ready("a", "2") is False  # no such version in the folder
    assert await engine.model_ready("nope") is False
    # Metadata of a model never loaded: its file's declared inputs, its weights not read.
    first = await engine.model_metadata("a")
    assert (first.versions, first.platform) == (("1",), "onnxruntime_onnx")
    assert [(s.name, s.datatype, s.shape) for s in first.inputs] == [("x", "FP32", (-1, 64))]
    assert [s.name for s in first.outputs] == ["probabilities"]
    with pytest.raises(ModelNotReady, match="loads on its first inference request"):
        await engine.model_config("a")
    assert engine.registry.budget.of("a").loads == 0
    assert not engine.registry.has("a")
    await engine.infer(request("a"))
    await until(lambda: engine.registry.budget.host_used() == 0, "the idle unload")
    metadata = await engine.model_metadata("a")  # from its last load, not loading it again
    assert metadata == first
    assert (await engine.model_config("a"))["max_batch_size"] == 8
    assert (await engine.statistics("a"))["model_stats"][0]["resident_bytes"] == 0
    assert engine.registry.budget.of("a").loads == 1
    assert not engine.registry.has("a")


async def test_a_cached_answer_of_an_evicted_model_is_a_hit_without_loading_it(
    start: StartEngine, repo: Path
) -> None:
    (repo / "a" / "config.yaml").write_text("max_batch_size: 8\ncache: {enabled: true}\n")
    engine = await start()
    on_demand = engine.registry.on_demand
    assert on_demand is not None
    first = await engine.infer(request("a"))
    assert first.parameters["cache_hit"] is False
    await on_demand.evict("a", "idle")
    again = await engine.infer(request("a"))
    assert again.parameters["cache_hit"] is True
    assert np.array_equal(again.outputs["probabilities"], first.outputs["probabilities"])
    assert not engine.registry.has("a")
    assert engine.registry.budget.of("a").loads == 1
    other = InferRequest("a", {"x": X * 2}, {"x": "FP32"}, timeout_s=10)  # a miss: loads it
    assert (await engine.infer(other)).parameters["cache_hit"] is False
    assert engine.registry.has("a")
    assert engine.registry.budget.of("a").loads == 2


async def test_a_pipeline_loads_its_steps_and_keeps_them_while_it_is_resident(
    start: StartEngine, repo: Path, model_bytes: int
) -> None:
    (repo / "p").mkdir()
    (repo / "p" / "config.yaml").write_text(
        "pipeline:\n  steps:\n    - {model: a, inputs: {x: X}, outputs: {probabilities: P}}\n"
    )
    engine = await start(host_bytes=int(2.5 * model_bytes))
    answer = await engine.infer(InferRequest("p", {"X": X}, {"X": "FP32"}, timeout_s=10))
    assert answer.outputs["P"].shape == (2, 4)
    assert {m.name for m in engine.registry.all()} == {"p", "a"}
    on_demand = engine.registry.on_demand
    assert on_demand is not None
    with on_demand.held("p"):  # while p serves, its step a is not evictable either
        for name in ("b", "c"):
            await engine.infer(request(name))
        assert {m.name for m in engine.registry.all()} == {"p", "a", "c"}
        assert engine.registry.budget.of("b").evictions == {"budget": 1}
    await engine.infer(request("b"))  # p was used last (its request just left): c goes
    assert {m.name for m in engine.registry.all()} == {"p", "a", "b"}
    assert engine.registry.budget.of("c").evictions == {"budget": 1}
    assert engine.registry.budget.of("a").evictions == {}


async def test_a_drain_answers_the_requests_waiting_for_a_load(
    start: StartEngine, repo: Path
) -> None:
    folder = write_gated(repo, "gated", load_s=10)
    engine = await start()
    waiting = asyncio.create_task(engine.infer(request("gated")))
    await until(lambda: engine.registry.budget.of("gated").waiting == 1, "the waiter")
    drain = asyncio.create_task(engine.drain())
    await until(lambda: engine.draining, "the drain to begin")
    (folder / "release_load").touch()
    (folder / "release").touch()
    assert (await waiting).outputs["y"].shape == (1, 4)  # accepted before the drain: answered
    await drain


async def test_a_tenant_over_its_rate_never_loads_a_model(repo: Path) -> None:
    settings = load_settings(
        model_repository=repo,
        model_control_mode="on_demand",
        rate_limit={"default": {"rate_per_s": 0.001, "burst": 2}},
    )
    engine = Engine(settings)
    await engine.start()
    try:
        bad = InferRequest("a", {"nope": X}, {"nope": "FP32"}, timeout_s=10)
        with pytest.raises(InvalidInput, match="unexpected input 'nope'"):
            await engine.infer(bad)  # found only once a is loaded: its charge is refunded
        for _ in range(2):
            await engine.infer(request("a"))
        with pytest.raises(RateLimited):
            await engine.infer(request("b"))
        assert not engine.registry.has("b")
        assert engine.registry.budget.of("b").loads == 0
    finally:
        await engine.close()


async def test_a_model_whose_load_just_finished_is_not_evicted_before_its_waiters_run(
    start: StartEngine, model_bytes: int
) -> None:
    # Between a load's end and its waiters resuming, other tasks run (another load making room,
    # the idle unload): the waiters count as holding the model.
    engine = await start(host_bytes=int(1.5 * model_bytes), load_wait_s=0.2)
    await engine.infer(request("a"))
    engine.registry.budget.of("a").waiting = 1  # a waiter not resumed yet
    with pytest.raises(Overloaded, match="no room to load model 'b'"):
        await engine.infer(request("b"))
    assert engine.registry.has("a")


def _cuda_and_nvml() -> bool:
    import importlib.util

    import onnxruntime as ort

    cuda = "CUDAExecutionProvider" in ort.get_available_providers()
    return cuda and importlib.util.find_spec("pynvml") is not None


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_and_nvml(), reason="needs onnxruntime-gpu with CUDA and nvidia-ml-py")
async def test_a_gpu_models_device_bytes_are_measured_without_the_cuda_context(
    start: StartEngine, repo: Path
) -> None:
    (repo / "a" / "config.yaml").write_text(
        "max_batch_size: 8\n"
        "onnxruntime: {execution_providers: [CUDAExecutionProvider], require_providers: true}\n"
    )
    engine = await start(gpu_bytes=8 << 30)
    await engine.infer(request("a"))
    cost = engine.registry.budget.costs[("a", "1")]
    # Its 4 MB of weights in ONNX Runtime's CUDA arena; the context, cuBLAS and cuDNN (hundreds
    # of MB) were started at start and are not charged to it.
    assert 4 << 20 <= cost.gpu_bytes.get(0, 0) < 256 << 20, cost
    assert engine.registry.budget.gpu_used() == cost.gpu_bytes


async def test_a_model_that_failed_then_loaded_by_api_loads_on_demand_again_after_unload(
    start: StartEngine, repo: Path
) -> None:
    (repo / "a" / "config.yaml").write_text("max_batch_size: [not a number\n")
    engine = await start()
    with pytest.raises(ModelNotReady, match="failed to load"):
        await engine.infer(request("a"))
    await engine.load_model("a", {"config": '{"max_batch_size": 8}'})  # the files unchanged
    assert (await engine.infer(request("a"))).outputs["probabilities"].shape == (2, 4)
    await engine.unload_model("a")
    # Not "unknown model": it is tried again, and fails again on the folder's config.yaml.
    with pytest.raises(ModelNotReady, match="failed to load"):
        await engine.infer(request("a"))
    assert engine.registry.budget.of("a").load_failures == 2


def answer_of(model: onnx.ModelProto) -> np.ndarray:
    import onnxruntime as ort

    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return np.asarray(session.run(None, {"x": X})[0])


async def test_a_resident_models_changed_files_are_reloaded_and_the_next_request_sees_them(
    start: StartEngine, repo: Path, model_bytes: int
) -> None:
    engine = await start(poll_interval_s=0.05, pinned=["b"])
    old = (await engine.infer(request("a"))).outputs["probabilities"]
    new_model = mlp_model((64, WIDTH // 4, 4), seed=7)  # a quarter of the weights
    expected = answer_of(new_model)
    assert not np.allclose(old, expected)
    onnx.save(new_model, repo / "a" / "1" / "model.onnx")
    onnx.save(mlp_model((64, WIDTH // 4, 4), seed=8), repo / "b" / "1" / "model.onnx")
    usage = engine.registry.budget.of
    await until(lambda: usage("a").loads == 2, "the reload of a")
    on_demand = engine.registry.on_demand
    assert on_demand is not None
    await until(lambda: not on_demand.loading("a"), "the reload of a to settle")
    answer = await engine.infer(request("a"))
    np.testing.assert_allclose(answer.outputs["probabilities"], expected, rtol=1e-5)
    assert engine.registry.budget.of("a").evictions == {}  # reloaded in place, not evicted
    # The books hold the new version's measured bytes, not the old one's beside them.
    assert engine.registry.budget.resident_bytes("a", "1") < model_bytes / 2
    # A pinned model (loaded at start, not by a request) is checked too.
    await until(lambda: engine.registry.budget.resident_bytes("b", "1") < model_bytes / 2, "b")


async def test_an_evicted_models_changed_files_are_what_its_next_request_answers(
    start: StartEngine, repo: Path
) -> None:
    (repo / "a" / "config.yaml").write_text("max_batch_size: 8\ncache: {enabled: true}\n")
    engine = await start()
    on_demand = engine.registry.on_demand
    assert on_demand is not None
    old = (await engine.infer(request("a"))).outputs["probabilities"]
    await on_demand.evict("a", "idle")
    new_model = mlp_model((64, WIDTH // 4, 4), seed=7)
    onnx.save(new_model, repo / "a" / "1" / "model.onnx")
    await on_demand.check_files()  # what the check every poll_interval_s does
    # Not the cached answer of the old files: the model loads again and answers anew.
    answer = await engine.infer(request("a"))
    assert answer.parameters["cache_hit"] is False
    np.testing.assert_allclose(answer.outputs["probabilities"], answer_of(new_model), rtol=1e-5)
    assert not np.allclose(answer.outputs["probabilities"], old)
    assert engine.registry.budget.of("a").loads == 2


async def test_a_changed_model_that_cannot_fit_beside_itself_is_evicted_and_loads_anew(
    start: StartEngine, repo: Path, model_bytes: int
) -> None:
    engine = await start(host_bytes=int(1.5 * model_bytes))  # a once, not twice
    on_demand = engine.registry.on_demand
    assert on_demand is not None
    await engine.infer(request("a"))
    new_model = mlp_model((64, WIDTH // 4, 4), seed=7)
    onnx.save(new_model, repo / "a" / "1" / "model.onnx")
    await on_demand.check_files()
    assert not engine.registry.has("a")  # not a reload waiting for room that never comes
    assert states(engine)["a"] == ("UNAVAILABLE", EVICTED["changed"])
    answer = await engine.infer(request("a"))
    np.testing.assert_allclose(answer.outputs["probabilities"], answer_of(new_model), rtol=1e-5)
    assert engine.registry.budget.of("a").evictions == {"changed": 1}
    assert engine.registry.budget.host_used() <= int(1.5 * model_bytes)
