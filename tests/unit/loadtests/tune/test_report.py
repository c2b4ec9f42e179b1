"""The tune report folder: the winner's config.yaml (a config sluice accepts), a table of every
candidate in report.md and report.html (plots inlined), and results.json (test_results.py reads
it back)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from engine.model_config import ModelConfig
from loadtests.tune.report import front, write_report
from loadtests.tune.results import ResumeError, TuneRun, load_saved
from loadtests.tune.search import Trial
from loadtests.tune.space import Candidate
from tests.unit.loadtests.tune.runs import ORIGINAL, SETTINGS, tune_run


@pytest.fixture
def run() -> TuneRun:
    return tune_run()


def test_the_winner_is_written_ready_for_the_repository(run: TuneRun, tmp_path: Path) -> None:
    write_report(run, tmp_path)
    written = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert written == {**ORIGINAL, "max_batch_size": 32}
    assert ModelConfig(**written).max_batch_size == 32
    assert (tmp_path / "config.yaml").read_text().startswith("# sluice tune winner")


def test_every_candidate_is_in_the_report_and_the_plots_are_inlined(
    run: TuneRun, tmp_path: Path
) -> None:
    write_report(run, tmp_path)
    markdown = (tmp_path / "report.md").read_text()
    rows = [line for line in markdown.splitlines() if line.startswith("| ") and "ms |" in line]
    assert len([r for r in rows if r.split("|")[2].strip() in ("search", "final")]) == 5
    assert "5 **winner** | final | 32" in markdown
    assert "misses SLO" in markdown
    assert "5 trials (0 reused from an earlier run in this folder) out of a full grid of 1,234" in (
        markdown
    )
    page = (tmp_path / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 2
    for name in ("candidates.png", "front.png"):
        assert (tmp_path / name).read_bytes().startswith(b"\x89PNG")


def test_no_winner_writes_no_config(run: TuneRun, tmp_path: Path) -> None:
    run.winner = run.winner_config = None
    write_report(run, tmp_path)
    assert not (tmp_path / "config.yaml").exists()
    report = (tmp_path / "report.md").read_text()
    assert "No candidate met the p99 SLO of 20 ms in both its search and final" in report


def test_the_front_keeps_only_points_nothing_beats() -> None:
    points = [(5.0, 100.0), (6.0, 90.0), (7.0, 150.0), (9.0, 140.0), (12.0, 200.0)]
    assert front(points) == [(5.0, 100.0), (7.0, 150.0), (12.0, 200.0)]


def test_without_serve_cmd_no_server_yaml_and_workers_are_said_not_searched(
    run: TuneRun, tmp_path: Path
) -> None:
    write_report(run, tmp_path)
    assert not (tmp_path / "server.yaml").exists()
    assert "they were not searched (pass `--serve-cmd`" in (tmp_path / "report.md").read_text()


def test_a_searched_workers_winner_goes_to_server_yaml_and_the_report(
    run: TuneRun, tmp_path: Path
) -> None:
    owned = {**SETTINGS, "serve_cmd": "sluice serve --model-control-mode explicit",
             "served_workers": 1, "workers": [1, 2]}  # fmt: skip
    trials = [
        Trial(1, "search", Candidate(64, 0.002, "original", 1, 1, 1), ORIGINAL, 900.0, 9.0, 4),
        Trial(2, "search", Candidate(64, 0.002, "original", 1, 1, 2), ORIGINAL, 1200.0, 8.0, 4),
        Trial(3, "final", Candidate(64, 0.002, "original", 1, 1, 1), ORIGINAL, 890.0, 9.0, 4),
        Trial(4, "final", Candidate(64, 0.002, "original", 1, 1, 2), ORIGINAL, 1190.0, 8.0, 4),
    ]
    run.settings, run.trials, run.space = owned, trials, {"grid_size": 2, "workers": [1, 2]}
    run.baseline, run.winner, run.winner_config = (
        trials[0].candidate.key,
        trials[1].candidate.key,
        ORIGINAL,
    )
    run.winner_workers = 2
    write_report(run, tmp_path)
    assert yaml.safe_load((tmp_path / "server.yaml").read_text()) == {"workers": 2}
    assert "serve with --workers 2" in (tmp_path / "server.yaml").read_text()
    assert yaml.safe_load((tmp_path / "config.yaml").read_text()) == ORIGINAL  # model config only
    markdown = (tmp_path / "report.md").read_text()
    assert "Serve with `--workers 2` (`server.yaml`)" in markdown
    assert "searched over 1, 2 as the first axis" in markdown
    assert "1 search trial(s) at another count than the command's 1" in markdown
    assert "| 4 **winner** | final | 64 | 2 ms | original | 1 | 1 | 2 | 1,190.0 |" in markdown
    saved = json.loads((tmp_path / "results.json").read_text())
    assert (saved["winner_workers"], saved["workers_trials"]) == (2, 1)
    _, resumed = load_saved(tmp_path, owned) or (None, [])
    assert [t.candidate.workers for t in resumed] == [1, 2, 1, 2]  # a resume keeps them
    with pytest.raises(ResumeError, match="serve_cmd"):
        load_saved(tmp_path, {**owned, "serve_cmd": "sluice serve --other"})
