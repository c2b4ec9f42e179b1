"""The engine facade on a real demo model: coalesced deadlines, drain, and reload failures."""

from __future__ import annotations

import asyncio
import gc
import shutil
import time
import weakref
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest

from engine.demo import write_demo_repository
from engine.engine import Engine
from engine.errors import DeadlineExceeded, InvalidInput, Overloaded, RateLimited
from engine.types import Checked, InferRequest
from engine.validate import check_inputs
from server.settings import load_settings


def request(x: np.ndarray, timeout_s: float | None = None) -> InferRequest:
    return InferRequest("demo", {"x": x}, {"x": "FP32"}, timeout_s=timeout_s)


@pytest.fixture
async def engine(tmp_path: Path) -> AsyncIterator[Engine]:
    repo = write_demo_repository(tmp_path / "models")
    config = repo / "demo" / "config.yaml"
    config.write_text(config.read_text() + "cache: {enabled: true, ttl_s: 60}\n")
    engine = Engine(
        load_settings(model_repository=repo, model_control_mode="explicit", load_models=["*"])
    )
    await engine.start()
    yield engine
    await engine.close()


async def test_a_coalesced_caller_keeps_its_own_deadline(engine: Engine) -> None:
    batcher = engine.registry.resolve("demo", None).batcher
    batcher.pause()  # hold the shared computation in the queue
    x = np.ones((1, 16), np.float32)
    patient = asyncio.create_task(engine.infer(request(x)))
    await asyncio.sleep(0)
    with pytest.raises(DeadlineExceeded):
        await engine.infer(request(x, timeout_s=0.05))
    batcher.resume()
    answer = await asyncio.wait_for(patient, 10)  # not failed by the other caller's timeout
    assert answer.outputs["probabilities"].shape == (1, 10)


async def test_drain_serves_a_request_accepted_before_it(engine: Engine) -> None:
    batcher = engine.registry.resolve("demo", None).batcher
    batcher.pause()
    accepted = asyncio.create_task(engine.infer(request(np.zeros((1, 16), np.float32))))
    await asyncio.sleep(0)
    draining = asyncio.create_task(engine.drain())
    await asyncio.sleep(0)
    batcher.resume()
    await asyncio.wait_for(draining, 10)
    assert (await accepted).outputs["probabilities"].shape == (1, 10)


async def test_a_failed_reload_keeps_the_serving_version(engine: Engine, tmp_path: Path) -> None:
    x = np.ones((1, 16), np.float32)
    before = (await engine.infer(request(x))).outputs["probabilities"]
    (tmp_path / "models" / "demo" / "1" / "model.onnx").write_bytes(b"not an onnx model")
    with pytest.raises(InvalidInput, match="failed to load model 'demo'"):
        await engine.load_model("demo")
    after = await engine.infer(request(x, timeout_s=5))
    np.testing.assert_allclose(after.outputs["probabilities"], before)


async def test_tenants_do_not_share_cached_results_unless_configured(engine: Engine) -> None:
    x = np.full((1, 16), 3.0, np.float32)
    first = InferRequest("demo", {"x": x}, {"x": "FP32"}, tenant="a")
    again = InferRequest("demo", {"x": x}, {"x": "FP32"}, tenant="a")
    other = InferRequest("demo", {"x": x}, {"x": "FP32"}, tenant="b")
    assert (await engine.infer(first)).parameters["cache_hit"] is False
    assert (await engine.infer(again)).parameters["cache_hit"] is True
    assert (await engine.infer(other)).parameters["cache_hit"] is False


async def test_a_timeout_counts_from_when_the_front_end_took_the_request(engine: Engine) -> None:
    """The front-end's clock starts at the request's arrival (decoding, a worker hop and
    admission come first): a request that arrived 1 s ago with a 0.5 s timeout is answered
    DeadlineExceeded without running. An `arrived` that cannot be (later than now, or hours
    ago: it may come from another process) is not believed."""
    stats = engine.registry.resolve("demo", None).stats
    x = np.full((1, 16), 0.25, np.float32)
    late = request(x, timeout_s=0.5)
    late.arrived = time.monotonic() - 1.0
    ran = stats.execution_count
    with pytest.raises(DeadlineExceeded, match=r"past its timeout.*it was not run"):
        await engine.infer(late)
    assert stats.execution_count == ran  # refused before it ran
    for unbelievable in (time.monotonic() + 60.0, time.monotonic() - 7200.0):
        odd = request(x, timeout_s=0.5)
        odd.arrived = unbelievable
        assert (await engine.infer(odd)).outputs["probabilities"].shape == (1, 10)


async def test_requests_the_queue_refuses_unrun_are_not_charged(tmp_path: Path) -> None:
    """A full queue's 503 and a queued timeout's 504 run nothing: their quota is refunded (it
    was kept, so a tenant's day quota went to requests it never got answers for)."""
    repo = write_demo_repository(tmp_path / "models")
    config = repo / "demo" / "config.yaml"
    config.write_text(
        config.read_text() + "max_batch_size: 1\ndynamic_batching: {max_queue_size: 2}\n"
    )
    settings = load_settings(model_repository=repo, rate_limit={"default": {"quota_per_day": 100}})
    engine = Engine(settings)
    await engine.start()
    try:
        batcher = engine.registry.resolve("demo", None).batcher
        batcher.pause()
        x = np.ones((1, 16), np.float32)
        first = asyncio.create_task(engine.infer(request(x)))
        await asyncio.sleep(0)
        with pytest.raises(DeadlineExceeded, match="it was not run"):
            await engine.infer(request(x, timeout_s=0.01))
        second = asyncio.create_task(engine.infer(request(x)))
        await asyncio.sleep(0)  # the queue's two places are taken
        with pytest.raises(Overloaded, match="queue is full"):
            await engine.infer(request(x))
        batcher.resume()
        await asyncio.wait_for(asyncio.gather(first, second), 10)
        usage = await engine.limiter.usage("anonymous")
        assert usage["day"]["used"] == 2
    finally:
        await engine.close()


async def test_a_repeat_at_a_higher_priority_is_not_held_at_the_lower_level(
    tmp_path: Path,
) -> None:
    """A priority-1 request identical to a queued priority-2 one joined that computation and
    was served after the whole priority-2 backlog."""
    repo = write_demo_repository(tmp_path / "models")
    config = repo / "demo" / "config.yaml"
    config.write_text(
        "max_batch_size: 1\ncache: {enabled: true, ttl_s: 60}\n"
        "dynamic_batching: {priority_levels: 2, default_priority_level: 2}\n"
    )
    engine = Engine(load_settings(model_repository=repo))
    await engine.start()
    try:
        batcher = engine.registry.resolve("demo", None).batcher
        batcher.pause()
        done: list[str] = []

        async def ask(name: str, value: float, priority: int) -> None:
            x = np.full((1, 16), value, np.float32)
            await engine.infer(InferRequest("demo", {"x": x}, {"x": "FP32"}, priority=priority))
            done.append(name)

        tasks = [asyncio.create_task(ask(f"low{i}", i, 2)) for i in range(3)]
        tasks.append(asyncio.create_task(ask("X low", 9, 2)))
        await asyncio.sleep(0)
        tasks.append(asyncio.create_task(ask("X high", 9, 1)))
        await asyncio.sleep(0)
        batcher.resume()
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
        assert done.index("X high") < done.index("low1")
    finally:
        await engine.close()


class HeldRuns:
    """The demo model's batches wait inside their run until `gate` is set."""

    def __init__(self, engine: Engine) -> None:
        self.batcher = engine.registry.resolve("demo", None).batcher
        self.gate, self.entered = asyncio.Event(), asyncio.Event()
        self.runs = 0
        run = self.batcher._run_batch

        async def held(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            self.runs += 1
            self.entered.set()
            await self.gate.wait()
            return await run(inputs)

        self.batcher._run_batch = held  # type: ignore[method-assign]


async def test_a_cached_request_whose_timeout_passes_while_it_runs_gets_its_answer(
    engine: Engine,
) -> None:
    """As without the cache: a timeout counts while the request is queued. With the cache the
    caller was answered 504 while its computation ran (and the result was thrown away)."""
    held = HeldRuns(engine)
    asked = asyncio.create_task(engine.infer(request(np.ones((1, 16), np.float32), 0.05)))
    await asyncio.wait_for(held.entered.wait(), 5)
    await asyncio.sleep(0.1)  # the timeout passes while the batch runs
    held.gate.set()
    answer = await asyncio.wait_for(asked, 5)
    assert answer.outputs["probabilities"].shape == (1, 10)


async def test_a_cached_caller_who_left_past_its_timeout_holds_no_inputs(engine: Engine) -> None:
    """Its inputs are let go once its computation is over, without the cyclic collector (which
    the server runs seldom): the caller waited for the running computation inside the timeout's
    `except TimeoutError`, so its CancelledError carried the TimeoutError as its context, whose
    traceback held asyncio.timeout's Timeout, which held the task, which kept the CancelledError
    (a server's request task is never asked for it)."""
    held = HeldRuns(engine)
    x = np.ones((1, 16), np.float32)
    alive = weakref.ref(x)
    gc.disable()
    try:
        asked = asyncio.create_task(engine.infer(request(x, 0.05)))
        del x
        await asyncio.wait_for(held.entered.wait(), 5)
        await asyncio.sleep(0.1)  # the timeout passes while the batch runs
        asked.cancel()  # the client leaves
        await asyncio.wait([asked])
        assert asked.cancelled()
        del asked
        held.gate.set()
        deadline = time.monotonic() + 5  # the computation ends in its own task
        while alive() is not None:
            assert time.monotonic() < deadline, "the request's inputs are still held"
            await asyncio.sleep(0.005)
    finally:
        gc.enable()


async def test_a_concurrency_slot_is_held_until_a_left_request_s_batch_is_over(
    tmp_path: Path,
) -> None:
    """max_concurrent 1: a caller who leaves while its request runs gave its slot back at
    once, so the tenant's next request ran beside the one still running."""
    repo = write_demo_repository(tmp_path / "models")
    settings = load_settings(model_repository=repo, rate_limit={"default": {"max_concurrent": 1}})
    engine = Engine(settings)
    await engine.start()
    try:
        held = HeldRuns(engine)
        x = np.ones((1, 16), np.float32)
        left = asyncio.create_task(engine.infer(request(x)))
        await asyncio.wait_for(held.entered.wait(), 5)
        left.cancel()  # its client went away; the batch runs on
        with pytest.raises(asyncio.CancelledError):
            await left
        with pytest.raises(RateLimited):  # (it was admitted, and waited behind the held batch)
            await asyncio.wait_for(engine.infer(request(x)), 2)
        held.gate.set()
        deadline = time.monotonic() + 5  # the batch finishes in its own task (and thread)
        while (await engine.limiter.usage("anonymous"))["concurrency"]["in_flight"]:
            assert time.monotonic() < deadline, "the slot was never given back"
            await asyncio.sleep(0.005)
        assert (await engine.infer(request(x))).outputs["probabilities"].shape == (1, 10)
        assert held.runs == 2
    finally:
        await engine.close()


# -- each per-request check once ------------------------------------------------------------------


def checked_request(check: object, x: np.ndarray, version: str | None = None) -> InferRequest:
    """A request as the data plane hands it over: its inputs' declared shapes and datatypes
    run through `check` on the way (InferRequest.checked)."""
    checked = Checked(check)  # type: ignore[arg-type]
    checked({"x": x.shape}, {"x": "FP32"})
    asked = InferRequest("demo", {"x": x}, {"x": "FP32"}, model_version=version)
    asked.checked = checked
    return asked


async def test_a_request_is_served_by_the_version_its_check_resolved(tmp_path: Path) -> None:
    """The front-end's input check resolved the model: the engine does not resolve it again
    while that version serves (two versions served: the check of version 1 for a request for
    the latest is answered by version 1; resolving again, by version 2)."""
    repo = write_demo_repository(tmp_path / "models")
    shutil.copytree(repo / "demo" / "1", repo / "demo" / "2")
    config = repo / "demo" / "config.yaml"
    config.write_text(config.read_text() + "version_policy: {all: true}\n")
    engine = Engine(load_settings(model_repository=repo))
    await engine.start()
    try:
        first = engine.registry.resolve("demo", "1")
        x = np.ones((1, 16), np.float32)
        assert (await engine.infer(request(x))).model_version == "2"  # the latest
        assert (await engine.infer(checked_request(first.input_check, x))).model_version == "1"
        # A check of another model, or none that ran, resolves the request as before.
        other = checked_request(lambda shapes, types: None, x)
        assert (await engine.infer(other)).model_version == "2"
    finally:
        await engine.close()


async def test_inputs_its_check_passed_are_not_checked_again(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Shapes and datatypes are checked once: by the model's input check as the front-end
    decodes them, or by the engine for a request that comes without one."""
    calls: list[object] = []

    def counted(*args: object) -> int:
        calls.append(args)
        return check_inputs(*args)  # type: ignore[arg-type]

    model = engine.registry.resolve("demo", None)
    x = np.zeros((2, 16), np.float32)
    stamped = checked_request(model.input_check, x)  # the front-end's check: before counting
    monkeypatch.setattr("engine.model.check_inputs", counted)
    monkeypatch.setattr("engine.validate.check_inputs", counted)
    assert (await engine.infer(stamped)).outputs["probabilities"].shape == (2, 10)
    assert calls == []
    assert (await engine.infer(request(x))).outputs["probabilities"].shape == (2, 10)
    assert len(calls) == 1


async def test_the_engine_serves_a_request_the_data_plane_let_in_before_a_drain(
    engine: Engine,
) -> None:
    """Draining is refused once, by the data plane before it decodes a request: one it let in
    is answered, not refused again by the engine."""
    engine.stop_accepting()
    answer = await engine.infer(request(np.zeros((1, 16), np.float32)))
    assert answer.outputs["probabilities"].shape == (1, 10)


async def test_a_request_s_statistics_count_from_the_engine_s_receipt(engine: Engine) -> None:
    """The request's clock starts when the data plane took it (`arrived`: its deadline counts
    from there); the model's statistics count from the engine's receipt, as Triton's `success`
    does (decoding is the front-end's: docs/protocol/triton-extensions.md)."""
    stats = engine.registry.resolve("demo", None).stats
    before = stats.success.as_dict()["ns"]
    late = request(np.full((1, 16), 7.0, np.float32), timeout_s=5)
    late.arrived = time.monotonic() - 0.5
    await engine.infer(late)
    assert 0 < stats.success.as_dict()["ns"] - before < 0.5e9
