"""loadtests.benchmarks.models: the two benchmark models, built by code, and the repository the
benchmarks serve them from."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from engine.model_config import load_model_config
from loadtests.benchmarks.models import CNN_INPUT, MAX_BATCH, MODELS, cnn_model, write_repository


def test_the_cnn_maps_images_to_ten_logits_and_is_deterministic() -> None:
    model = cnn_model(channels=4, blocks=1)
    session = ort.InferenceSession(model.SerializeToString())
    x = np.random.default_rng(0).standard_normal((2, *CNN_INPUT)).astype(np.float32)
    (logits,) = session.run(None, {"x": x})
    assert logits.shape == (2, 10)
    assert cnn_model(channels=4, blocks=1).SerializeToString() == model.SerializeToString()


def test_the_repository_serves_each_model_with_its_batch_and_delay(tmp_path: Path) -> None:
    assert write_repository(tmp_path, delay_s=0.005) == tmp_path
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(MODELS)
    for name in MODELS:
        config = load_model_config(tmp_path / name)
        assert config.max_batch_size == MAX_BATCH[name]
        assert config.dynamic_batching.max_queue_delay_s == 0.005
        assert (tmp_path / name / "1" / "model.onnx").stat().st_size > 10_000
