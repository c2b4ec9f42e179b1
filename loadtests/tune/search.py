"""The search: coordinate descent over the space, hill climbing along each ordered axis.

From the original config, each axis in turn (front-end workers when tune owns the server,
batch size, delay, preferred sizes, instances, threads) is walked from the current best value
towards the better neighbour for as long as the throughput at the SLO keeps rising by more than
`MIN_GAIN`; values that are not on the order (delay `auto`, the preferred-size shapes) are tried
once each. The best few candidates are then measured again beside the original, in the same
conditions, and the pick is the one whose worse measurement is best, if that beats every
measurement of the original (else the original stays): a lucky trial cannot win alone, and a
candidate wins only by more than the original's own spread. The pick then faces the original in
CONFIRM_ROUNDS paired rounds (the two measured back to back, the order swapped each round) and
replaces it only if it wins every round: a machine's speed drifts over minutes, and only
measurements taken side by side cancel the drift, so the winner is never below the original.

Throughput at a p99 SLO rises and then falls along each of these axes (bigger batches amortise
the per-batch cost until their latency busts the SLO; more instances or threads help until the
cores are oversubscribed), so a climb finds each axis's best in two to four trials instead of
trying every value, and one pass costs about the sum of the axes' lengths' logarithms rather
than their product. Instances and threads are coupled (their product is bounded by the cores),
so threads are searched after instances, within what the instances leave.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from loadtests.tune.space import Candidate, Space, effective

MIN_GAIN = 0.03
"""A neighbour must beat the current best by this fraction to move the climb (noise guard)."""
FINALISTS = 3
"""Candidates besides the original measured again at the end."""
CONFIRM_ROUNDS = 2
"""Paired rounds, the pick against the original, that the pick must each win to replace it."""


@dataclass(slots=True)
class StepPoint:
    """One concurrency step of a trial."""

    users: int
    ok_rps: float
    p99_ms: float | None
    error_fraction: float
    meets_slo: bool


@dataclass(slots=True)
class Trial:
    """One measured candidate."""

    index: int
    phase: str
    """"search", "final" (the re-measurement) or "confirm1", "confirm2"... (the paired rounds)."""
    candidate: Candidate
    config: dict[str, Any]
    ok_rps: float
    """Successful requests per second of the best step within the SLO (0 when none was)."""
    p99_ms: float | None
    """p99 of that step (of the first step when none met the SLO)."""
    users: int | None
    steps: list[StepPoint] = field(default_factory=list)
    error: str | None = None
    """Why the candidate could not be measured (it failed to load, say)."""
    seconds: float = 0.0
    reused: bool = False
    """Measured by an earlier run in the same folder (not saved: true only while resuming)."""

    @property
    def passed(self) -> bool:
        return self.error is None and self.ok_rps > 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "phase": self.phase,
            "key": self.candidate.key,
            "candidate": self.candidate.to_dict(),
            "config": self.config,
            "ok_rps": self.ok_rps,
            "p99_ms": self.p99_ms,
            "users": self.users,
            "steps": [_slots(step) for step in self.steps],
            "error": self.error,
            "seconds": self.seconds,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Trial:
        return cls(
            index=int(data["index"]),
            phase=str(data["phase"]),
            candidate=Candidate.from_dict(data["candidate"]),
            config=dict(data["config"]),
            ok_rps=float(data["ok_rps"]),
            p99_ms=None if data.get("p99_ms") is None else float(data["p99_ms"]),
            users=None if data.get("users") is None else int(data["users"]),
            steps=[StepPoint(**step) for step in data.get("steps", [])],
            error=data.get("error"),
            seconds=float(data.get("seconds", 0.0)),
        )


def _slots(step: StepPoint) -> dict[str, Any]:
    return {name: getattr(step, name) for name in StepPoint.__slots__}


Measure = Callable[[Candidate, dict[str, Any], str, int], Trial]
"""(candidate, its config, phase, index) -> the measured trial."""


class Observer(Protocol):
    def trial_started(self, index: int, planned: int, candidate: Candidate) -> None: ...

    def trial_finished(self, trial: Trial, best: Trial | None) -> None: ...


class BudgetSpent(Exception):
    """No time is left for another trial."""


class Search:
    """Runs the search with `measure`, reusing `done` trials (a resumed run) and stopping before
    a trial that would not fit in `budget_s`, judged by the longer of `expected_trial_s` (what a
    trial that runs every step of the ramp should take) and the longest trial so far. The
    estimate is a floor for the whole run, not only until the first trial: a trial that ended
    early (its config failed to load, or it missed the SLO at its first step) says nothing of
    how long the next one runs, and the budget is a bound the search keeps."""

    def __init__(
        self,
        space: Space,
        measure: Measure,
        budget_s: float,
        done: Sequence[Trial] = (),
        observer: Observer | None = None,
        on_trial: Callable[[Trial], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        expected_trial_s: float = 0.0,
    ) -> None:
        self.space = space
        self.trials: list[Trial] = []
        self.reused = 0
        self.budget_exhausted = False
        self._measure = measure
        self._budget_s = budget_s
        self._done = {(t.phase, t.candidate.key): t for t in done}
        self._observer = observer
        self._on_trial = on_trial
        self._clock = clock
        self._started = clock()
        self._longest_s = expected_trial_s  # a floor: raised by longer trials, never lowered

    def planned(self) -> int:
        """An upper bound on the trials: the original, every other value of every axis once,
        the final re-measurements and the paired rounds."""
        axes = self.space.axes(self.space.baseline)
        finals = FINALISTS + 1 + 2 * CONFIRM_ROUNDS
        return 1 + sum(len(values) - 1 for _, values, _ in axes) + finals

    def run(self) -> Trial | None:
        """Search, re-measure the finalists, confirm the pick, and return the winner (None when
        no candidate met the SLO). Stops early, keeping what it measured, when the budget is
        spent (a pick not yet confirmed then loses to the original)."""
        try:
            best = self._trial(self.space.baseline, "search")
            for name, values, ordered in self.space.axes(best.candidate):
                best = self._axis(best, name, values, ordered)
            return self._final()
        except BudgetSpent:
            self.budget_exhausted = True
            return self._winner()

    def _axis(self, best: Trial, name: str, values: Sequence[Any], ordered: bool) -> Trial:
        current = getattr(best.candidate, name)
        if name == "intra_op_threads":  # coupled: what the chosen instances leave
            values = self.space.threads(best.candidate.instances)
        ranked = [v for v in values if ordered and not isinstance(v, str)]
        extras = [v for v in values if v not in ranked and v != current]
        if current in ranked:
            best = self._climb(best, name, ranked, ranked.index(current))
        elif ranked:  # the original lies off the order (e.g. delay auto): try each point
            extras = [*ranked, *extras]
        for value in extras:
            best = _better(best, self._try(best.candidate, name, value))
        return best

    def _climb(self, best: Trial, name: str, ranked: list[Any], at: int) -> Trial:
        neighbours = [i for i in (at - 1, at + 1) if 0 <= i < len(ranked)]
        tried = {i: self._try(best.candidate, name, ranked[i]) for i in neighbours}
        winner = max(tried.items(), key=lambda item: _score(item[1]), default=None)
        if winner is None or not _gains(winner[1], best):
            return best
        index, best = winner
        step = 1 if index > at else -1
        index += step
        while 0 <= index < len(ranked):
            trial = self._try(best.candidate, name, ranked[index])
            if not _gains(trial, best):
                break
            best = trial
            index += step
        return best

    def _try(self, base: Candidate, name: str, value: Any) -> Trial:
        candidate = self.space.fit(replace(base, **{name: value}))
        return self._trial(candidate, "search")

    def _final(self) -> Trial | None:
        baseline = self.space.baseline.key
        ranked = sorted(
            (t for t in self.trials if t.phase == "search" and t.passed),
            key=_score,
            reverse=True,
        )
        finalists = [t.candidate for t in ranked if t.candidate.key != baseline][:FINALISTS]
        for candidate in [self.space.baseline, *finalists]:
            self._trial(candidate, "final")
        pick = self._pick()
        if pick is not None and pick.candidate.key != baseline:
            for round_ in range(1, CONFIRM_ROUNDS + 1):
                pair = [self.space.baseline, pick.candidate]
                for candidate in pair if round_ % 2 else pair[::-1]:
                    self._trial(candidate, f"confirm{round_}")
        return self._winner()

    def _winner(self) -> Trial | None:
        """The pick (`_pick`) once it has won every paired round against the original; else the
        original. (A pick that won because the original missed the SLO stands unconfirmed.)"""
        pick = self._pick()
        original = self.space.baseline.key
        finals = {t.candidate.key: t for t in self.trials if t.phase == "final"}
        if pick is None or pick.candidate.key == original or original not in finals:
            return pick
        if self.worst_ok_rps(original) > 0 and not self.confirmed(pick.candidate.key):
            return finals[original]
        return pick

    def confirmed(self, key: str) -> bool:
        """Whether candidate `key` beat the original in each of the CONFIRM_ROUNDS paired
        rounds (a round not measured, for want of budget, is not won)."""
        original = self.space.baseline.key
        for round_ in range(1, CONFIRM_ROUNDS + 1):
            runs = {t.candidate.key: t for t in self.trials if t.phase == f"confirm{round_}"}
            if key not in runs or original not in runs:
                return False
            if not runs[key].passed or runs[key].ok_rps <= runs[original].ok_rps:
                return False
        return True

    def _pick(self) -> Trial | None:
        """Of the candidates measured in the final, the one whose worse measurement is best,
        provided it beats every measurement of the original; else the original (or, when the
        budget ended the search first, the best search trial). Two measurements of one config
        differ by more than a few percent on a shared machine: a candidate whose worse run
        only beats the original's worse run may be no better at all."""
        finals = {t.candidate.key: t for t in self.trials if t.phase == "final"}
        if not finals:
            searched = [t for t in self.trials if t.passed]
            return max(searched, key=_score, default=None)
        worst = {key: self.worst_ok_rps(key) for key in finals}
        passed = [key for key in finals if worst[key] > 0]
        if not passed:
            return None
        original = self.space.baseline.key
        bar = max((t.ok_rps for t in self._runs(original)), default=0.0)
        beating = [key for key in passed if key != original and worst[key] > bar]
        if beating:
            return finals[max(beating, key=worst.__getitem__)]
        if original in passed:
            return finals[original]
        return finals[max(passed, key=worst.__getitem__)]  # the original missed the SLO once

    def worst_ok_rps(self, key: str) -> float:
        """A candidate's lowest throughput at the SLO over its search and final measurements (0
        if one missed)."""
        runs = self._runs(key)
        if not runs or not all(t.passed for t in runs):
            return 0.0
        return min(t.ok_rps for t in runs)

    def _runs(self, key: str) -> list[Trial]:
        """A candidate's search and final measurements (the paired rounds are judged apart)."""
        return [t for t in self.trials if t.candidate.key == key and t.phase in ("search", "final")]

    def best(self) -> Trial | None:
        return max((t for t in self.trials if t.passed), key=_score, default=None)

    def _trial(self, candidate: Candidate, phase: str) -> Trial:
        key = (phase, candidate.key)
        config = self.space.config(candidate)
        meaning = effective(config)
        for trial in self.trials:
            # Measured already in this phase: a climb revisits its start, and two candidates may
            # make the same config (preferred "none" where the original lists none) on the same
            # server (workers are not in the config).
            if trial.phase == phase and (
                trial.candidate.key == key[1]
                or (
                    trial.candidate.workers == candidate.workers
                    and effective(trial.config) == meaning
                )
            ):
                return trial
        index = len(self.trials) + 1
        reused = self._done.get(key)
        if reused is not None:
            reused.index = index
            reused.reused = True
            self.reused += 1
            self._longest_s = max(self._longest_s, reused.seconds)
            self._record(reused)
            return reused
        spent = self._clock() - self._started
        if spent + self._longest_s > self._budget_s:
            raise BudgetSpent()
        if self._observer is not None:
            self._observer.trial_started(index, self.planned(), candidate)
        started = self._clock()
        trial = self._measure(candidate, config, phase, index)
        trial.seconds = self._clock() - started
        self._longest_s = max(self._longest_s, trial.seconds)
        self._record(trial)
        return trial

    def _record(self, trial: Trial) -> None:
        self.trials.append(trial)
        if self._on_trial is not None:
            self._on_trial(trial)
        if self._observer is not None:
            self._observer.trial_finished(trial, self.best())


def _score(trial: Trial) -> tuple[float, float]:
    """Higher throughput at the SLO first, then lower p99."""
    return (trial.ok_rps if trial.passed else 0.0, -(trial.p99_ms or 0.0))


def _better(best: Trial, trial: Trial) -> Trial:
    return trial if _gains(trial, best) else best


def _gains(trial: Trial, best: Trial) -> bool:
    if not trial.passed:
        return False
    if not best.passed:
        return True
    return trial.ok_rps > best.ok_rps * (1 + MIN_GAIN)
