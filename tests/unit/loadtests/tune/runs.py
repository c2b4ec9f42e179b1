"""A small finished tune run (five trials, a winner) for the report and results tests."""

from __future__ import annotations

from typing import Any

from loadtests.tune.results import TuneRun
from loadtests.tune.search import StepPoint, Trial
from loadtests.tune.server import Original
from loadtests.tune.space import Candidate

SETTINGS: dict[str, Any] = {
    "url": "http://127.0.0.1:8000", "model": "demo", "protocol": "http", "slo_p99_ms": 20.0,
    "budget_s": 60.0, "users": [1, 4], "trial_s": 2, "cores": 2, "batch_size": 1,
}  # fmt: skip
ORIGINAL = {"max_batch_size": 64, "dynamic_batching": {"max_queue_delay_s": 0.002}}


def trial(index: int, phase: str, batch: int, rps: float, p99: float) -> Trial:
    candidate = Candidate(batch, 0.002, "original", 1, 1)
    config = {**ORIGINAL, "max_batch_size": batch}
    steps = [
        StepPoint(1, rps / 3, p99 / 2, 0.0, True),
        StepPoint(4, rps, p99, 0.0, p99 <= 20),
    ]
    return Trial(index, phase, candidate, config, rps if p99 <= 20 else 0.0, p99, 4, steps)


def tune_run() -> TuneRun:
    """Trial 2 (batch 32) wins over the original (batch 64); trial 3 misses the SLO."""
    trials = [
        trial(1, "search", 64, 900.0, 9.0),
        trial(2, "search", 32, 1000.0, 8.0),
        trial(3, "search", 128, 400.0, 35.0),
        trial(4, "final", 64, 880.0, 9.5),
        trial(5, "final", 32, 990.0, 8.2),
    ]
    return TuneRun(
        settings=SETTINGS,
        original=Original(ORIGINAL, "repository"),
        space={"grid_size": 1234},
        trials=trials,
        winner=trials[1].candidate.key,
        winner_config=trials[1].config,
        baseline=trials[0].candidate.key,
        finished=True,
    )
