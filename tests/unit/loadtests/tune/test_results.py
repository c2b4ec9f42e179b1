"""loadtests/tune/results.py: results.json, as write_report leaves it, read back by a resumed run,
which refuses one measured with other settings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtests.tune.report import write_report
from loadtests.tune.results import ResumeError, TuneRun, load_saved
from tests.unit.loadtests.tune.runs import SETTINGS, tune_run


@pytest.fixture
def run() -> TuneRun:
    return tune_run()


def test_results_round_trip_for_a_resume(run: TuneRun, tmp_path: Path) -> None:
    write_report(run, tmp_path)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["winner"] == "b32-d2ms-poriginal-i1-t1"
    original, trials = load_saved(tmp_path, SETTINGS) or (None, [])
    assert original == run.original
    assert [t.to_dict() for t in trials] == [t.to_dict() for t in run.trials]


def test_a_folder_of_other_settings_is_not_resumed(run: TuneRun, tmp_path: Path) -> None:
    write_report(run, tmp_path)
    with pytest.raises(ResumeError, match=r"slo_p99_ms 20\.0 there, 10\.0 now"):
        load_saved(tmp_path, {**SETTINGS, "slo_p99_ms": 10.0})
    (tmp_path / "results.json").write_text("{half")
    with pytest.raises(ResumeError, match="cannot be resumed"):
        load_saved(tmp_path, SETTINGS)


def test_no_earlier_run_is_nothing_to_resume(tmp_path: Path) -> None:
    assert load_saved(tmp_path, SETTINGS) is None
