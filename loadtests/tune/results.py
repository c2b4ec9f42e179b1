"""results.json of a tune run: the settings, the original config, every trial and the winner.
It is rewritten after every trial, so an interrupted run can be resumed from it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loadtests.tune.search import Trial
from loadtests.tune.server import Original

RESULTS = "results.json"


class ResumeError(Exception):
    """The folder holds a run that cannot be resumed with these settings."""


@dataclass(slots=True)
class TuneRun:
    """Everything a tune run knows; `to_dict` is results.json."""

    settings: dict[str, Any]
    """What was asked (url, model, protocol, SLO, budget, concurrency, trial length, cores)."""
    original: Original
    space: dict[str, Any]
    trials: list[Trial] = field(default_factory=list)
    winner: str | None = None
    """The winning candidate's key (None while running, or when nothing met the SLO)."""
    winner_config: dict[str, Any] | None = None
    winner_workers: int | None = None
    """The winner's front-end workers, a server setting (None: not searched)."""
    baseline: str = ""
    reused: int = 0
    budget_exhausted: bool = False
    interrupted: bool = False
    finished: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "settings": self.settings,
            "original": self.original.to_dict(),
            "space": self.space,
            "baseline": self.baseline,
            "trials": [trial.to_dict() for trial in self.trials],
            "winner": self.winner,
            "winner_config": self.winner_config,
            "winner_workers": self.winner_workers,
            "workers_trials": self.workers_trials(),
            "trials_measured": len(self.trials) - self.reused,
            "trials_reused": self.reused,
            "budget_exhausted": self.budget_exhausted,
            "interrupted": self.interrupted,
            "finished": self.finished,
        }

    def workers_trials(self) -> int:
        """Search trials the workers axis cost: those at another count than the server's own."""
        served = self.settings.get("served_workers")
        return sum(
            1
            for t in self.trials
            if t.phase == "search" and t.candidate.workers not in (None, served)
        )

    def save(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        path = out / RESULTS
        partial = path.with_suffix(".json.tmp")
        partial.write_text(json.dumps(self.to_dict(), indent=2, allow_nan=False) + "\n")
        partial.replace(path)  # never half a file to resume from


RESUMED_KEYS = ("model", "protocol", "slo_p99_ms", "users", "trial_s", "batch_size", "serve_cmd")
"""Settings a resumed run must share with the saved one (its trials measured those)."""


def load_saved(out: Path, settings: dict[str, Any]) -> tuple[Original, list[Trial]] | None:
    """The original config and trials of an earlier run in `out` (None when there is none);
    ResumeError when it measured something else."""
    path = out / RESULTS
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        saved = data["settings"]
        original = Original.from_dict(data["original"])
        trials = [Trial.from_dict(raw) for raw in data["trials"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ResumeError(f"{path} cannot be resumed: {exc!r}") from exc
    different = [k for k in RESUMED_KEYS if saved.get(k) != settings.get(k)]
    if different:
        shown = ", ".join(f"{k} {saved.get(k)!r} there, {settings.get(k)!r} now" for k in different)
        raise ResumeError(
            f"{path} holds a tune with other settings ({shown}); use another --out or the same "
            "settings"
        )
    return original, trials
