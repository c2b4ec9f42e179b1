"""The many-models benchmark's repository and traffic (loadtests/benchmarks/many_models.py):
MLPs of mixed sizes and a few two-step pipelines, written by code from a seed and kept between
runs, and a Zipf-distributed trace of requests at a fixed (Poisson) rate over them."""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import onnx

from engine.demo import mlp_model
from loadtests.benchmarks.eviction_sim import mixed_sizes, zipf_trace

WIDTH = 16
"""Every MLP is WIDTH -> hidden -> WIDTH (softmax), so two chain into a pipeline."""
BYTES_PER_HIDDEN = 4 * (2 * WIDTH + 1)
"""Weight bytes per hidden unit: two FP32 matrices of WIDTH and the hidden layer's bias."""
CONFIG = "max_batch_size: 8\nonnxruntime:\n  intra_op_threads: 1\n  inter_op_threads: 1\n"
DONE = ".complete"


@dataclass(frozen=True)
class Plan:
    """What the repository holds: `models` plain MLPs of `low`..`high` weight bytes (log-uniform)
    and `pipelines` pipelines of two MLPs of their own (drawn the same way), from `seed`."""

    models: int = 200
    pipelines: int = 4
    low: int = 300_000
    high: int = 30_000_000
    seed: int = 0

    def weights(self) -> dict[str, int]:
        """Weight bytes of every MLP file: m000... then the pipelines' steps p0_a, p0_b..."""
        drawn = mixed_sizes(self.models + 2 * self.pipelines, self.low, self.high, self.seed)
        sizes = list(drawn.values())
        named = {f"m{i:03d}": sizes[i] for i in range(self.models)}
        for p in range(self.pipelines):
            for k, step in enumerate("ab"):
                named[f"p{p}_{step}"] = sizes[self.models + 2 * p + k]
        return named

    def steps(self) -> dict[str, tuple[str, str]]:
        """Each pipeline's two steps."""
        return {f"p{p}": (f"p{p}_a", f"p{p}_b") for p in range(self.pipelines)}

    def targets(self) -> list[str]:
        """The names requests go to: the plain models and the pipelines (not their steps)."""
        return [f"m{i:03d}" for i in range(self.models)] + list(self.steps())

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]


def hidden(weight_bytes: int) -> int:
    """The hidden width that gives an MLP about `weight_bytes` of weights."""
    return max(1, round(weight_bytes / BYTES_PER_HIDDEN))


def write_repository(root: Path, plan: Plan) -> Path:
    """Write every model of `plan` under `root` (each MLP from its own seed)."""
    for index, (name, size) in enumerate(sorted(plan.weights().items())):
        folder = root / name
        (folder / "1").mkdir(parents=True, exist_ok=True)
        model = mlp_model((WIDTH, hidden(size), WIDTH), seed=plan.seed * 100_003 + index)
        onnx.save(model, folder / "1" / "model.onnx")
        (folder / "config.yaml").write_text(CONFIG)
    for name, (first, second) in plan.steps().items():
        (root / name).mkdir(parents=True, exist_ok=True)
        (root / name / "config.yaml").write_text(
            "pipeline:\n  steps:\n"
            f"    - {{model: {first}, inputs: {{x: X}}, outputs: {{probabilities: H}}}}\n"
            f"    - {{model: {second}, inputs: {{x: H}}, outputs: {{probabilities: Y}}}}\n"
        )
    return root


def cached_repository(plan: Plan, cache: Path | None = None) -> Path:
    """The repository of `plan`, written once into the temp folder (keyed by the plan) and
    reused by later runs: generating a few GB of weights should not dominate a run."""
    root = (cache or Path(tempfile.gettempdir())) / f"sluice-many-models-{plan.key()}"
    if (root / DONE).exists():
        return root
    shutil.rmtree(root, ignore_errors=True)  # a run stopped while writing it
    write_repository(root, plan)
    (root / DONE).write_text(json.dumps(asdict(plan)))
    return root


def request_body(name: str, seed: int = 0) -> bytes:
    """A JSON infer request for a plain model (input `x`) or a pipeline (input `X`)."""
    data = np.random.default_rng(seed).standard_normal(WIDTH).round(4).tolist()
    tensor = "X" if name.startswith("p") else "x"
    message = {"inputs": [{"name": tensor, "datatype": "FP32", "shape": [1, WIDTH], "data": data}]}
    return json.dumps(message).encode()


@dataclass(frozen=True)
class Trace:
    """Requests in order: each one's send time (seconds from the start) and model."""

    times: list[float]
    names: list[str]


def make_trace(names: list[str], rate_rps: float, seconds: float, s: float, seed: int) -> Trace:
    """Poisson arrivals at `rate_rps` for `seconds`, each to a model drawn with probability
    ~ 1/rank^s (ranks shuffled over `names` by `seed`): the same trace for every server."""
    if rate_rps <= 0 or seconds <= 0:
        raise ValueError(f"rate_rps and seconds must be > 0, got {rate_rps} and {seconds}")
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate_rps, size=int(rate_rps * seconds * 1.5) + 16)
    times = np.cumsum(gaps)
    times = times[times < seconds].tolist()
    return Trace(times, zipf_trace(names, len(times), s, seed))
