"""Fake TensorRT plans, batches and backends shared by the TensorRT backend's tests: the plans
are built by the fake TensorRT 10 in tests/fakes."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType

import numpy as np

from engine.backends.tensorrt import TensorRTBackend
from engine.model_config import InstanceGroup, TensorRTOptions

TENSORS = [
    {"name": "x", "mode": "input", "dtype": "FLOAT", "shape": [-1, 4]},
    {"name": "ids", "mode": "input", "dtype": "INT64", "shape": [-1, -1]},
    {"name": "y", "mode": "output", "dtype": "FLOAT", "shape": [-1, 4], "copy_of": "x"},
    {"name": "ids_out", "mode": "output", "dtype": "INT64", "shape": [-1, -1], "copy_of": "ids"},
]
PROFILE_0 = {"x": [[1, 4], [4, 4], [8, 4]], "ids": [[1, 1], [4, 16], [8, 32]]}
PROFILE_1 = {"x": [[1, 4], [4, 4], [8, 4]], "ids": [[1, 1], [4, 64], [8, 64]]}


def write_plan(
    folder: Path, trt: ModuleType, record: dict[str, object] | None = None, **kw: object
) -> Path:
    version = folder / "1"
    version.mkdir(parents=True, exist_ok=True)
    path = version / "model.plan"
    path.write_bytes(trt.plan(TENSORS, kw.pop("profiles", [PROFILE_0]), **kw))  # type: ignore[arg-type]
    if record is not None:
        (version / "conversion.json").write_text(json.dumps({"tensorrt": record}))
    return path


def batch(rows: int, length: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "x": rng.standard_normal((rows, 4)).astype(np.float32),
        "ids": rng.integers(0, 1 << 40, (rows, length), dtype=np.int64),
    }


def open_backend(
    path: Path, groups: list[InstanceGroup] | None = None, **options: object
) -> TensorRTBackend:
    if groups is None:
        return TensorRTBackend(path, TensorRTOptions(**options), "model 'm' version 1")  # type: ignore[arg-type]
    return TensorRTBackend(path, TensorRTOptions(**options), "model 'm' version 1", groups)  # type: ignore[arg-type]


# Profiles as `sluice convert` builds them: one per preferred batch size bucket.
SMALL = {"x": [[1, 4], [4, 4], [4, 4]], "ids": [[1, 1], [4, 16], [4, 32]]}
LARGE = {"x": [[5, 4], [8, 4], [8, 4]], "ids": [[5, 1], [8, 16], [8, 32]]}


def concurrent_batches(backend: TensorRTBackend, count: int) -> None:
    feeds = [batch(1 + seed % 8, 1 + seed % 32, seed) for seed in range(count)]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(backend.run, feeds))
    for feed, out in zip(feeds, results, strict=True):
        np.testing.assert_array_equal(out["y"], feed["x"])
        np.testing.assert_array_equal(out["ids_out"], feed["ids"])
