"""loadtests.benchmarks.shared_memory: the repository it serves, the benchmark models plus a
pooling model whose cost is moving its input."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from engine.model_config import load_model_config
from loadtests.benchmarks.models import MODELS
from loadtests.benchmarks.shared_memory import LARGE, pool_model, repository


def test_the_pool_model_averages_each_channel() -> None:
    session = ort.InferenceSession(pool_model().SerializeToString())
    x = np.random.default_rng(0).standard_normal((2, *LARGE)).astype(np.float32)
    (y,) = session.run(None, {"x": x})
    np.testing.assert_allclose(y.reshape(2, 3), x.mean(axis=(2, 3)), atol=1e-5)


def test_the_repository_adds_the_pool_model(tmp_path: Path) -> None:
    assert repository(tmp_path) == tmp_path
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*MODELS, "pool"])
    assert load_model_config(tmp_path / "pool").max_batch_size == 8
