"""The limit: raw in-process ONNX Runtime throughput of a model at batch sizes 1..64, one thread.

taskset -c 0 python -m loadtests.benchmarks.raw REPO MODEL  -> JSON lines on stdout
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

BATCHES = (1, 2, 4, 8, 16, 32, 64)


def measure(path: Path, shape: tuple[int, ...], seconds: float = 2.0) -> list[dict[str, float]]:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    rows = []
    for batch in BATCHES:
        x = np.random.default_rng(0).standard_normal((batch, *shape)).astype(np.float32)
        for _ in range(3):
            session.run(None, {name: x})
        runs, started = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - started) < seconds:
            session.run(None, {name: x})
            runs += 1
        rows.append({"batch": batch, "samples_per_s": runs * batch / elapsed})
    return rows


if __name__ == "__main__":
    repo, model = Path(sys.argv[1]), sys.argv[2]
    from loadtests.benchmarks.models import MODELS

    for row in measure(repo / model / "1" / "model.onnx", MODELS[model][1]):
        print(json.dumps(row))
