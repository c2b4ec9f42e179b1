"""Measuring one candidate: (re)start the owned server with its workers, reload the model with
its config, then drive it with the load harness's own generator (`run_load_test`: locust at
increasing concurrency, stopping at the first step past the SLO) and keep the best step within
the SLO."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from loadtests.harness import LoadTestConfig, run_load_test
from loadtests.plan import best_step, meets_slo
from loadtests.runner import LoadTestError
from loadtests.tune.search import StepPoint, Trial
from loadtests.tune.serve import OwnedServer
from loadtests.tune.server import Original, ServerControl
from loadtests.tune.space import Candidate


class HarnessTrials:
    """The `Measure` of a real tune run: one load test per candidate under `out/trials/`."""

    def __init__(
        self,
        control: ServerControl,
        load: LoadTestConfig,
        out: Path,
        server: OwnedServer | None = None,
        original: Original | None = None,
    ) -> None:
        if load.slo_p99_ms is None:
            raise ValueError("a tune trial needs an SLO")
        self._control = control
        self._load = load
        self._out = out
        self._server = server
        self._original = original

    def __call__(
        self, candidate: Candidate, config: dict[str, Any], phase: str, index: int
    ) -> Trial:
        slo_ms = self._load.slo_p99_ms
        assert slo_ms is not None  # checked in __init__
        trial = Trial(index, phase, candidate, config, ok_rps=0.0, p99_ms=None, users=None)
        try:
            if self._server is not None and candidate.workers is not None:
                self._server.ensure(candidate.workers)  # a restart when the count changes
            if self._original is not None and config == self._original.config:
                # The original as it came (its folder's config.yaml: a plain load), as the
                # restore at the end serves it.
                self._control.restore(self._original)
            else:
                self._control.load(config)
        except LoadTestError as exc:  # it does not load or serve: it loses, the run goes on
            trial.error = f"load failed: {exc}"
            return trial
        folder = self._out / "trials" / f"{index:03d}-{phase}-{candidate.key}"
        result = run_load_test(dataclasses.replace(self._load, out=folder))
        limit = self._load.max_error_fraction
        trial.steps = [
            StepPoint(
                users=step.users,
                ok_rps=step.total.ok_rps,
                p99_ms=step.total.latency.p99_ms,
                error_fraction=step.error_fraction,
                meets_slo=meets_slo(step, slo_ms, limit),
            )
            for step in result.steps
        ]
        best, _ = best_step(result.steps, slo_ms, limit)
        if best is not None:
            trial.ok_rps = best.total.ok_rps
            trial.p99_ms = best.total.latency.p99_ms
            trial.users = best.users
        elif result.steps:
            trial.p99_ms = result.steps[0].total.latency.p99_ms
        if result.interrupted:
            raise KeyboardInterrupt
        return trial
