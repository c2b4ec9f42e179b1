"""Loading one model version: auto-complete of max_batch_size, warm-up, clear load failures."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from batching.assembly import Padding
from engine.backends.onnxruntime import OnnxBackend
from engine.engine import Engine
from engine.model import BatchRunner, batch_size_limit, load_model, padding_plan, warm_up
from engine.model_config import ModelConfig, OnnxRuntimeOptions, PadSpec
from engine.settings import BatchingDefaults
from engine.types import TensorSpec
from server.settings import load_settings
from tests.models import add_sub_model, fixed_shape_model, identity_model, write_model

DYNAMIC = (TensorSpec("x", "FP32", (-1, 4)),)
FIXED = (TensorSpec("x", "FP32", (2, 3)),)
MIXED = (TensorSpec("x", "FP32", (-1, 4)), TensorSpec("y", "FP32", (3,)))


class RecordingBackend:
    """A real OnnxBackend that remembers the shapes of every feed it ran."""

    def __init__(self, backend: OnnxBackend) -> None:
        self.inner = backend
        self.inputs = backend.inputs
        self.outputs = backend.outputs
        self.platform = backend.platform
        self.provider = backend.provider
        self.fed: list[dict[str, tuple[tuple[int, ...], str]]] = []
        self.on_loop: list[bool] = []
        """Per run: whether it ran on the event loop's thread (else in the pool)."""

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.fed.append({k: (v.shape, v.dtype.str) for k, v in inputs.items()})
        self.on_loop.append(threading.current_thread() is threading.main_thread())
        return self.inner.run(inputs)

    def close(self) -> None:
        self.inner.close()


def recording(tmp_path: Path, model: object) -> RecordingBackend:
    path = write_model(tmp_path, "m", model)  # type: ignore[arg-type]
    return RecordingBackend(OnnxBackend(path, OnnxRuntimeOptions(), "m"))


@pytest.mark.parametrize(
    ("configured", "inputs", "limit"),
    [
        (None, DYNAMIC, 32),  # auto-complete: dynamic first axis -> batching with the default
        (None, FIXED, 0),  # auto-complete: fixed shape -> unbatched
        (None, MIXED, 0),  # one input without a batch axis -> unbatched
        (None, (), 0),
        (0, DYNAMIC, 0),  # the config may turn batching off
        (8, DYNAMIC, 8),
        (0, FIXED, 0),
    ],
)
def test_batch_size_limit(
    configured: int | None, inputs: tuple[TensorSpec, ...], limit: int
) -> None:
    assert batch_size_limit(ModelConfig(max_batch_size=configured), inputs, 32) == limit


def test_batching_config_on_fixed_shape_model_fails_clearly() -> None:
    with pytest.raises(ValueError, match="max_batch_size is 4 but inputs y have no dynamic"):
        batch_size_limit(ModelConfig(max_batch_size=4), MIXED, 32)


def test_warm_up_runs_each_clipped_batch_size_once(tmp_path: Path) -> None:
    backend = recording(tmp_path, identity_model("FP32"))
    warm_up(backend, [1, 8, 100, 200], max_batch_size=16)
    assert [feed["INPUT0"][0] for feed in backend.fed] == [(1, 4), (8, 4), (16, 4)]


def test_warm_up_of_unbatched_model_uses_the_fixed_shape(tmp_path: Path) -> None:
    backend = recording(tmp_path, fixed_shape_model("INT16", (2, 3)))
    warm_up(backend, [1, 4], max_batch_size=0)
    assert backend.fed == [{"INPUT0": ((2, 3), "<i2")}]


def test_warm_up_feeds_every_input_with_its_dtype(tmp_path: Path) -> None:
    backend = recording(tmp_path, add_sub_model())
    warm_up(backend, [2], max_batch_size=4)
    assert backend.fed == [{"INPUT0": ((2, 4), "<f4"), "INPUT1": ((2, 4), "<f4")}]


def test_warm_up_of_a_string_model(tmp_path: Path) -> None:
    backend = recording(tmp_path, identity_model("BYTES"))
    warm_up(backend, [3], max_batch_size=4)
    assert backend.fed == [{"INPUT0": ((3, 4), "|O")}]


async def test_load_model_auto_completes_from_the_model(tmp_path: Path) -> None:
    defaults = BatchingDefaults(max_batch_size=12)
    dynamic = write_model(tmp_path, "dyn", identity_model("FP32"))
    fixed = write_model(tmp_path, "fix", fixed_shape_model())
    models = [
        await load_model("dyn", 1, dynamic, ModelConfig(), defaults),
        await load_model("fix", 1, fixed, ModelConfig(), defaults),
    ]
    try:
        assert [m.max_batch_size for m in models] == [12, 0]
        assert models[0].label == "model 'dyn' version 1"
        assert models[0].inputs() == (TensorSpec("INPUT0", "FP32", (-1, 4)),)
    finally:
        for model in models:
            await model.close()


async def runs_on_the_loop(tmp_path: Path, before_run: Callable[[], None], runs: int) -> list[bool]:
    """Per run of an inline-capable BatchRunner whose backend calls `before_run` first: whether
    it ran on the loop's thread."""
    backend = recording(tmp_path, identity_model("FP32"))
    run = backend.run

    def prefixed(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        before_run()
        return run(inputs)

    backend.run = prefixed  # type: ignore[method-assign]
    executor = ThreadPoolExecutor(1)
    runner = BatchRunner(backend, executor, inline=True)
    try:
        for _ in range(runs):
            await runner({"INPUT0": np.ones((1, 4), np.float32)})
    finally:
        executor.shutdown()
        backend.close()
    return backend.on_loop


async def test_a_cheap_model_runs_on_the_loop_even_while_the_loop_is_busy(tmp_path: Path) -> None:
    """A run's cost is the work it does, not the wall time around it: in the pool, a run waits
    for the GIL while the loop thread holds it, and that wait, taken for the run, kept a 10 µs
    model in the pool (a thread hop per batch) for as long as the loop stayed busy. The wait is
    played here by milliseconds in which the run's thread does no work (a busy loop's GIL is
    not reproducible: how long a pool thread waits for it ranged from 0.5 ms to 18 s)."""

    def waited() -> None:
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.002)  # waiting, not working: the thread's CPU clock does not move

    on_loop = await runs_on_the_loop(tmp_path, waited, 100)
    assert on_loop[0] is False  # the first run's cost is unknown: the pool
    # The cold first run costs about a millisecond; the moving average forgets it within 50.
    assert on_loop[-50:] == [True] * 50


async def test_a_cheap_run_stays_on_the_loop_when_its_process_is_descheduled(
    tmp_path: Path,
) -> None:
    """On a core shared with other processes (a worker beside the engine process), an inline
    run is sometimes descheduled midway: its wall time then counts another process's turn. Taken
    for its cost, one such turn (1.5 ms under the earlier 200 µs bound, 10 ms under today's)
    sent a 40 µs model into the pool for the next dozen runs, each thread hand-off dearer than
    the run. The turns are played here by milliseconds in which the loop's thread does no
    work."""

    def descheduled() -> None:
        if threading.current_thread() is threading.main_thread():
            time.sleep(0.002)  # another process's turn: this thread's CPU clock does not move

    assert (await runs_on_the_loop(tmp_path, descheduled, 60))[-50:] == [True] * 50


async def test_a_run_of_a_few_hundred_microseconds_stays_on_the_loop(tmp_path: Path) -> None:
    """The benchmark MLP's batches of 25-64 rows cost about 200 µs of CPU in a loaded engine
    process, right at the old 200 µs bound: 94 of 849 batches went to the pool and back, each
    hand-off dearer than the run. Runs under a millisecond stay inline, once the moving average
    has forgotten the cold first run (over a millisecond on a loaded machine: the full suite's)."""

    def costly() -> None:
        until = time.thread_time() + 0.0003  # 300 µs of this thread's CPU, however loaded
        while time.thread_time() < until:
            pass

    assert (await runs_on_the_loop(tmp_path, costly, 100))[-50:] == [True] * 50


async def test_load_model_refuses_batching_on_a_fixed_shape_model(tmp_path: Path) -> None:
    path = write_model(tmp_path, "fix", fixed_shape_model())
    with pytest.raises(ValueError, match="max_batch_size is 4 but inputs INPUT0 have no dynamic"):
        await load_model("fix", 1, path, ModelConfig(max_batch_size=4), BatchingDefaults())


async def test_engine_reports_the_failed_load_and_serves_the_rest(tmp_path: Path) -> None:
    write_model(tmp_path, "fix", fixed_shape_model(), config_yaml="max_batch_size: 4\n")
    write_model(tmp_path, "ok", identity_model("FP32"))
    engine = Engine(load_settings(model_repository=tmp_path, grpc_enabled=False))
    await engine.start()
    try:
        rows = {row["name"]: row for row in await engine.repository_index()}
        assert rows["ok"]["state"] == "READY"
        assert rows["fix"]["state"] == "UNAVAILABLE"
        reason = rows["fix"]["reason"]
        assert "max_batch_size is 4 but inputs INPUT0 have no dynamic first axis" in reason
        assert await engine.model_ready("ok")
        assert not await engine.model_ready("fix")
        assert not engine.ready  # a model that was asked for did not load
    finally:
        await engine.close()


# -- padding: which output axes follow a padded input axis ----------------------------------------

IDS = (TensorSpec("ids", "INT64", (-1, -1), ("batch", "seq")),)
ENCODER_OUTPUTS = (
    TensorSpec("logits", "FP32", (-1, 4), ("batch", None)),
    TensorSpec("hidden", "FP32", (-1, -1, 8), ("batch", "seq", None)),
    TensorSpec("attention", "FP32", (-1, -1, -1), ("batch", "seq", "seq")),
    TensorSpec("pooled", "FP32", (-1, -1), ("batch", "tokens")),
)


def pad(**spec: object) -> dict[str, PadSpec]:
    return {"ids": PadSpec.model_validate({"axis": 1, **spec})}


def test_padding_follows_the_symbolic_dim_name_of_the_padded_axis() -> None:
    plan = padding_plan(pad(value=5), IDS, ENCODER_OUTPUTS)
    assert plan["ids"] == Padding(1, 5, {"hidden": (1,), "attention": (1, 2)})


def test_padding_outputs_in_the_config_override_the_dim_names() -> None:
    plan = padding_plan(pad(outputs={"pooled": 1, "attention": [2]}), IDS, ENCODER_OUTPUTS)
    assert plan["ids"].outputs == {"pooled": (1,), "attention": (2,)}
    assert padding_plan(pad(outputs={}), IDS, ENCODER_OUTPUTS)["ids"].outputs == {}


def test_padding_of_an_unnamed_axis_follows_no_output() -> None:
    unnamed = (TensorSpec("ids", "INT64", (-1, -1), ("batch", None)),)
    assert padding_plan(pad(), unnamed, ENCODER_OUTPUTS)["ids"].outputs == {}


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"outputs": {"nope": 1}}, "dynamic_batching.pad.ids.outputs names output 'nope'; the "
         "model's outputs are logits, hidden, attention, pooled"),
        ({"outputs": {"logits": 2}}, "dynamic_batching.pad.ids.outputs.logits is 2; output "
         "'logits' has shape [-1, 4] (axes 1 to 1 can follow the padded axis)"),
        ({"outputs": {"hidden": [1, 3]}}, "dynamic_batching.pad.ids.outputs.hidden is [1, 3]; "
         "output 'hidden' has shape [-1, -1, 8]"),
        ({"axis": 2}, "dynamic_batching.pad.ids.axis is 2; input 'ids' has shape [-1, -1] "
         "(axes 1 to 1 can be padded)"),
    ],
)  # fmt: skip
def test_padding_that_names_what_the_model_lacks_is_a_config_error(
    spec: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        padding_plan(pad(**spec), IDS, ENCODER_OUTPUTS)
    with pytest.raises(ValueError, match="pad names input 'x'; the model's inputs are ids"):
        padding_plan({"x": PadSpec(axis=1)}, IDS, ENCODER_OUTPUTS)


def test_padding_output_axes_exclude_the_batch_axis() -> None:
    with pytest.raises(ValidationError, match="greater than 0"):
        PadSpec.model_validate({"axis": 1, "outputs": {"hidden": 0}})


async def test_a_model_whose_padding_names_an_unknown_output_does_not_load(
    tmp_path: Path,
) -> None:
    config = "dynamic_batching:\n  pad:\n    INPUT0: {axis: 1, outputs: {OUTPUT9: 1}}\n"
    write_model(tmp_path, "padded", identity_model("FP32", ("batch", "seq")), config)
    engine = Engine(load_settings(model_repository=tmp_path, grpc_enabled=False))
    await engine.start()
    try:
        (row,) = await engine.repository_index()
        assert row["state"] == "UNAVAILABLE"
        assert "pad.INPUT0.outputs names output 'OUTPUT9'" in row["reason"]
    finally:
        await engine.close()


async def test_a_loaded_model_pads_by_the_dim_names_of_its_onnx_file(tmp_path: Path) -> None:
    config = ModelConfig.model_validate({"dynamic_batching": {"pad": {"INPUT0": {"axis": 1}}}})
    path = write_model(tmp_path, "padded", identity_model("FP32", ("batch", "seq")))
    model = await load_model("padded", 1, path, config, BatchingDefaults())
    try:
        assert model.batcher.policy.padding == {"INPUT0": Padding(1, 0, {"OUTPUT0": (1,)})}
    finally:
        await model.close()
