"""Loading one model version: auto-complete of max_batch_size, warm-up, clear load failures."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.backends.onnxruntime import OnnxBackend
from engine.engine import Engine
from engine.model import batch_size_limit, load_model, warm_up
from engine.model_config import ModelConfig, OnnxRuntimeOptions
from engine.settings import BatchingDefaults, load_settings
from engine.types import TensorSpec
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

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.fed.append({k: (v.shape, v.dtype.str) for k, v in inputs.items()})
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
        rows = {row["name"]: row for row in engine.repository_index()}
        assert rows["ok"]["state"] == "READY"
        assert rows["fix"]["state"] == "UNAVAILABLE"
        reason = rows["fix"]["reason"]
        assert "max_batch_size is 4 but inputs INPUT0 have no dynamic first axis" in reason
        assert engine.model_ready("ok")
        assert not engine.model_ready("fix")
        assert not engine.ready  # a model that was asked for did not load
    finally:
        await engine.close()
