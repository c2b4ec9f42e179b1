"""loadtests.benchmarks.raw: the limit, raw ONNX Runtime samples/s at each batch size."""

from __future__ import annotations

from pathlib import Path

import onnx

from loadtests.benchmarks.models import MLP_SIZES, benchmark_mlp
from loadtests.benchmarks.raw import BATCHES, measure


def test_every_batch_size_is_measured(tmp_path: Path) -> None:
    onnx.save(benchmark_mlp(), tmp_path / "mlp.onnx")
    rows = measure(tmp_path / "mlp.onnx", (MLP_SIZES[0],), seconds=0.01)
    assert [row["batch"] for row in rows] == list(BATCHES)
    assert all(row["samples_per_s"] > 0 for row in rows)
